"""Retention's rules, pure (no Django, time passed in): which moment a purge counts from, and which
stored files a purged job leaves to delete (all live in its folder, `jobs/<id>/`).
docs/operations.md, "Retention"."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta


def retention_cutoff(now: datetime, days: int) -> datetime | None:
    """Rows older than this go: `days` before `now`; None when `days` is 0 (kept forever)."""
    if days < 0:
        raise ValueError(f"days must be 0 or more, not {days}")
    return now - timedelta(days=days) if days else None


@dataclass(frozen=True)
class JobFiles:
    """What a purged job's row pointed at in the storage (its images, a checkpoint left over, its
    init_image), and its folder, where a file no row pointed at may be left too (a checkpoint a
    crash kept, a result that came too late)."""

    job_id: str
    names: tuple[str, ...]

    @property
    def folder(self) -> str:
        return job_folder(self.job_id)


def job_folder(job_id: str) -> str:
    """Where a job's files are stored (images, checkpoints and init_image are saved under it)."""
    return f"jobs/{job_id}"


def job_files(job_id: str, *, images: Iterable[object], checkpoint: str, init_image: str) -> JobFiles:
    """A purged row's files: the storage names it holds (an entry of `images` that is not a name, in
    a row edited by hand, is left out)."""
    names = [name for name in images if isinstance(name, str) and name] + [checkpoint, init_image]
    return JobFiles(job_id, tuple(name for name in names if name))
