"""A file storage whose first saves fail as a full disk does: the one seam for a storage error
while the API stores a job's result (set through the STORAGES setting)."""
from __future__ import annotations

import errno
from typing import Any

from django.core.files.storage import FileSystemStorage


class FullDiskStorage(FileSystemStorage):
    """FileSystemStorage (under MEDIA_ROOT) that refuses its first `failures` saves with ENOSPC."""

    def __init__(self, *, failures: int = 1, **options: Any) -> None:
        super().__init__(**options)
        self.failures = failures

    def _save(self, name: str, content: Any) -> str:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return super()._save(name, content)
