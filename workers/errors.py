"""Why a worker's socket cannot go on (potocolom.web maps each code to its close code)."""
from __future__ import annotations

from potocolom.protocol.errors import DomainError


class WorkerIdTaken(DomainError):
    """This worker_id belongs to another worker token (the one that first said hello with it)."""

    code = "worker_id_taken"
