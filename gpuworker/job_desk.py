"""The jobs a worker holds, from their `job` message until their final message leaves: received,
cancelled, preempted or given back, run by the denoising loop, and each message they produce queued
on the connection's outbox; docs/protocol.md, `job`, `cancel`, `preempt` and `job_ack`."""
from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuworker.denoise_loop import DenoiseLoop
from gpuworker.jobs import Demote, Encode, Pipeline, WorkerJob
from gpuworker.outbox import Outgoing
from gpuworker.steps import preempted_message
from gpuworker.timings import JobTiming
from potocolom.protocol.worker import JobFailed, JobOrder

if TYPE_CHECKING:
    from gpuworker.connection import Connection
    from gpuworker.frames import FrameRunner

log = logging.getLogger(__name__)

KEPT_TIMINGS = 1000  # JobDesk.timings keeps the latest jobs only: a worker runs for days
CANCELLED = "cancelled"  # job_failed.error of a job let go on a v2 API's cancel
FINAL_OUTCOMES = {"job_result": "succeeded", "job_failed": "failed", "job_preempted": "preempted"}


class JobDesk:
    """The held jobs, by id, and the denoising loop that runs them.

    `timings` holds a JobTiming per job received, in arrival order, the latest `keep_timings` (see
    timings.denoise_idle_gaps). `released` is called on the event loop whenever a job is no longer
    held (a model waiting to be unloaded, or a drain, may go on then).
    """

    def __init__(self, pipelines: Mapping[str, Pipeline], connection: Connection, *, released: Callable[[], None],
                 encode: Encode, clock: Callable[[], float], frames: FrameRunner, memory_mode: str,
                 demote: Demote, keep_timings: int = KEPT_TIMINGS):
        self.timings: collections.deque[JobTiming] = collections.deque(maxlen=keep_timings)
        self._held: dict[str, WorkerJob] = {}
        self._connection = connection
        self._released = released
        self._clock = clock
        self._denoiser = DenoiseLoop(pipelines, self.post, self._let_go_threadsafe, encode=encode, clock=clock,
                                    frames=frames, memory_mode=memory_mode, demote=demote,
                                    checkpoint_seconds=lambda: connection.checkpoint_seconds,
                                    preview_steps=lambda: connection.preview_steps)

    def __len__(self) -> int:
        return len(self._held)

    def start(self) -> None:
        self._denoiser.start()

    def stop(self) -> None:
        """Interrupt the running job at its next step, drop the rest, and wait for the thread."""
        self._denoiser.stop()

    def frames_waiting(self) -> None:
        """Frames of live sessions wait: the denoising thread runs them at its next chance."""
        self._denoiser.wake()

    def held(self) -> list[WorkerJob]:
        """The held jobs, in the order they were received."""
        return list(self._held.values())

    def of_model(self, model_id: str) -> int:
        """How many held jobs are of the model."""
        return sum(1 for job in self._held.values() if job.model_id == model_id)

    # --- the API's orders ------------------------------------------------------------------------

    def take(self, message: JobOrder, *, model_closing: bool) -> WorkerJob | None:
        """Hold a `job`; None for a duplicate, or one refused (job_failed) as its model is being unloaded."""
        job_id, model_id = message.job_id, message.model_id
        if job_id in self._held or self._connection.outbox.holds_final(job_id):
            log.info("job %s is already held; ignoring the duplicate", job_id)
            return None
        timing = JobTiming(job_id=job_id, model_id=model_id, received=self._clock())
        job = WorkerJob(job_id=job_id, model_id=model_id, params=message.params, timing=timing,
                        priority=message.priority or 0, account=message.account, resume=message.resume)
        self.timings.append(timing)
        if model_closing:  # being unloaded: no new work
            log.info("job %s (%s) refused: the model is being unloaded", job_id, model_id)
            self.post(JobFailed(job_id, f"model {model_id!r} is not served by this worker").to_wire(), job)
            return None
        self._held[job_id] = job
        self._denoiser.submit(job)
        log.info("job %s (%s, attempt %s, priority %d%s) received; holding %d", job_id, model_id, message.attempt,
                 job.priority, f", from step {job.resume.step}" if job.resume else "", len(self._held))
        return job

    def cancel(self, job_id: str) -> None:
        """Let the job go: a waiting one now, the running one at its next step boundary (no image decoded)."""
        outbox = self._connection.outbox
        if outbox.holds_final(job_id):
            if self._connection.v2:
                log.info("cancel for job %s, which already ended: its final message answers it", job_id)
            else:
                outbox.forget(job_id)  # v1: nothing more is sent about a cancelled job
                log.info("job %s cancelled; its final message is not sent", job_id)
            return
        job = self._held.get(job_id)
        if job is None:
            log.info("cancel for job %s, which this worker does not hold", job_id)
            return
        # A v2 API is answered job_failed "cancelled" once the job is let go; a v1 API gets nothing more.
        if self._denoiser.cancel(job, answer=self._connection.v2):
            log.info("job %s cancelled while it waited", job_id)
            self._let_go(job)
        else:
            log.info("job %s cancelled: it stops at its next step", job_id)

    def preempt(self, job_id: str) -> None:
        """The API's `preempt`: give the job back (give_back), unless it has ended already."""
        if self._connection.outbox.holds_final(job_id):
            log.info("preempt for job %s, which already ended: its final message answers it", job_id)
            return
        job = self._held.get(job_id)
        if job is None:
            log.info("preempt for job %s, which this worker does not hold", job_id)
            return
        self.give_back(job)

    def give_back(self, job: WorkerJob) -> None:
        """job_preempted: now for a job that is not running, at its next step boundary for the running one."""
        where = self._denoiser.preempt(job)
        if where is None:
            log.info("job %s preempted: it stops at its next step boundary", job.job_id)
            return
        job.timing.outcome = "preempted"
        log.info("job %s preempted while it waited (after step %d)", job.job_id, where.step)
        answer = preempted_message(job.job_id, where)
        self.enqueue(Outgoing(answer["type"], json.dumps(answer), job, job.job_id))

    # --- what the jobs say -----------------------------------------------------------------------

    def post(self, message: dict[str, Any], job: WorkerJob | None) -> None:
        """From any thread: queue a message about a job (serialized here, off the event loop)."""
        kind, text = message["type"], json.dumps(message)
        limit = self._connection.config.max_result_bytes
        if kind == "job_result" and len(text) > limit:
            # Sent, it would be refused and retried forever: report it instead.
            failed = JobFailed(message["job_id"], f"result of {len(text)} bytes is over the {limit}-byte limit")
            kind, text = failed.type, json.dumps(failed.to_wire())
        self._connection.call_soon(self.enqueue, Outgoing(kind, text, job, message.get("job_id")))

    def enqueue(self, out: Outgoing) -> None:
        """On the event loop: queue a job's message; nothing more about a cancelled job, which is let go."""
        if out.job is not None and out.job.cancelled:
            if out.final:  # it ended as it was cancelled: let it go instead of reporting it
                self._let_go(out.job)
            return
        if out.final and out.job is not None:
            self._release(out.job)
        self._connection.enqueue(out)

    def sent(self, out: Outgoing) -> None:
        """A message left: the first time a job's final message does, its timing is logged."""
        if out.final and out.job is not None and out.job.timing.sent is None:
            job = out.job
            job.timing.sent = self._clock()
            job.timing.outcome = FINAL_OUTCOMES[out.kind]
            self._release(job)
            log.info("%s", job.timing.summary())

    def _release(self, job: WorkerJob) -> bool:
        """The job is done with: a new job with its id would be a new job. True if it was held."""
        if self._held.get(job.job_id) is job:
            del self._held[job.job_id]
            self._released()
            return True
        return False

    def _let_go(self, job: WorkerJob) -> None:
        """On the event loop: a job stopped without a result; a v2 API's cancel is owed job_failed "cancelled"."""
        if not self._release(job):
            return
        if job.cancelled:
            log.info("%s", job.timing.summary())
        if job.cancelled and job.answer_cancel:
            failed = JobFailed(job.job_id, CANCELLED)
            self._connection.enqueue(Outgoing(failed.type, json.dumps(failed.to_wire()), None, job.job_id))

    def _let_go_threadsafe(self, job: WorkerJob) -> None:
        self._connection.call_soon(self._let_go, job)
