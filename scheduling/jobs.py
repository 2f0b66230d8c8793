"""The job queue and the dispatch decision, as plain data and pure functions (no Django here).

Order: higher priority first, then submission order (`submitted_us`, then `job_id`). A job sent
back after its worker died keeps its key, so it regains its old place.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

JOB_DISPATCH_DEPTH = 2  # unfinished jobs a worker may hold: it encodes one while it denoises the next


class QueuedJob(NamedTuple):
    """A queued job as the queue sees it (a tuple: 100,000 of them load in milliseconds)."""

    job_id: str
    model_id: str
    priority: int
    submitted_us: int

    @property
    def key(self) -> tuple[int, int, str]:
        return (-self.priority, self.submitted_us, self.job_id)


class InProcessQueues:
    """Queued jobs per model, each kept sorted by key; one owner mutates it.

    push, remove and pop are O(log n) searches plus a list shift; position is a binary search.
    """

    def __init__(self) -> None:
        self._keys: dict[str, list[tuple[int, int, str]]] = {}
        self._jobs: dict[str, QueuedJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def rebuild(self, jobs: Iterable[QueuedJob]) -> None:
        """Replace the contents with `jobs` (the database's queued rows)."""
        self._jobs = {job.job_id: job for job in jobs}
        self._keys = {}
        for job in self._jobs.values():
            self._keys.setdefault(job.model_id, []).append(job.key)
        for keys in self._keys.values():
            keys.sort()

    def push(self, job: QueuedJob) -> bool:
        """Add a job; False (and no change) when it is queued already."""
        if job.job_id in self._jobs:
            return False
        self._jobs[job.job_id] = job
        bisect.insort(self._keys.setdefault(job.model_id, []), job.key)
        return True

    def remove(self, job_id: str) -> QueuedJob | None:
        """Take a job out wherever it is; None when it is not queued."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            keys = self._keys[job.model_id]
            del keys[bisect.bisect_left(keys, job.key)]
        return job

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """The job that goes next to a worker serving these models, left in place."""
        heads = [keys[0] for model_id in model_ids if (keys := self._keys.get(model_id))]
        return self._jobs[min(heads)[2]] if heads else None

    def pop_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """Take the job that goes next to a worker serving these models."""
        job = self.peek_for(model_ids)
        return self.remove(job.job_id) if job else None

    def position(self, job_id: str) -> int | None:
        """The 1-based place among queued jobs of its model; None when not queued."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        return bisect.bisect_left(self._keys[job.model_id], job.key) + 1

    def queued(self, model_id: str) -> list[QueuedJob]:
        """A model's queued jobs in dispatch order."""
        return [self._jobs[key[2]] for key in self._keys.get(model_id, [])]

    def counts(self) -> dict[str, int]:
        """Queued jobs per model (models with none left out)."""
        return {model_id: len(keys) for model_id, keys in self._keys.items() if keys}


class JobQueues(Protocol):
    """What the dispatcher needs of a queue: InProcessQueues here, RedisQueues (redis_queue.py)
    when several API processes share one."""

    def __len__(self) -> int: ...

    def __contains__(self, job_id: object) -> bool: ...

    def rebuild(self, jobs: Iterable[QueuedJob]) -> None: ...

    def push(self, job: QueuedJob) -> bool: ...

    def remove(self, job_id: str) -> QueuedJob | None: ...

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None: ...

    def pop_for(self, model_ids: Iterable[str]) -> QueuedJob | None: ...

    def position(self, job_id: str) -> int | None: ...

    def queued(self, model_id: str) -> list[QueuedJob]: ...

    def counts(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class WorkerCapacity:
    """What the dispatch decision needs to know of one connected worker."""

    worker_id: str
    models: frozenset[str]
    held: int
    joined: int  # connection order, for a stable tie-break


@dataclass(frozen=True)
class Assignment:
    job: QueuedJob
    worker_id: str


def plan_dispatch(queues: JobQueues, workers: Sequence[WorkerCapacity], *,
                  depth: int = JOB_DISPATCH_DEPTH) -> list[Assignment]:
    """Take jobs off the queues for workers with room, and say which worker gets each.

    A worker never holds more than `depth` unfinished jobs. Each job goes to the least-loaded
    worker that serves its model (earliest joined on a tie); among the jobs a worker can take it
    gets the best by priority, then submission order.
    """
    held = {w.worker_id: w.held for w in workers}
    assignments: list[Assignment] = []
    while True:
        candidates = sorted((w for w in workers if held[w.worker_id] < depth),
                            key=lambda w: (held[w.worker_id], w.joined))
        for worker in candidates:
            job = queues.pop_for(worker.models)
            if job is not None:
                held[worker.worker_id] += 1
                assignments.append(Assignment(job, worker.worker_id))
                break
        else:
            return assignments


def retry_decision(*, attempts: int) -> str:
    """What happens to a job whose worker died: 'requeue' on its first attempt, else 'fail'."""
    return "requeue" if attempts < 2 else "fail"


def worker_is_dead(*, last_seen: float, now: float, heartbeat_seconds: float) -> bool:
    """A worker that sent nothing for 3 heartbeat periods is dead."""
    return now - last_seen > 3 * heartbeat_seconds
