"""What happens at a job's step boundaries (progress, preview, cancel, preempt, checkpoint), as one
object that the pipeline's one `callback_on_step_end` calls; the story: docs/protocol.md,
"Worker → API" and "API → worker"."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuworker.checkpoints import Checkpoint

Ask = Callable[[], bool]
Progress = Callable[[int, int, "str | None"], None]  # (step, steps, preview)
Preview = Callable[[int, int, Any], "str | None"]  # (step, steps, latents): a base64 JPEG, or None
KeepCheckpoint = Callable[["Checkpoint | None"], None]


class JobCancelled(Exception):
    """The job was interrupted on request, at a step boundary, before its image was decoded."""


class PreemptedAtStep(Exception):
    """The job was stopped on request at a step boundary to run later from `checkpoint` (None when its
    scheduler cannot be resumed exactly: it then restarts from step 0), before its image was decoded."""

    def __init__(self, step: int, steps: int, checkpoint: Checkpoint | None):
        super().__init__(f"preempted after step {step} of {steps}")
        self.step, self.steps, self.checkpoint = step, steps, checkpoint


@dataclass(frozen=True)
class StepBoundary:
    """The boundary after `step` of a job's `steps` (0: before its first step), with its latents."""

    step: int
    steps: int
    latents: Any
    capture: Callable[[], Checkpoint | None]  # the job's state here, copied; None: not resumable exactly


@dataclass(frozen=True)
class StepHooks:
    """Everything a job does at its step boundaries; each part is optional (none: it runs through).

    After each step: leave if cancelled, make a preview, report progress, leave if cancelled since,
    then leave if preempted (with a checkpoint) or hand a checkpoint on when one is due. Before the
    first step, only the last two. Leaving raises JobCancelled or PreemptedAtStep.
    """

    progress: Progress | None = None
    preview: Preview | None = None
    cancelled: Ask | None = None
    preempted: Ask | None = None
    checkpoint_due: Ask | None = None
    on_checkpoint: KeepCheckpoint | None = None

    @property
    def captures(self) -> bool:
        """Whether a boundary may need the job's state (to preempt it or to checkpoint it)."""
        return self.preempted is not None or self.checkpoint_due is not None

    def before_first_step(self, boundary: StepBoundary) -> None:
        self._preempt_or_checkpoint(boundary)

    def step_end(self, boundary: StepBoundary) -> None:
        self._leave_if_cancelled()
        preview = self.preview(boundary.step, boundary.steps, boundary.latents) if self.preview else None
        if self.progress is not None:
            self.progress(boundary.step, boundary.steps, preview)
        self._leave_if_cancelled()  # asked while progress ran (frames between steps, a cancel)
        self._preempt_or_checkpoint(boundary)

    def _leave_if_cancelled(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise JobCancelled()

    def _preempt_or_checkpoint(self, boundary: StepBoundary) -> None:
        if self.preempted is not None and self.preempted():
            raise PreemptedAtStep(boundary.step, boundary.steps, boundary.capture())
        if self.checkpoint_due is not None and self.checkpoint_due() and self.on_checkpoint is not None:
            self.on_checkpoint(boundary.capture())
