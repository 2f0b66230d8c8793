"""The job path's decisions, pure (no Django, no I/O): queue order, which worker gets which job,
and what happens to a job whose worker died. Order: higher priority first, then submission order
(`submitted_us`, then `job_id`); a job sent back keeps its key, so it regains its old place."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class QueuedJob(NamedTuple):
    """A queued job as the queue sees it (a tuple: 100,000 of them load in milliseconds)."""

    job_id: str
    model_id: str
    priority: int
    submitted_us: int

    @property
    def key(self) -> tuple[int, int, str]:
        return (-self.priority, self.submitted_us, self.job_id)


class Heads(Protocol):
    """What the dispatch decision reads of the queues (any JobQueues)."""

    def pop_for(self, model_ids: Iterable[str]) -> QueuedJob | None: ...


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


def plan_dispatch(queues: Heads, workers: Sequence[WorkerCapacity], *, depth: int) -> list[Assignment]:
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
