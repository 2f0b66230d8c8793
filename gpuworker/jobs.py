"""Held jobs, the one denoising thread that runs them (in the order of turns.py: arrival order across
accounts, priority within one, a running job set aside at a step boundary for a higher one; frames
of live sessions before the next job and between steps), and the encoder thread behind it. At step
boundaries it also answers `preempt` and sends periodic checkpoints (steps.py); an out-of-memory
error moves the model down the ladder and retries once (docs/design/memory-ladder.md)."""
from __future__ import annotations

import base64
import io
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpuworker.checkpoints import Checkpoint, CheckpointRefused
from gpuworker.ladder import rung_after_oom
from gpuworker.pipelines import JobCancelled, JobPreempted, OnCheckpoint, OnLatents, OnStep, OutOfMemory, ShouldStop
from gpuworker.previews import JobPreviews
from gpuworker.steps import CheckpointTimer, Stopped, checkpoint_message, never_ran, preempted_message, resume_from
from gpuworker.timings import JobTiming, denoise_idle_gaps  # noqa: F401  (re-exported)
from gpuworker.turns import TurnBook
from potocolom.protocol.rungs import MODE_AUTO
from potocolom.protocol.worker import JobFailed, JobProgress, JobResult, JobStarted, Resume

if TYPE_CHECKING:
    from PIL.Image import Image

    from gpuworker.frames import FrameRunner

log = logging.getLogger(__name__)

ERROR_CHARS = 500  # job_failed.error is a short message, not a traceback
JOIN_SECONDS = 30.0  # how long stop() waits for an interrupted step to return


class Pipeline(Protocol):
    """What the denoising thread needs of a loaded model (pipelines.DiffusersPipeline)."""

    rung: str

    def generate(self, params: Any, *, on_step: OnStep | None = None, should_stop: ShouldStop | None = None,
                 resume: Checkpoint | None = None, capture: ShouldStop | None = None,
                 on_checkpoint: OnCheckpoint | None = None, preempt: ShouldStop | None = None,
                 on_latents: OnLatents | None = None) -> list[Image]: ...

    def move_to(self, rung: str) -> None: ...


@dataclass(eq=False)
class HeldJob:
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
        """Ask the job to stop (DenoiseLoop.cancel decides who lets it go)."""
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


Post = Callable[[dict[str, Any], "HeldJob | None"], None]
Release = Callable[[HeldJob], None]  # a job stopped without a result (cancelled, or the worker stopping)
Encode = Callable[[Sequence["Image"]], list[str]]
Demote = Callable[[str, str], None]  # (model_id, rung): move the model down, on the denoising thread


class DenoiseLoop:
    """The single denoising thread and the encoder it hands results to.

    The held jobs wait in a TurnBook under one lock, with the running one (`_running`) still in it
    until its run ends; the event loop's cancel and preempt take a job out there when it is not
    running, or flag it for the denoising thread to let go at its next step boundary.
    `checkpoint_seconds` says, at each run's start, how often to send its checkpoint (0: never), and
    `preview_steps` every how many steps its job_progress carries a preview (0: never; previews.py).
    """

    def __init__(self, pipelines: Mapping[str, Pipeline], post: Post, release: Release, *,
                 encode: Encode = encode_png_b64, clock: Callable[[], float] = time.monotonic,
                 frames: FrameRunner | None = None, memory_mode: str = MODE_AUTO, demote: Demote | None = None,
                 checkpoint_seconds: Callable[[], float] = lambda: 0.0,
                 preview_steps: Callable[[], int] = lambda: 0):
        self._pipelines = pipelines
        self._memory_mode = memory_mode
        self._demote = demote
        self._post = post
        self._release = release
        self._encode = encode
        self._clock = clock
        self._frames = frames
        self._checkpoint_seconds = checkpoint_seconds
        self._preview_steps = preview_steps
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a job held, frames waiting, or stop
        self._book = TurnBook()
        self._jobs: dict[str, HeldJob] = {}  # the book's jobs
        self._running: HeldJob | None = None
        self._frames_waiting = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="denoise", daemon=True)
        # One encoder thread: results leave in the order their jobs were denoised.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: HeldJob) -> None:
        """Hold a job: it runs in its turn (turns.py); one that overtakes the running job takes
        over at that job's next step boundary."""
        with self._changed:
            if job.job_id in self._book:  # an ended run of that id, its answer crossing this new order
                self._book.remove(job.job_id)
            self._book.add(job.job_id, account=job.account, priority=job.priority)
            self._jobs[job.job_id] = job
            self._changed.notify()

    def wake(self) -> None:
        """Frames are waiting: run them now if the thread is idle, else at the next step or job."""
        with self._changed:
            self._frames_waiting = True
            self._changed.notify()

    def cancel(self, job: HeldJob, *, answer: bool = False) -> bool:
        """Cancel a held job. True when it was not running (waiting, or set aside): it never runs
        again, so whoever cancels lets it go now; False: the denoising thread lets it go at its next
        step boundary (or it has ended, and its final message is on its way)."""
        with self._lock:
            job.mark_cancelled(answer=answer)
            return self._withdraw(job)

    def preempt(self, job: HeldJob) -> Stopped | None:
        """The API's `preempt`. A job that is not running is taken out at once: where it stands
        (step 0 and no checkpoint when it never ran, where it was set aside else) is the answer
        for its job_preempted. None: the denoising thread answers at the running job's next step
        boundary (or the job has ended, and its final message answers)."""
        with self._lock:
            job.preempt_asked = True
            if not self._withdraw(job):
                return None
        return job.set_aside or never_ran(job.params)

    def _withdraw(self, job: HeldJob) -> bool:
        """Under the lock: take a job that is not running out of the book."""
        if self._running is job or self._jobs.get(job.job_id) is not job:
            return False
        self._book.remove(job.job_id)
        del self._jobs[job.job_id]
        return True

    def stop(self, timeout: float = JOIN_SECONDS) -> None:
        """Interrupt the running job at its next step, drop the rest, and wait for the thread."""
        self._stopping.set()
        with self._changed:
            self._changed.notify()
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
            with self._changed:
                self._changed.wait_for(lambda: self._stopping.is_set() or self._frames_waiting or len(self._book) > 0)
                if self._stopping.is_set():
                    return
                self._frames_waiting = False
            self._run_frames()  # frames first: they are waited for by someone drawing
            job = self._take_next()
            if job is None:
                continue
            kept = False
            try:
                kept = self._denoise(job)
            except Exception:  # never let one job end the loop
                log.exception("job %s: unexpected error in the denoising loop", job.job_id)
            finally:
                self._run_over(job, kept=kept)

    def _take_next(self) -> HeldJob | None:
        """The job whose turn it is, now running; None when none is held (all let go meanwhile)."""
        with self._lock:
            job_id = self._book.next()
            if job_id is None or self._stopping.is_set():
                return None
            self._running = self._jobs[job_id]
            return self._running

    def _run_over(self, job: HeldJob, *, kept: bool) -> None:
        """A run ended: the job leaves the book, unless it was set aside (`kept`) to run again."""
        with self._lock:
            self._running = None
            if not kept and self._jobs.get(job.job_id) is job:
                self._book.remove(job.job_id)
                del self._jobs[job.job_id]

    def _overtaken(self, job: HeldJob) -> bool:
        """At a step boundary: the running job must step aside for another one's turn (a job of
        its account with a higher priority)."""
        with self._lock:
            return self._book.next() != job.job_id

    def _denoise(self, job: HeldJob) -> bool:
        """One run of a job, from its first step (or where it stopped) until it ends or steps aside;
        True when it was set aside, to run again in its turn."""
        pipeline = self._pipelines.get(job.model_id)
        if pipeline is None:
            self._fail(job, f"model {job.model_id!r} is not served by this worker")
            return False
        timing = job.timing
        if timing.denoise_start is None:
            timing.denoise_start = self._clock()  # before job_started: whoever sees that message sees this
        resume = resume_from(job.set_aside, job.resume, job_id=job.job_id)
        job.set_aside = None
        if not job.started_sent:
            job.started_sent = True
            self._post(JobStarted(job.job_id).to_wire(), job)
        frame_seconds = 0.0
        previews = JobPreviews(self._preview_steps(), pipeline, job_id=job.job_id)

        def on_step(step: int, steps: int) -> None:
            nonlocal frame_seconds
            self._post(JobProgress(job.job_id, step, steps, previews.take()).to_wire(), job)
            frame_seconds += self._run_frames(gather=False)  # between two steps: frames wait one step at most

        timer = job.checkpoint_timer
        if timer is None:
            timer = job.checkpoint_timer = CheckpointTimer(self._checkpoint_seconds(), self._clock)
        else:  # back from being set aside: its running time so far still counts
            timer.go_on()

        def on_checkpoint(checkpoint: Checkpoint | None) -> None:
            message = checkpoint_message(job.job_id, checkpoint)
            if message is None:
                timer.give_up()  # none this run: it cannot be captured, or is over the wire's size
            else:
                self._post(message, job)

        retried_from: str | None = None  # the rung of the first attempt, once the job is retried
        while True:
            started, frames_before = self._clock(), frame_seconds
            timing.rung = pipeline.rung
            try:
                images = pipeline.generate(job.params, on_step=on_step,
                                           should_stop=lambda: job.cancelled or self._stopping.is_set(),
                                           resume=resume, capture=timer.due if timer.active else None,
                                           on_checkpoint=on_checkpoint,
                                           preempt=lambda: job.preempt_asked or self._overtaken(job),
                                           on_latents=previews.see if previews.on else None)
                break
            except JobCancelled:
                timing.denoise_end = self._clock()
                timing.outcome = "cancelled"
                log.info("job %s cancelled while denoising", job.job_id)
                self._release(job)
                return False
            except JobPreempted as stopped:
                return self._stopped(job, Stopped(stopped.step, stopped.steps, stopped.checkpoint))
            except CheckpointRefused as exc:  # the checkpoint is not for this job here: start afresh
                if resume is None:  # not from a checkpoint at all: a failure like any other
                    timing.denoise_end = self._clock()
                    self._fail(job, short_error(exc))
                    return False
                log.warning("job %s: its checkpoint cannot resume it here (%s); it restarts from step 0", job.job_id,
                            short_error(exc))
                resume = None
                continue
            except OutOfMemory as exc:
                lower = self._rung_after_oom(job, pipeline.rung, retried_from, str(exc))
                if lower is None:
                    return False
                retried_from = pipeline.rung
            except Exception as exc:
                timing.denoise_end = self._clock()
                log.warning("job %s failed: %s", job.job_id, short_error(exc))
                self._fail(job, short_error(exc))
                return False
            if not self._move_down(job, lower):
                return False
        timing.denoise_end = self._clock()
        # The job's own time on the rung it ended on: not the failed call, the reload or frames.
        gpu_ms = (timing.denoise_end - started - (frame_seconds - frames_before)) * 1000
        timing.gpu_ms = gpu_ms
        try:
            self._encoder.submit(self._encode_result, job, images, gpu_ms, pipeline.rung)
        except RuntimeError:  # the encoder was shut down: the worker is stopping
            log.info("job %s dropped: the worker is stopping", job.job_id)
        return False

    def _stopped(self, job: HeldJob, where: Stopped) -> bool:
        """The job left its run at a step boundary: set aside for another job's turn (True), or
        answered with job_preempted (the API asked), or let go (cancelled, or the worker stops)."""
        with self._lock:
            overtaken = not (job.preempt_asked or job.cancelled or self._stopping.is_set())
            if overtaken:
                job.set_aside = where  # the run's end leaves it in the book
                if job.checkpoint_timer is not None:
                    job.checkpoint_timer.set_aside()
        if overtaken:
            log.info("job %s set aside after step %d of %d for a job of higher priority", job.job_id, where.step,
                     where.steps)
            return True
        job.timing.denoise_end = self._clock()
        if job.preempt_asked and not job.cancelled and not self._stopping.is_set():
            job.timing.outcome = "preempted"
            log.info("job %s preempted after step %d of %d", job.job_id, where.step, where.steps)
            self._post(preempted_message(job.job_id, where), job)
        else:
            self._release(job)
        return False

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
