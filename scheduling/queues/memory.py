"""Queued jobs kept in this API process (JOB_QUEUE=memory: one API process owns its queue), in
fair-share order (scheduling/policy.py)."""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from scheduling.policy import (
    Candidate,
    QueuedJob,
    Turn,
    best_candidate,
    merge_turns,
    next_turn_us,
    place_in_turns,
    turn_key,
)

JobKey = tuple[int, int, str]


@dataclass
class _ModelQueue:
    """One model's queue: a line per account and the rotation of the accounts with a line."""

    lines: dict[str, list[JobKey]] = field(default_factory=dict)  # account -> its jobs' keys, sorted
    oldest: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # account -> (submitted_us, id), sorted
    rotation: list[tuple[int, str]] = field(default_factory=list)  # (turn key, account), sorted
    keys: dict[str, int] = field(default_factory=dict)  # account -> its key in the rotation
    clock_us: int = 0  # the latest turn a dispatch gave

    def lines_in_turn_order(self) -> list[tuple[str, int]]:
        return [(account, len(self.lines[account])) for _, account in self.rotation]


class MemoryQueues:
    """Queued jobs per model; one owner mutates it.

    push and remove are O(log n) searches plus list shifts; pop is O(models) plus that; position is
    O(accounts in the model's queue). Each model's queued jobs and their steps are counted as they
    come and go (`demand`).
    """

    shared = False  # no other process takes jobs from it

    def __init__(self) -> None:
        self._models: dict[str, _ModelQueue] = {}
        self._jobs: dict[str, QueuedJob] = {}
        self._last: dict[tuple[str, str], int] = {}  # (model, account) -> last dispatch's turn
        self._steps: dict[str, int] = {}  # model -> its queued jobs' steps summed

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def rebuild(self, jobs: Iterable[QueuedJob], turns: Iterable[Turn] = ()) -> None:
        """Replace the contents with `jobs` (the database's queued rows) and `turns` (each
        account's last dispatch per model)."""
        self._models, self._jobs = {}, {}
        self._last, self._steps = {}, {}
        for turn in turns:
            pair = (turn.model_id, turn.account)
            self._last[pair] = max(self._last.get(pair, turn.turn_us), turn.turn_us)
            queue = self._models.setdefault(turn.model_id, _ModelQueue())
            queue.clock_us = max(queue.clock_us, turn.turn_us)
        for job in {job.job_id: job for job in jobs}.values():  # the last row of a job id wins
            self._jobs[job.job_id] = job
            self._steps[job.model_id] = self._steps.get(job.model_id, 0) + job.steps
            queue = self._models.setdefault(job.model_id, _ModelQueue())
            queue.lines.setdefault(job.account, []).append(job.key)
            queue.oldest.setdefault(job.account, []).append((job.submitted_us, job.job_id))
        for model_id, queue in self._models.items():
            for account in queue.lines:
                queue.lines[account].sort()
                queue.oldest[account].sort()
                queue.keys[account] = self._key_of(model_id, account)
            queue.rotation = sorted((key, account) for account, key in queue.keys.items())

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]],
                     load_turns: Callable[[], Iterable[Turn]] | None = None) -> None:
        """Rebuild from the database's queued rows and turns (an API process starting)."""
        self.rebuild(load(), load_turns() if load_turns else ())

    def _key_of(self, model_id: str, account: str) -> int:
        return turn_key(self._last.get((model_id, account)), self._models[model_id].oldest[account][0][0])

    def _rekey(self, model_id: str, account: str) -> None:
        """Put the account at its right place in the rotation (or out of it, its line empty)."""
        queue = self._models[model_id]
        old = queue.keys.pop(account, None)
        if old is not None:
            del queue.rotation[bisect.bisect_left(queue.rotation, (old, account))]
        if queue.lines.get(account):
            key = self._key_of(model_id, account)
            queue.keys[account] = key
            bisect.insort(queue.rotation, (key, account))
        else:
            queue.lines.pop(account, None)
            queue.oldest.pop(account, None)

    def push(self, job: QueuedJob) -> bool:
        """Add a job; False (and no change) when it is queued already."""
        if job.job_id in self._jobs:
            return False
        job = job._replace(turn_us=None)
        self._jobs[job.job_id] = job
        self._steps[job.model_id] = self._steps.get(job.model_id, 0) + job.steps
        queue = self._models.setdefault(job.model_id, _ModelQueue())
        bisect.insort(queue.lines.setdefault(job.account, []), job.key)
        oldest = queue.oldest.setdefault(job.account, [])
        bisect.insort(oldest, (job.submitted_us, job.job_id))
        if job.account not in queue.keys or oldest[0][1] == job.job_id:
            self._rekey(job.model_id, job.account)
        return True

    def remove(self, job_id: str) -> QueuedJob | None:
        """Take a job out wherever it is; None when it is not queued."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self._steps[job.model_id] -= job.steps
            queue = self._models[job.model_id]
            line, oldest = queue.lines[job.account], queue.oldest[job.account]
            del line[bisect.bisect_left(line, job.key)]
            at = bisect.bisect_left(oldest, (job.submitted_us, job.job_id))
            del oldest[at]
            if not line or at == 0:
                self._rekey(job.model_id, job.account)
        return job

    def _candidates(self, model_ids: Iterable[str]) -> list[Candidate]:
        heads = []
        for model_id in model_ids:
            queue = self._models.get(model_id)
            if queue and queue.rotation:
                key, account = queue.rotation[0]
                heads.append(Candidate(key, account, queue.lines[account][0], model_id))
        return heads

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """The job that goes next to a worker serving these models, left in place."""
        best = best_candidate(self._candidates(model_ids))
        return self._jobs[best.job_key[2]] if best else None

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None:
        """Take the job that goes next to a worker serving these models; its account's turn moves to
        `at_us` (or just after the latest turn, without a time). The job returned carries that turn."""
        best = best_candidate(self._candidates(model_ids))
        if best is None:
            return None
        queue = self._models[best.model_id]
        turn = next_turn_us(at_us, clock_us=queue.clock_us, highest_key=queue.rotation[-1][0])
        queue.clock_us = turn
        self._last[(best.model_id, best.account)] = turn
        job = self.remove(best.job_key[2])
        assert job is not None
        self._rekey(best.model_id, best.account)
        return job._replace(turn_us=turn)

    def position(self, job_id: str) -> int | None:
        """The 1-based place among queued jobs of its model, in the order the turns give."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        queue = self._models[job.model_id]
        rank = bisect.bisect_left(queue.lines[job.account], job.key)
        return place_in_turns(rank, job.account, queue.lines_in_turn_order())

    def positions(self, job_ids: Iterable[str]) -> dict[str, int]:
        """The positions of those of these jobs that are queued (a page of jobs at once)."""
        found = {job_id: self.position(job_id) for job_id in job_ids}
        return {job_id: place for job_id, place in found.items() if place is not None}

    def queued(self, model_id: str) -> list[QueuedJob]:
        """A model's queued jobs in dispatch order."""
        queue = self._models.get(model_id)
        if queue is None:
            return []
        return [self._jobs[key[2]] for key in merge_turns(queue.lines[a] for _, a in queue.rotation)]

    def counts(self) -> dict[str, int]:
        """Queued jobs per model (models with none left out)."""
        counts = {model_id: sum(map(len, queue.lines.values())) for model_id, queue in self._models.items()}
        return {model_id: count for model_id, count in counts.items() if count}

    def demand(self) -> dict[str, tuple[int, int]]:
        """Per model with queued jobs: how many, and their steps summed (kept as jobs come and go)."""
        counts = self.counts()
        return {model_id: (count, self._steps.get(model_id, 0)) for model_id, count in counts.items()}

    def turns(self) -> list[Turn]:
        """Every account's last turn per model (operators, and tests comparing with the database)."""
        return [Turn(model_id, account, turn) for (model_id, account), turn in sorted(self._last.items())]
