"""The one denoising thread: the held jobs in the order of turns.py (a running job set aside at a step boundary for
one of higher priority), frames of live sessions before the next job and between steps, and the encoder thread
behind it; docs/protocol.md, "Priority at every step" under "API → worker"; docs/design/memory-ladder.md."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuworker.checkpoints import Checkpoint, CheckpointRefused
from gpuworker.jobs import Demote, Encode, Pipeline, Post, Release, WorkerJob, encode_png_b64, short_error
from gpuworker.ladder import rung_after_oom
from gpuworker.pipelines import OutOfMemory
from gpuworker.previews import JobPreviews
from gpuworker.step_hooks import JobCancelled, PreemptedAtStep, StepHooks
from gpuworker.steps import CheckpointTimer, Stopped, checkpoint_message, never_ran, preempted_message, resume_from
from gpuworker.turns import TurnBook
from potocolom.protocol.rungs import MODE_AUTO
from potocolom.protocol.worker import JobFailed, JobProgress, JobResult, JobStarted

if TYPE_CHECKING:
    from PIL.Image import Image

    from gpuworker.frames import FrameRunner

log = logging.getLogger(__name__)

JOIN_SECONDS = 30.0  # how long stop() waits for an interrupted step to return


@dataclass
class _FrameTime:
    """The seconds frames of live sessions ran between a run's steps (not the job's own GPU time)."""

    seconds: float = 0.0


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
        self._jobs: dict[str, WorkerJob] = {}  # the book's jobs
        self._running: WorkerJob | None = None
        self._frames_waiting = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="denoise", daemon=True)
        # One encoder thread: results leave in the order their jobs were denoised.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: WorkerJob) -> None:
        """Hold a job: it runs in its turn (turns.py), overtaking the running one at its next step boundary."""
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

    def cancel(self, job: WorkerJob, *, answer: bool = False) -> bool:
        """Flag a held job cancelled; True when it was not running and left the book: let it go now."""
        with self._lock:
            job.mark_cancelled(answer=answer)
            return self._withdraw(job)

    def preempt(self, job: WorkerJob) -> Stopped | None:
        """Flag a held job preempted; where it stands if it was not running (it left the book), else None."""
        with self._lock:
            job.preempt_asked = True
            if not self._withdraw(job):
                return None  # the running job: answered at its next step boundary (or by its final message)
        return job.set_aside or never_ran(job.params)

    def _withdraw(self, job: WorkerJob) -> bool:
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
        """Run the pending frames (gather: idle, so wait a moment for more to batch); the seconds they took."""
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

    def _take_next(self) -> WorkerJob | None:
        """The job whose turn it is, now running; None when none is held (all let go meanwhile)."""
        with self._lock:
            job_id = self._book.next()
            if job_id is None or self._stopping.is_set():
                return None
            self._running = self._jobs[job_id]
            return self._running

    def _run_over(self, job: WorkerJob, *, kept: bool) -> None:
        """A run ended: the job leaves the book, unless it was set aside (`kept`) to run again."""
        with self._lock:
            self._running = None
            if not kept and self._jobs.get(job.job_id) is job:
                self._book.remove(job.job_id)
                del self._jobs[job.job_id]

    def _overtaken(self, job: WorkerJob) -> bool:
        """At a step boundary: a job of the running one's account with a higher priority has its turn now."""
        with self._lock:
            return self._book.next() != job.job_id

    def _denoise(self, job: WorkerJob) -> bool:
        """One run of a job until it ends or steps aside; True when set aside, to run again in its turn."""
        pipeline = self._pipelines.get(job.model_id)
        if pipeline is None:
            self._fail(job, f"model {job.model_id!r} is not served by this worker")
            return False
        resume = self._begin_run(job)
        frames = _FrameTime()
        try:
            done = self._generate(job, pipeline, self._hooks(job, pipeline, frames), resume, frames)
        except JobCancelled:
            job.timing.denoise_end = self._clock()
            job.timing.outcome = "cancelled"
            log.info("job %s cancelled while denoising", job.job_id)
            self._release(job)
            return False
        except PreemptedAtStep as stopped:
            return self._stopped(job, Stopped(stopped.step, stopped.steps, stopped.checkpoint))
        if done is not None:
            images, gpu_ms = done
            try:
                self._encoder.submit(self._encode_result, job, images, gpu_ms, pipeline.rung)
            except RuntimeError:  # the encoder was shut down: the worker is stopping
                log.info("job %s dropped: the worker is stopping", job.job_id)
        return False

    def _begin_run(self, job: WorkerJob) -> Checkpoint | None:
        """The run's start: its denoising clock, job_started (once), and the checkpoint it resumes from."""
        if job.timing.denoise_start is None:
            job.timing.denoise_start = self._clock()  # before job_started: whoever sees that message sees this
        resume = resume_from(job.set_aside, job.resume, job_id=job.job_id)
        job.set_aside = None
        if not job.started_sent:
            job.started_sent = True
            self._post(JobStarted(job.job_id).to_wire(), job)
        return resume

    def _hooks(self, job: WorkerJob, pipeline: Pipeline, frames: _FrameTime) -> StepHooks:
        """The run's step hooks: progress (previews, frames between steps), cancel, preempt, checkpoints."""
        previews = JobPreviews(self._preview_steps(), pipeline, job_id=job.job_id)
        timer = job.checkpoint_timer
        if timer is None:
            timer = job.checkpoint_timer = CheckpointTimer(self._checkpoint_seconds(), self._clock)
        else:  # back from being set aside: its running time so far still counts
            timer.go_on()

        def progress(step: int, steps: int, preview: str | None) -> None:
            self._post(JobProgress(job.job_id, step, steps, preview).to_wire(), job)
            frames.seconds += self._run_frames(gather=False)  # between two steps: frames wait one step at most

        def send_checkpoint(checkpoint: Checkpoint | None) -> None:
            message = checkpoint_message(job.job_id, checkpoint)
            if message is None:
                timer.give_up()  # none this run: it cannot be captured, or is over the wire's size
            else:
                self._post(message, job)

        return StepHooks(progress=progress, preview=previews.preview if previews.on else None,
                         cancelled=lambda: job.cancelled or self._stopping.is_set(),
                         preempted=lambda: job.preempt_asked or self._overtaken(job),
                         checkpoint_due=timer.due if timer.active else None, on_checkpoint=send_checkpoint)

    def _generate(self, job: WorkerJob, pipeline: Pipeline, hooks: StepHooks, resume: Checkpoint | None,
                  frames: _FrameTime) -> tuple[list[Image], float] | None:
        """Denoise (afresh if the checkpoint does not fit, once a rung lower after OOM); None if it failed."""
        retried_from: str | None = None  # the rung of the first attempt, once the job is retried
        while True:
            started, frames_before = self._clock(), frames.seconds
            job.timing.rung = pipeline.rung
            try:
                images = pipeline.generate(job.params, hooks=hooks, resume=resume)
                break
            except (JobCancelled, PreemptedAtStep):
                raise
            except CheckpointRefused as exc:  # the checkpoint is not for this job here: start afresh
                if resume is None:  # not from a checkpoint at all: a failure like any other
                    job.timing.denoise_end = self._clock()
                    self._fail(job, short_error(exc))
                    return None
                log.warning("job %s: its checkpoint cannot resume it here (%s); it restarts from step 0", job.job_id,
                            short_error(exc))
                resume = None
                continue
            except OutOfMemory as exc:
                lower = self._rung_after_oom(job, pipeline.rung, retried_from, str(exc))
                if lower is None:
                    return None
                retried_from = pipeline.rung
            except Exception as exc:
                job.timing.denoise_end = self._clock()
                log.warning("job %s failed: %s", job.job_id, short_error(exc))
                self._fail(job, short_error(exc))
                return None
            # Out of the except block: the failed call's frames are gone before the model reloads.
            if not self._move_down(job, lower):
                return None
        job.timing.denoise_end = self._clock()
        # The job's own time on the rung it ended on: not the failed call, the reload or frames.
        gpu_ms = (job.timing.denoise_end - started - (frames.seconds - frames_before)) * 1000
        job.timing.gpu_ms = gpu_ms
        return images, gpu_ms

    def _stopped(self, job: WorkerJob, where: Stopped) -> bool:
        """The run left at a step boundary: set aside (True), answered with job_preempted, or let go."""
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

    def _rung_after_oom(self, job: WorkerJob, rung: str, retried_from: str | None, detail: str) -> str | None:
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

    def _move_down(self, job: WorkerJob, rung: str) -> bool:
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

    def _encode_result(self, job: WorkerJob, images: list[Image], gpu_ms: float, rung: str) -> None:
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

    def _fail(self, job: WorkerJob, error: str) -> None:
        self._post(JobFailed(job.job_id, error).to_wire(), job)
