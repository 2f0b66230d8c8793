"""The GPU worker: what it does with each API message (a handler per type: jobs, frames, sessions,
models loaded and unloaded), what it says in its hello, and its drain; it talks through one
Connection. The worker socket's story: docs/protocol.md, "Worker socket"."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from gpuworker.connection import TOKEN_REFUSED_CODE, Connection, WorkerConfig
from gpuworker.drain import DEFAULT_DRAIN_SECONDS, Drain
from gpuworker.frames import FramePipeline, FrameRunner
from gpuworker.job_desk import KEPT_TIMINGS, JobDesk
from gpuworker.jobs import Encode, Pipeline, encode_png_b64
from gpuworker.limits import Limits
from gpuworker.models_on_demand import ModelsOnDemand
from gpuworker.outbox import Outbox, Outgoing
from gpuworker.sessions import SessionDesk
from gpuworker.slots import RealtimeCapacity
from gpuworker.timings import JobTiming
from potocolom.protocol.fields import Message
from potocolom.protocol.rungs import MODE_AUTO
from potocolom.protocol.worker import (
    PROTOCOL_V2,
    ApiMessage,
    Cancel,
    FrameOrder,
    Hello,
    JobAck,
    JobOrder,
    LoadModel,
    ModelLoadFailed,
    Preempt,
    RungChanged,
    SessionEnd,
    SessionStart,
    UnloadModel,
)

log = logging.getLogger(__name__)


class GpuWorker:
    """One GPU worker: its models, held jobs (`jobs`), live sessions and frames, over `connection`.

    `encode` is the seam that turns images into job_result strings (tests slow it down). `realtime`
    is each model's measured capacity (slots.measure_capacity); a model without one, or not on the
    full rung, serves no sessions. `memory_mode` is MEMORY_MODE (what an out-of-memory error may do);
    `gpu_info`, when given, is read for each hello's `gpu` instead of `config.gpu` (so free memory is
    current). `limits` caps the images frames may declare; `outbox` bounds the final messages kept.
    `on_demand` answers load_model and unload_model, and gives the hello its `installed` (None:
    this worker loads nothing on demand and says nothing of what it has installed).
    """

    def __init__(self, config: WorkerConfig, pipelines: Mapping[str, Pipeline], *,
                 encode: Encode = encode_png_b64, clock: Callable[[], float] = time.monotonic,
                 realtime: Mapping[str, RealtimeCapacity] | None = None, memory_mode: str = MODE_AUTO,
                 gpu_info: Callable[[], dict[str, Any] | None] | None = None, limits: Limits | None = None,
                 outbox: Outbox | None = None, keep_timings: int = KEPT_TIMINGS,
                 drain_seconds: float = DEFAULT_DRAIN_SECONDS, on_demand: ModelsOnDemand | None = None):
        realtime = realtime or {}
        self.config = config
        self.pipelines = dict(pipelines)  # shared with the denoising loop; models_on_demand changes it
        self.connection = Connection(config, self, outbox=outbox if outbox is not None else Outbox(), clock=clock)
        self.frames = FrameRunner({m: cast(FramePipeline, p) for m, p in self.pipelines.items() if m in realtime},
                                  {m: c.slots for m, c in realtime.items()}, self._post_frame, clock=clock,
                                  max_image_pixels=(limits or Limits.from_env()).max_image_pixels)
        self.jobs = JobDesk(self.pipelines, self.connection, released=self._job_released, encode=encode, clock=clock,
                            frames=self.frames, memory_mode=memory_mode, demote=self._demote_model,
                            keep_timings=keep_timings)
        self.sessions = SessionDesk(cast(Mapping[str, FramePipeline], self.pipelines), realtime, self.frames,
                                    self.jobs.frames_waiting, clock=clock,
                                    step_ms=on_demand.catalog.step_ms if on_demand is not None else None)
        self._on_demand = on_demand
        self._gpu_info = gpu_info
        self._drain = Drain(self, drain_seconds, clock)
        self._handlers: dict[type, Callable[[Any], None]] = {
            JobOrder: self._on_job, Cancel: self._on_cancel, Preempt: self._on_preempt, JobAck: self._on_job_ack,
            SessionStart: self._on_session_start, SessionEnd: self._on_session_end, FrameOrder: self._on_frame,
            LoadModel: self._on_load_model, UnloadModel: self._on_unload_model,
        }
        if on_demand is not None:
            on_demand.bind(self)

    @property
    def timings(self) -> collections.deque[JobTiming]:
        """A JobTiming per job received, in arrival order (the latest `keep_timings`)."""
        return self.jobs.timings

    @property
    def unacknowledged(self) -> list[str]:
        """The jobs whose final message waits to be sent or acknowledged, oldest first."""
        return self.connection.outbox.final_ids

    @property
    def exit_status(self) -> int:
        """What the program exits with once run() returns (drain.EXIT_*)."""
        return self._drain.exit_status

    @property
    def draining(self) -> bool:
        return self._drain.active

    def hello_message(self) -> dict[str, Any]:
        """Each connection's first message: us, our models' rungs, and (v2) our jobs and installed models."""
        models = tuple(self.sessions.hello_entry(model_id, pipeline.rung)
                       for model_id, pipeline in self.pipelines.items())
        # Running, waiting, or ended with a final message not acknowledged: the API reconciles them.
        jobs = tuple(dict.fromkeys([*(job.job_id for job in self.jobs.held()), *self.unacknowledged]))
        installed = self._on_demand.installed(self.pipelines) if self._on_demand is not None else None
        return Hello(self.config.worker_id, self.gpu_now(), models, protocol=PROTOCOL_V2, jobs=jobs,
                     installed=installed).to_wire()

    def gpu_now(self) -> dict[str, Any] | None:
        """hello.gpu, and that of model_loaded, model_load_failed, model_unloaded: as it is now."""
        return self._gpu_info() if self._gpu_info is not None else self.config.gpu

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop(), reconnecting forever; raises TokenRefused on close code 4001."""
        if not self.connection.start():
            return
        self.jobs.start()
        if self._on_demand is not None:
            self._on_demand.start()
        try:
            await self.connection.run()
        finally:
            if self._on_demand is not None:
                await self._on_demand.stop()
            await asyncio.to_thread(self.jobs.stop)
            log.info("worker %s stopped", self.config.worker_id)

    def stop(self) -> None:
        """Stop at once (signal handlers call this): interrupt the running job, close the socket."""
        self.connection.stop()

    def terminate(self) -> None:
        """SIGTERM (signal handlers call this): the first drains; a second one during the drain stops at once."""
        if not self.connection.call_soon(self._drain.terminate):
            self.stop()

    # --- what the connection tells us -----------------------------------------------------------

    def welcomed(self) -> None:
        """A new connection is live: a drain says it all again there."""
        self._drain.turn()

    def receive(self, message: ApiMessage) -> None:
        self._handlers[type(message)](message)

    def disconnected(self, close_code: int | None) -> None:
        """The connection dropped: the API sends our sessions back to its queue."""
        self.sessions.clear()
        self._work_ended()
        if close_code != TOKEN_REFUSED_CODE and self.connection.serving:
            log.warning("connection to the API closed (code %s); %d job(s) held, %d message(s) waiting",
                        close_code, len(self.jobs), len(self.connection.outbox))

    def sent(self, out: Outgoing) -> None:
        self.jobs.sent(out)

    def changed(self) -> None:
        self._drain.moved()

    # --- the API's messages ---------------------------------------------------------------------

    def _on_job(self, message: JobOrder) -> None:
        closing = self._on_demand is not None and self._on_demand.closing(message.model_id)
        job = self.jobs.take(message, model_closing=closing)
        if job is not None and self._drain.active and self.connection.v2:
            self.jobs.give_back(job)  # sent before the API read our `draining`: given back at once

    def _on_cancel(self, message: Cancel) -> None:
        self.jobs.cancel(message.job_id)

    def _on_preempt(self, message: Preempt) -> None:
        self.jobs.preempt(message.job_id)

    def _on_job_ack(self, message: JobAck) -> None:
        out = self.connection.outbox.ack(message.job_id)
        self._drain.moved()
        if out is None:
            log.debug("job_ack for job %s, which has no final message waiting", message.job_id)

    def _on_session_start(self, message: SessionStart) -> None:
        answer = self.sessions.start(message.session_id, message.model_id, message.params)
        self.send_message(answer)

    def _on_session_end(self, message: SessionEnd) -> None:
        self.sessions.end(message.session_id)
        self._work_ended()

    def _on_frame(self, message: FrameOrder) -> None:
        self.sessions.frame(message)

    def _on_load_model(self, message: LoadModel) -> None:
        if self._on_demand is None:
            self.send_message(ModelLoadFailed(message.model_id, "this worker loads no model on demand", self.gpu_now()))
            return
        self._on_demand.ask_load(message.model_id, message.rung)

    def _on_unload_model(self, message: UnloadModel) -> None:
        if self._on_demand is None:
            log.warning("unload_model %s: this worker unloads no model on demand", message.model_id)
            return
        self._on_demand.ask_unload(message.model_id)

    # --- models loaded on demand (models_on_demand.py) and moved down (the memory ladder) -------

    def model_work(self, model_id: str) -> tuple[int, int]:
        """(jobs held, live sessions) of a model: it is not unloaded while it has any."""
        return self.jobs.of_model(model_id), len(self.sessions.table.of_model(model_id))

    def send_message(self, message: Message) -> None:
        """On the event loop: a message that is no job's (dropped while the connection is down)."""
        self.connection.enqueue(Outgoing(message.type, json.dumps(message.to_wire()), None))

    def _job_released(self) -> None:
        self._drain.moved()
        self._work_ended()

    def _work_ended(self) -> None:
        if self._on_demand is not None:
            self._on_demand.work_ended()

    def _demote_model(self, model_id: str, rung: str) -> None:
        """On the denoising thread: reload a model on a lower rung (the others stay), then tell the API."""
        pipeline = self.pipelines[model_id]
        old, started = pipeline.rung, time.perf_counter()
        pipeline.move_to(rung)
        log.warning("model %s moved down from rung %s to %s after running out of memory (reloaded in %.1f s)",
                    model_id, old, rung, time.perf_counter() - started)
        self.connection.call_soon(self._rung_changed, model_id)

    def _rung_changed(self, model_id: str) -> None:
        """On the event loop: end the model's live sessions if it lost realtime, and send rung_changed."""
        rung = self.pipelines[model_id].rung
        self.sessions.demote(model_id, rung)
        self.send_message(RungChanged(self.sessions.hello_entry(model_id, rung)))

    # --- frames ---------------------------------------------------------------------------------

    def _post_frame(self, message: dict[str, Any]) -> None:
        """From the frame encoder: queue a frame_result, unless its session ended meanwhile."""
        self.connection.call_soon(self._enqueue_frame, message["session_id"], json.dumps(message))

    def _enqueue_frame(self, session_id: str, text: str) -> None:
        if self.sessions.holds(session_id):
            self.connection.enqueue(Outgoing("frame_result", text, None))
