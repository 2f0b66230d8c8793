"""A job's checkpoint, the blob a worker sends in `job_checkpoint` or `job_preempted`: kept in
default_storage (the job row holds only its storage name and step), read back to resume the job,
deleted when a newer one replaces it or the job ends. The story: docs/protocol.md, "Pausing" under "The job"."""
from __future__ import annotations

import logging

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction

log = logging.getLogger(__name__)
CHECKPOINT_MAX_BYTES = 8 * 1024 * 1024  # the contract caps the base64 text at 8 MiB: its bytes are less


def checkpoint_save(job_id: str, step: int, data: bytes) -> str:
    """Store a checkpoint of the job at `step`; its storage name (never an existing file's: the
    storage picks another name, so the previous checkpoint stays until the row points elsewhere)."""
    if len(data) > CHECKPOINT_MAX_BYTES:
        raise ValueError(f"a checkpoint of {len(data)} bytes is over {CHECKPOINT_MAX_BYTES}")
    return default_storage.save(f"jobs/{job_id}/checkpoint-{step}.bin", ContentFile(data))


def checkpoint_read(name: str) -> bytes | None:
    """A stored checkpoint's bytes; None without one, or when its file is gone."""
    if not name:
        return None
    try:
        with default_storage.open(name, "rb") as stored:
            return bytes(stored.read())
    except FileNotFoundError:
        log.warning("checkpoint %s is missing: its job restarts from step 0", name)
        return None


def checkpoint_discard(name: str, *, keep: str = "") -> None:
    """Delete a checkpoint no row points at any more, once the change that dropped it commits (a
    rolled-back change still points at it). Nothing for an empty name or for `keep`, the name a
    storage that overwrites gave the new one. A failing storage only leaves a stray file."""
    if not name or name == keep:
        return

    def delete() -> None:
        try:
            default_storage.delete(name)
        except Exception:  # the storage is failing: a stray file is no reason to fail the answer
            log.exception("could not delete checkpoint %s", name)

    transaction.on_commit(delete)
