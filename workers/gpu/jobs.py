"""Held jobs, the one denoising thread that runs them in arrival order (frames of live sessions
before the next job and between steps), and the encoder thread behind it; an out-of-memory error
moves the model down the ladder and retries once (docs/design/memory-ladder.md)."""
from __future__ import annotations

import base64
import io
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from potocolom.protocol.rungs import MODE_AUTO
from potocolom.protocol.worker import JobFailed, JobProgress, JobResult, JobStarted
from workers.gpu.ladder import rung_after_oom
from workers.gpu.pipelines import JobCancelled, OnStep, OutOfMemory, ShouldStop

if TYPE_CHECKING:
    from PIL.Image import Image

    from workers.gpu.frames import FrameRunner

log = logging.getLogger(__name__)

ERROR_CHARS = 500  # job_failed.error is a short message, not a traceback
JOIN_SECONDS = 30.0  # how long stop() waits for an interrupted step to return


class Pipeline(Protocol):
    """What the denoising thread needs of a loaded model (pipelines.DiffusersPipeline)."""

    rung: str

    def generate(self, params: Any, *, on_step: OnStep | None = None,
                 should_stop: ShouldStop | None = None) -> list[Image]: ...

    def move_to(self, rung: str) -> None: ...


@dataclass
class JobTiming:
    """Monotonic timestamps (seconds) of one job, for logs and benchmarks.

    outcome: "held" until the job ends as "succeeded", "failed" or "cancelled".
    """

    job_id: str
    model_id: str
    received: float
    denoise_start: float | None = None
    denoise_end: float | None = None
    encode_start: float | None = None
    encode_end: float | None = None
    sent: float | None = None
    outcome: str = "held"
    rung: str | None = None  # the rung the job's last pipeline call ran on
    gpu_ms: float | None = None  # job_result.gpu_ms: the successful call's own time

    def summary(self) -> str:
        """One log line: where the job's time went, in milliseconds, and the rung it ran on."""
        def ms(start: float | None, end: float | None) -> str:
            return "-" if start is None or end is None else f"{(end - start) * 1000:.0f}"
        gpu = "-" if self.gpu_ms is None else f"{self.gpu_ms:.0f}"
        return (f"job {self.job_id} ({self.model_id}) {self.outcome} on rung {self.rung or '-'}, gpu {gpu} ms: "
                f"waited "
                f"{ms(self.received, self.denoise_start)} ms, denoised {ms(self.denoise_start, self.denoise_end)} ms, "
                f"encoded {ms(self.encode_start, self.encode_end)} ms, sent "
                f"{ms(self.encode_end, self.sent)} ms after encoding, {ms(self.received, self.sent)} ms in all")


def denoise_idle_gaps(timings: Sequence[JobTiming]) -> list[float]:
    """Seconds the denoising loop sat idle between back-to-back jobs.

    For each job that was already held when the job before it finished denoising, the time from
    that end to its own denoising start. Zero-ish gaps mean encoding and upload never held it up.
    """
    ran = sorted((t for t in timings if t.denoise_start is not None and t.denoise_end is not None),
                 key=lambda t: t.denoise_start or 0.0)
    return [after.denoise_start - before.denoise_end  # type: ignore[operator]
            for before, after in zip(ran, ran[1:], strict=False)
            if after.received <= before.denoise_end]  # type: ignore[operator]


@dataclass(eq=False)
class HeldJob:
    """A job this worker holds, from its `job` message until it is released."""

    job_id: str
    model_id: str
    params: Any
    timing: JobTiming
    answer_cancel: bool = False  # the cancel came from a v2 API: it is owed job_failed "cancelled"
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _begun: bool = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, *, answer: bool = False) -> bool:
        """Ask the job to stop. True when it had not begun: it never will, so whoever cancels lets
        it go now; False: the denoising thread lets it go at its next step boundary."""
        with self._lock:
            self.answer_cancel = answer
            self._cancelled.set()
            self.timing.outcome = "cancelled"
            return not self._begun

    def begin(self) -> bool:
        """On the denoising thread, before the job's first step: False when it was cancelled first."""
        with self._lock:
            if self._cancelled.is_set():
                return False
            self._begun = True
            return True


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


_WAKE = object()  # queued by wake(): frames are waiting
Post = Callable[[dict[str, Any], "HeldJob | None"], None]
Release = Callable[[HeldJob], None]  # a job stopped without a result (cancelled, or the worker stopping)
Encode = Callable[[Sequence["Image"]], list[str]]
Demote = Callable[[str, str], None]  # (model_id, rung): move the model down, on the denoising thread


class DenoiseLoop:
    """The single denoising thread and the encoder it hands results to."""

    def __init__(self, pipelines: Mapping[str, Pipeline], post: Post, release: Release, *,
                 encode: Encode = encode_png_b64, clock: Callable[[], float] = time.monotonic,
                 frames: FrameRunner | None = None, memory_mode: str = MODE_AUTO, demote: Demote | None = None):
        self._pipelines = pipelines
        self._memory_mode = memory_mode
        self._demote = demote
        self._post = post
        self._release = release
        self._encode = encode
        self._clock = clock
        self._frames = frames
        # A job, _WAKE (frames are waiting), or None (stop).
        self._jobs: queue.Queue[HeldJob | object | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="denoise", daemon=True)
        # One encoder thread: results leave in the order their jobs were denoised.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: HeldJob) -> None:
        """Queue a held job behind the ones already held."""
        self._jobs.put(job)

    def wake(self) -> None:
        """Frames are waiting: run them now if the thread is idle, else at the next step or job."""
        self._jobs.put(_WAKE)

    def stop(self, timeout: float = JOIN_SECONDS) -> None:
        """Interrupt the running job at its next step, drop the rest, and wait for the thread."""
        self._stopping.set()
        self._jobs.put(None)
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if self._frames is not None:
            self._frames.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run_frames(self, *, gather: bool = True) -> float:
        """Run the pending frames (gather: the thread is idle, so it may wait a moment for more
        frames to batch; see frames.py); return the seconds they took."""
        if self._frames is None or self._stopping.is_set():
            return 0.0
        before = self._frames.busy_seconds
        try:
            self._frames.run_pending(gather=gather)
        except Exception:  # never let frames end the loop
            log.exception("unexpected error running realtime frames")
        return self._frames.busy_seconds - before

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._stopping.is_set():
                return
            self._run_frames()  # frames first: they are waited for by someone drawing
            if not isinstance(job, HeldJob):
                continue
            if not job.begin():  # cancelled while it waited: whoever cancelled it let it go
                continue
            try:
                self._denoise(job)
            except Exception:  # never let one job end the loop
                log.exception("job %s: unexpected error in the denoising loop", job.job_id)

    def _denoise(self, job: HeldJob) -> None:
        pipeline = self._pipelines.get(job.model_id)
        if pipeline is None:
            self._fail(job, f"model {job.model_id!r} is not served by this worker")
            return
        timing = job.timing
        timing.denoise_start = self._clock()  # before job_started: whoever sees that message sees this
        self._post(JobStarted(job.job_id).to_wire(), job)
        frame_seconds = 0.0

        def on_step(step: int, steps: int) -> None:
            nonlocal frame_seconds
            self._post(JobProgress(job.job_id, step, steps).to_wire(), job)
            frame_seconds += self._run_frames(gather=False)  # between two steps: frames wait one step at most

        retried_from: str | None = None  # the rung of the first attempt, once the job is retried
        while True:
            started, frames_before = self._clock(), frame_seconds
            timing.rung = pipeline.rung
            try:
                images = pipeline.generate(job.params, on_step=on_step,
                                           should_stop=lambda: job.cancelled or self._stopping.is_set())
                break
            except JobCancelled:
                timing.denoise_end = self._clock()
                timing.outcome = "cancelled"
                log.info("job %s cancelled while denoising", job.job_id)
                self._release(job)
                return
            except OutOfMemory as exc:
                lower = self._rung_after_oom(job, pipeline.rung, retried_from, str(exc))
                if lower is None:
                    return
                retried_from = pipeline.rung
            except Exception as exc:
                timing.denoise_end = self._clock()
                log.warning("job %s failed: %s", job.job_id, short_error(exc))
                self._fail(job, short_error(exc))
                return
            if not self._move_down(job, lower):
                return
        timing.denoise_end = self._clock()
        # The job's own time on the rung it ended on: not the failed call, the reload or frames.
        gpu_ms = (timing.denoise_end - started - (frame_seconds - frames_before)) * 1000
        timing.gpu_ms = gpu_ms
        try:
            self._encoder.submit(self._encode_result, job, images, gpu_ms, pipeline.rung)
        except RuntimeError:  # the encoder was shut down: the worker is stopping
            log.info("job %s dropped: the worker is stopping", job.job_id)

    def _rung_after_oom(self, job: HeldJob, rung: str, retried_from: str | None, detail: str) -> str | None:
        """Where the model goes after an out-of-memory error in this job; None: the job failed."""
        lower = rung_after_oom(rung, self._memory_mode)
        if lower is not None and retried_from is None and self._demote is not None:
            log.warning("job %s: out of memory on rung %s; moving model %s down to %s and retrying once",
                        job.job_id, rung, job.model_id, lower)
            return lower
        if retried_from is not None:
            error = f"out of memory again on rung {rung} after moving down from {retried_from}: {detail}"
        elif self._memory_mode != MODE_AUTO:
            error = f"out of memory on rung {rung}, pinned by MEMORY_MODE={self._memory_mode}: {detail}"
        elif lower is None:
            error = f"out of memory on rung {rung}, the lowest there is: {detail}"
        else:
            error = f"out of memory on rung {rung}: {detail}"
        job.timing.denoise_end = self._clock()
        log.warning("job %s failed: %s", job.job_id, error)
        self._fail(job, short_error(RuntimeError(error)))
        return None

    def _move_down(self, job: HeldJob, rung: str) -> bool:
        """Demote the job's model to `rung`; False (and the job failed) when that did not work."""
        assert self._demote is not None
        try:
            self._demote(job.model_id, rung)
        except Exception as exc:
            job.timing.denoise_end = self._clock()
            log.exception("model %s could not be moved down to rung %s", job.model_id, rung)
            self._fail(job, short_error(RuntimeError(f"out of memory, and moving down to rung {rung} failed: {exc}")))
            return False
        return True

    def _encode_result(self, job: HeldJob, images: list[Image], gpu_ms: float, rung: str) -> None:
        """On the encoder thread: PNG + base64, then job_result (nothing for a cancelled job)."""
        if job.cancelled:
            self._release(job)
            return
        job.timing.encode_start = self._clock()
        try:
            encoded = self._encode(images)
        except Exception as exc:
            job.timing.encode_end = self._clock()
            log.warning("job %s: encoding failed: %s", job.job_id, short_error(exc))
            self._fail(job, f"encoding failed: {short_error(exc)}")
            return
        job.timing.encode_end = self._clock()
        self._post(JobResult(job.job_id, encoded, round(gpu_ms, 1), rung).to_wire(), job)

    def _fail(self, job: HeldJob, error: str) -> None:
        self._post(JobFailed(job.job_id, error).to_wire(), job)
