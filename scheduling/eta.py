"""A queued job's estimated wait (`eta_seconds`), pure: the steps ahead of it over what its model's
copies do in a second; and the first estimate each job was given, kept to measure the estimate's
error when the job starts. The story: docs/protocol.md, "ETA"."""
from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from potocolom.runtime import Slot, runtime

FIRST_ETAS_KEPT = 10_000  # jobs whose first estimate waits for their start; the oldest are forgotten


@dataclass(frozen=True)
class ModelLoad:
    """What waits on one model and what serves it, as plain data: its queued jobs and their steps
    summed; the steps the held jobs (dispatched or running) on its copies' workers have left, of any
    model, and how many they are; the measured `step_ms` of each connected copy (None: not measured
    yet); the queued jobs and steps of other models that fall to those workers (each other model's
    queue shared out over its copies, counting the copies on these workers); and the time a job
    takes beyond its steps (loading the prompt, decoding, encoding the image), measured on the
    model's recent jobs."""

    queued_jobs: int = 0
    queued_steps: int = 0
    held_steps_left: int = 0
    copies_step_ms: tuple[float | None, ...] = ()
    shared_queued_jobs: float = 0.0
    shared_queued_steps: float = 0.0
    held_jobs: int = 0
    job_overhead_seconds: float = 0.0


def steps_per_second(copies_step_ms: Sequence[float | None]) -> float | None:
    """What the copies do together, in denoising steps a second; a copy not measured yet counts as
    the mean of those measured. None when none is measured (or there is no copy)."""
    measured = [ms for ms in copies_step_ms if ms is not None and ms > 0]
    if not measured:
        return None
    mean_ms = sum(measured) / len(measured)
    return sum(1000.0 / (ms if ms is not None and ms > 0 else mean_ms) for ms in copies_step_ms)


def eta_seconds(*, position: int | None, load: ModelLoad) -> float | None:
    """The estimated wait of the queued job at `position` (1-based, in the dispatcher's fair-share
    order) until it starts: the work ahead of it on its model's copies over what they do, where the
    work is the steps the held jobs there have left, (position − 1) queued jobs of the model's mean
    steps, and the share of other models' queued jobs that comes before it on the same workers (as
    many of theirs per job of this model as their queues hold per job of this model's queue), each
    job ahead also taking the model's measured time beyond its steps. None when it is not queued or
    no copy of its model has a measured step time (no estimate is better than a made-up one).

    Approximations: other models' jobs are taken to run at this model's step time, the queues of
    the models a worker serves to interleave evenly, and the copies to be one pool (a job starts when
    the work ahead of it drains, on whichever copy)."""
    if position is None or position < 1:
        return None
    rate = steps_per_second(load.copies_step_ms)
    if rate is None:
        return None
    before = position - 1
    mean_steps = load.queued_steps / load.queued_jobs if load.queued_jobs > 0 else 0.0
    share = before / load.queued_jobs if load.queued_jobs > 0 else 0.0  # of the others' queues, ahead of it
    steps = max(0, load.held_steps_left) + before * max(0.0, mean_steps) + share * max(0.0, load.shared_queued_steps)
    jobs = max(0, load.held_jobs) + before + share * max(0.0, load.shared_queued_jobs)
    return steps / rate + jobs * max(0.0, load.job_overhead_seconds) / max(1, len(load.copies_step_ms))


def job_overhead_seconds(runs: Sequence[tuple[float, int]], *, step_ms: float | None) -> float:
    """A model's time per job beyond its steps: the median over recent jobs (run seconds, steps) of
    the run less its steps at `step_ms`, never below 0; 0 without runs or a step time."""
    if not runs or step_ms is None or step_ms <= 0:
        return 0.0
    extra = sorted(max(0.0, seconds - steps * step_ms / 1000.0) for seconds, steps in runs)
    middle = len(extra) // 2
    return extra[middle] if len(extra) % 2 else (extra[middle - 1] + extra[middle]) / 2


def error_ratio(*, eta: float, actual: float) -> float | None:
    """|eta − actual| / actual: how far off an estimate was (0 exact, 1 off by the whole wait); None
    for a wait too short to divide by."""
    if actual <= 0:
        return None
    return abs(eta - actual) / actual


class FirstEtas:
    """The first estimate given for each job and when (microseconds), until the job starts; at most
    `kept` jobs, the oldest forgotten first. One per process: a job that starts on another API
    process than the one that estimated it goes unmeasured (docs/operations.md)."""

    def __init__(self, *, kept: int = FIRST_ETAS_KEPT) -> None:
        self.kept = kept
        self._lock = threading.Lock()  # services of several threads offer and take
        self._etas: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._etas)

    def offer(self, job_id: str, *, eta: float, at_us: int) -> None:
        """Keep the job's estimate unless it has one already."""
        with self._lock:
            if job_id in self._etas:
                return
            self._etas[job_id] = (eta, at_us)
            while len(self._etas) > self.kept:
                self._etas.popitem(last=False)

    def started(self, job_id: str, *, at_us: int) -> float | None:
        """The job started: its first estimate's error ratio (None: it had none, or waited no time)."""
        with self._lock:
            entry = self._etas.pop(job_id, None)
        if entry is None:
            return None
        eta, given_us = entry
        return error_ratio(eta=eta, actual=(at_us - given_us) / 1e6)

    def forget(self, job_id: str) -> None:
        """The job will not start from the queue it was estimated in (cancelled, paused)."""
        with self._lock:
            self._etas.pop(job_id, None)


# This process's: offered where a representation is built, taken where a job starts.
FIRST_ETAS = Slot("scheduling.first_etas", make=FirstEtas)


def first_etas() -> FirstEtas:
    """This process's first estimates."""
    return runtime.get(FIRST_ETAS)
