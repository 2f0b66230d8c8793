"""Where queued jobs wait: one JobQueues interface, two backends (memory.py: this process's own;
redis.py: shared by every API process on the database), chosen once at start by JOB_QUEUE."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from scheduling.policy import QueuedJob, Turn


class JobQueues(Protocol):
    """Queued jobs per model in fair-share dispatch order (scheduling/policy.py). `shared`: other
    API processes take jobs from it too (so a job no worker here can take may wake them)."""

    shared: bool

    def __len__(self) -> int: ...

    def __contains__(self, job_id: object) -> bool: ...

    def rebuild(self, jobs: Iterable[QueuedJob], turns: Iterable[Turn] = ()) -> None: ...

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]],
                     load_turns: Callable[[], Iterable[Turn]] | None = None) -> None: ...

    def push(self, job: QueuedJob) -> bool: ...

    def remove(self, job_id: str) -> QueuedJob | None: ...

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None: ...

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None: ...

    def position(self, job_id: str) -> int | None: ...

    def queued(self, model_id: str) -> list[QueuedJob]: ...

    def counts(self) -> dict[str, int]: ...

    def turns(self) -> list[Turn]: ...
