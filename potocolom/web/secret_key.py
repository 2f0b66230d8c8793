"""The SECRET_KEY when none is configured: made once, at random, and kept in a file only the
owner can read. Several processes may start at once; they all end up with the first key written."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

KEY_BYTES = 64  # token_urlsafe(64): 86 characters, far past check --deploy's 50 and 5 distinct


def secret_key_from_file(path: Path) -> str:
    """The key in `path`, made first if the file does not exist. The new key is written to a
    private temporary file beside it and linked into place, so no process ever reads a partial key
    and a second process's key never replaces the first's."""
    if not path.exists():
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secrets.token_urlsafe(KEY_BYTES) + "\n")
            try:
                os.link(temporary, path)  # fails if another process got there first: keep its key
            except FileExistsError:
                pass
        finally:
            temporary.unlink(missing_ok=True)
    key = path.read_text().strip()
    if len(key) < 50:
        raise ImproperlyConfigured(f"SECRET_KEY_FILE {path} holds no usable key (under 50 characters)")
    return key
