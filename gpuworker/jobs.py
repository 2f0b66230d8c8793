"""A job this worker holds, from its `job` message until it is released, what the denoising thread
needs of a loaded model to run it, and what its job_result and job_failed carry (docs/protocol.md,
"Worker socket")."""
from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpuworker.checkpoints import Checkpoint
from gpuworker.step_hooks import StepHooks
from gpuworker.steps import CheckpointTimer, Stopped
from gpuworker.timings import JobTiming
from potocolom.protocol.worker import Resume

if TYPE_CHECKING:
    from PIL.Image import Image

ERROR_CHARS = 500  # job_failed.error is a short message, not a traceback

class Pipeline(Protocol):
    """What the denoising thread needs of a loaded model (pipelines.DiffusersPipeline)."""

    rung: str

    def generate(self, params: Any, *, hooks: StepHooks | None = None,
                 resume: Checkpoint | None = None) -> list[Image]: ...

    def move_to(self, rung: str) -> None: ...


@dataclass(eq=False)
class WorkerJob:
    """A job this worker holds, from its `job` message until it is released. `priority` and
    `account` (v2; a v1 job has 0 and None) order it among the held jobs (turns.py); `resume` is
    the job's stored checkpoint from the API. The fields below them belong to the denoising loop
    and change under its lock."""

    job_id: str
    model_id: str
    params: Any
    timing: JobTiming
    priority: int = 0
    account: str | None = None
    resume: Resume | None = None
    answer_cancel: bool = False  # the cancel came from a v2 API: it is owed job_failed "cancelled"
    preempt_asked: bool = False  # the API said `preempt`: it is owed job_preempted
    set_aside: Stopped | None = None  # where it stopped when a higher-priority job overtook it
    checkpoint_timer: CheckpointTimer | None = None  # its periodic checkpoints, over all its runs here
    started_sent: bool = False  # job_started went out (once, whatever the runs)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def mark_cancelled(self, *, answer: bool) -> None:
        """Ask the job to stop (denoise_loop.DenoiseLoop.cancel decides who lets it go)."""
        self.answer_cancel = answer
        self._cancelled.set()
        self.timing.outcome = "cancelled"


def encode_png_b64(images: Sequence[Image]) -> list[str]:
    """Each image as base64 PNG (what job_result.images carries)."""
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


def short_error(exc: BaseException) -> str:
    """A short, single-line message for job_failed."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


Post = Callable[[dict[str, Any], "WorkerJob | None"], None]
Release = Callable[[WorkerJob], None]  # a job stopped without a result (cancelled, or the worker stopping)
Encode = Callable[[Sequence["Image"]], list[str]]
Demote = Callable[[str, str], None]  # (model_id, rung): move the model down, on the denoising thread
