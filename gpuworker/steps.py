"""What the denoising loop says and keeps at a job's step boundaries: where a job stopped, its
job_preempted and job_checkpoint messages, the periodic checkpoint's timer, and the checkpoint a run
resumes from; docs/protocol.md, `job_preempted`, `job_checkpoint` and "Priority at every step"."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuworker.checkpoints import Checkpoint, CheckpointRefused
from gpuworker.pipelines import DEFAULT_STEPS
from potocolom.protocol.worker import JobCheckpoint, JobPreempted, Resume

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stopped:
    """Where a job left its run: after `step` of `steps`, with its checkpoint there (None when it
    could not be captured exactly, or when it never ran)."""

    step: int
    steps: int
    checkpoint: Checkpoint | None


def wire_checkpoint(job_id: str, checkpoint: Checkpoint | None) -> str | None:
    """A checkpoint as the wire's base64 text; None when there is none or it is over 8 MiB."""
    if checkpoint is None:
        return None
    try:
        return checkpoint.to_base64()
    except CheckpointRefused as exc:
        log.warning("job %s: its checkpoint after step %d is not sent: %s", job_id, checkpoint.step, exc)
        return None


def preempted_message(job_id: str, where: Stopped) -> dict[str, Any]:
    """The job_preempted for a job stopped at `where`."""
    return JobPreempted(job_id, where.step, where.steps, wire_checkpoint(job_id, where.checkpoint)).to_wire()


def checkpoint_message(job_id: str, checkpoint: Checkpoint | None) -> dict[str, Any] | None:
    """The job_checkpoint for a periodic capture; None when there is nothing to send."""
    text = wire_checkpoint(job_id, checkpoint)
    if text is None or checkpoint is None:
        return None
    return JobCheckpoint(job_id, checkpoint.step, checkpoint.steps, text).to_wire()


def never_ran(params: Any) -> Stopped:
    """Where a job that never ran stands: step 0 of the steps it would run (its `steps`, or the
    pipeline's default; img2img runs int(steps x strength) of them), with no checkpoint."""
    steps = params.get("steps") if isinstance(params, dict) else None
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else DEFAULT_STEPS
    strength = params.get("strength", 0.8) if isinstance(params, dict) else 0.8
    if isinstance(params, dict) and params.get("init_image") is not None and isinstance(strength, (int, float)):
        steps = max(1, min(steps, int(steps * strength)))
    return Stopped(0, steps, None)


def resume_from(set_aside: Stopped | None, resume: Resume | None, *, job_id: str) -> Checkpoint | None:
    """The checkpoint a run starts from: where the job was set aside here (in memory), else the
    API's `resume`; None (step 0) without one, or when the API's cannot be read (never a failure)."""
    if set_aside is not None:
        return set_aside.checkpoint
    if resume is None:
        return None
    try:
        return Checkpoint.from_base64(resume.checkpoint)
    except CheckpointRefused as exc:
        log.warning("job %s: its checkpoint after step %d cannot be read (%s); it restarts from step 0", job_id,
                    resume.step, exc)
        return None


class CheckpointTimer:
    """`due()` is polled at each step boundary of a job's runs: true at the first boundary after
    each `seconds` of running (counted from its first run's start; 0: never), by the injected
    clock. The time a job spends set aside for another does not count (its progress is what a
    checkpoint saves, and it makes none meanwhile): `set_aside()` stops the count, `go_on()`
    starts it again."""

    def __init__(self, seconds: float, clock: Callable[[], float]):
        self._clock = clock
        self._every = seconds if seconds > 0 else math.inf
        self._next = clock() + self._every if seconds > 0 else math.inf
        self._left: float | None = None  # while set aside: the running time until the next capture

    def set_aside(self) -> None:
        if self._left is None and self.active:
            self._left = max(0.0, self._next - self._clock())

    def go_on(self) -> None:
        if self._left is not None:
            self._next, self._left = self._clock() + self._left, None

    @property
    def active(self) -> bool:
        return self._next != math.inf

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._every
        return True

    def give_up(self) -> None:
        """No more captures this run (the job's checkpoint cannot be captured or sent)."""
        self._next = math.inf
