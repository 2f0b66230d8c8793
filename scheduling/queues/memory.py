"""Queued jobs kept in this API process (JOB_QUEUE=memory: one API process owns its queue)."""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from scheduling.policy import QueuedJob


class MemoryQueues:
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

    shared = False  # no other process takes jobs from it

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]]) -> None:
        """Rebuild from the database's queued rows (an API process starting)."""
        self.rebuild(load())
