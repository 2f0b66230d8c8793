"""The worker loop: the worker socket (potocolom.protocol.worker, both ways), reconnecting with
backoff; jobs go to the denoising thread (which also answers `preempt` and checkpoints them at step
boundaries), frames of live sessions beside them, and everything the threads produce leaves through
one outbox (outbox.py) that keeps final messages across a reconnect and, with a v2 API, until their
job_ack."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from gpuworker.connection import Backoff, TokenRefused, WorkerConfig, auth_headers, worker_socket_url
from gpuworker.frames import FramePipeline, FrameRunner
from gpuworker.jobs import DenoiseLoop, Encode, HeldJob, JobTiming, Pipeline, encode_png_b64
from gpuworker.limits import Limits
from gpuworker.models_on_demand import ModelsOnDemand
from gpuworker.outbox import KEPT_WHILE_DOWN, Outbox, Outgoing
from gpuworker.sessions import SessionDesk
from gpuworker.slots import RealtimeCapacity
from gpuworker.steps import preempted_message
from potocolom.protocol.errors import MessageError
from potocolom.protocol.fields import Message
from potocolom.protocol.rungs import MODE_AUTO
from potocolom.protocol.worker import (
    PROTOCOL_V2,
    Cancel,
    Draining,
    FrameOrder,
    Heartbeat,
    Hello,
    JobAck,
    JobFailed,
    JobOrder,
    LoadModel,
    ModelLoadFailed,
    Preempt,
    RungChanged,
    SessionEnd,
    SessionEnded,
    SessionStart,
    UnloadModel,
    Welcome,
    parse_api_message,
)

log = logging.getLogger(__name__)

TOKEN_REFUSED_CODE = 4001
MAX_MESSAGE_BYTES = 64 * 2**20  # jobs carry init images; be generous on what we accept
DEFAULT_HEARTBEAT_SECONDS = 10.0
OPEN_TIMEOUT_SECONDS = 10.0
KEPT_TIMINGS = 1000  # WorkerClient.timings keeps the latest jobs only: a worker runs for days
CANCELLED = "cancelled"  # job_failed.error of a job let go on a v2 API's cancel
DEFAULT_DRAIN_SECONDS = 30.0  # --drain-seconds
EXIT_DRAINED = 0  # run() ended: stopped, or drained with every final message acknowledged
EXIT_DRAIN_TIMED_OUT = 1  # the drain's deadline passed with messages unacknowledged or jobs held
EXIT_STOPPED_AT_ONCE = 2  # a second SIGTERM during a drain
FINAL_OUTCOMES = {"job_result": "succeeded", "job_failed": "failed", "job_preempted": "preempted"}


class WorkerClient:
    """One GPU worker's connection to the API, its held jobs and its timings.

    `timings` holds a JobTiming per job received, in arrival order, the latest `keep_timings`
    (see jobs.denoise_idle_gaps). `encode` is the seam that turns images into job_result strings
    (tests slow it down). `realtime` is each model's measured capacity (slots.measure_capacity); a
    model without one, or not on the full rung, serves no sessions. `memory_mode` is MEMORY_MODE
    (what an out-of-memory error may do, see jobs.py); `gpu_info`, when given, is read for each
    hello's `gpu` instead of `config.gpu` (so free memory is current). `limits` caps the images
    frames may declare (default: the environment's); `outbox` bounds the final messages kept.
    `on_demand` answers load_model and unload_model, and gives the hello its `installed` (None:
    this worker loads nothing on demand and says nothing of what it has installed).
    """

    def __init__(self, config: WorkerConfig, pipelines: Mapping[str, Pipeline], *,
                 encode: Encode = encode_png_b64, clock: Callable[[], float] = time.monotonic,
                 realtime: Mapping[str, RealtimeCapacity] | None = None, memory_mode: str = MODE_AUTO,
                 gpu_info: Callable[[], dict[str, Any] | None] | None = None, limits: Limits | None = None,
                 outbox: Outbox | None = None, keep_timings: int = KEPT_TIMINGS,
                 drain_seconds: float = DEFAULT_DRAIN_SECONDS, on_demand: ModelsOnDemand | None = None):
        self.config = config
        self._gpu_info = gpu_info
        self.url = worker_socket_url(config.api_url)
        self._headers = auth_headers(config.token)
        self.pipelines = dict(pipelines)
        self.timings: collections.deque[JobTiming] = collections.deque(maxlen=keep_timings)
        self.welcome: dict[str, Any] | None = None  # the latest welcome
        self.welcomes = 0  # how many connections got as far as a welcome
        self.protocol = 1  # the protocol of the current connection: 2 once a v2 welcome came
        self.checkpoint_seconds = 0.0  # the current connection's welcome.checkpoint_seconds (v2; 0: none)
        self.preview_steps = 0  # the current connection's welcome.preview_steps (v2; 0: no previews)
        self._clock = clock
        self._backoff = Backoff(config.reconnect_initial_seconds, config.reconnect_max_seconds)
        self._held: dict[str, HeldJob] = {}
        self._outbox = outbox if outbox is not None else Outbox()
        limits = limits or Limits.from_env()
        frame_pipelines = {m: cast(FramePipeline, p) for m, p in self.pipelines.items() if m in (realtime or {})}
        self.frames = FrameRunner(frame_pipelines, {m: c.slots for m, c in (realtime or {}).items()},
                                  self._post_frame, clock=clock, max_image_pixels=limits.max_image_pixels)
        self._denoiser = DenoiseLoop(self.pipelines, self._post, self._let_go_threadsafe,
                                     encode=encode, clock=clock, frames=self.frames, memory_mode=memory_mode,
                                     demote=self._demote_model, checkpoint_seconds=lambda: self.checkpoint_seconds,
                                     preview_steps=lambda: self.preview_steps)
        self.sessions = SessionDesk(cast(Mapping[str, FramePipeline], self.pipelines), realtime or {}, self.frames,
                                    self._denoiser.wake, clock=clock,
                                    step_ms=on_demand.catalog.step_ms if on_demand is not None else None)
        self._on_demand = on_demand
        if on_demand is not None:
            on_demand.bind(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox_ready: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._stop_requested = False
        self.drain_seconds = drain_seconds
        self.exit_status = EXIT_DRAINED  # what the program exits with once run() returns
        self._draining = False  # terminate() was called: say draining, give everything back, stop
        self._drain_changed: asyncio.Event | None = None  # something a drain waits on moved
        self._drain_task: asyncio.Task[None] | None = None
        self._drain_said_on: ClientConnection | None = None  # the connection that heard our `draining`
        self._ws: ClientConnection | None = None
        self._welcomed_ws: ClientConnection | None = None  # the connection that got its welcome
        self._closing: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: dict[type, Callable[[Any], None]] = {
            Welcome: self._on_welcome, JobOrder: self._on_job, Cancel: self._on_cancel, JobAck: self._on_job_ack,
            Preempt: self._on_preempt,
            SessionStart: self._on_session_start, SessionEnd: self._on_session_end, FrameOrder: self._on_frame,
            LoadModel: self._on_load_model, UnloadModel: self._on_unload_model,
        }

    @property
    def v2(self) -> bool:
        """The API of the current connection said protocol 2: job_ack and cancel answers apply."""
        return self.protocol >= PROTOCOL_V2

    @property
    def unacknowledged(self) -> list[str]:
        """The jobs whose final message waits to be sent or acknowledged, oldest first."""
        return self._outbox.final_ids

    # --- lifecycle ----------------------------------------------------------------------------

    def hello_message(self) -> dict[str, Any]:
        """The first message of every connection: who we are, what we serve on which rung, and
        (v2) the jobs we hold: running, waiting, or ended with a final message not acknowledged,
        and every model installed, loaded or not."""
        models = tuple(self.sessions.hello_entry(model_id, pipeline.rung)
                       for model_id, pipeline in self.pipelines.items())
        jobs = tuple(dict.fromkeys([*self._held, *self._outbox.final_ids]))
        installed = self._on_demand.installed(self.pipelines) if self._on_demand is not None else None
        return Hello(self.config.worker_id, self.gpu_now(), models, protocol=PROTOCOL_V2, jobs=jobs,
                     installed=installed).to_wire()

    def gpu_now(self) -> dict[str, Any] | None:
        """hello.gpu, and that of model_loaded, model_load_failed, model_unloaded: as it is now."""
        return self._gpu_info() if self._gpu_info is not None else self.config.gpu

    async def run(self) -> None:
        """Serve until stop(), reconnecting forever; raises TokenRefused on close code 4001."""
        self._loop = asyncio.get_running_loop()
        self._outbox_ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._drain_changed = asyncio.Event()
        if self._stop_requested:
            return
        self._denoiser.start()
        if self._on_demand is not None:
            self._on_demand.start()
        try:
            while not self._stopped.is_set():
                await self._connect_once()
                if self._stopped.is_set():
                    break
                delay = self._backoff.next_delay()
                log.info("reconnecting to %s in %.1f s", self.config.api_url, delay)
                try:
                    await asyncio.wait_for(self._stopped.wait(), delay)
                except TimeoutError:
                    pass
        finally:
            if self._on_demand is not None:
                await self._on_demand.stop()
            await asyncio.to_thread(self._denoiser.stop)
            log.info("worker %s stopped", self.config.worker_id)

    def stop(self) -> None:
        """Stop at once (signal handlers call this): interrupt the running job, close the socket."""
        self._stop_requested = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._begin_stop)

    def terminate(self) -> None:
        """SIGTERM (signal handlers call this): the first drains (see _drain), within
        `drain_seconds`; a second one during the drain stops at once (exit status 2)."""
        if self._loop is None or self._loop.is_closed():
            self.stop()
            return
        self._loop.call_soon_threadsafe(self._terminate)

    @property
    def draining(self) -> bool:
        return self._draining

    def _terminate(self) -> None:
        if self._stopped is None or self._stopped.is_set():
            self.stop()  # stopping already (the drain ended, or it was never started): nothing to cut short
            return
        if self._draining:
            log.warning("second SIGTERM: stopping at once; the API sends back what is still held here")
            self.exit_status = EXIT_STOPPED_AT_ONCE
            self.stop()
            return
        self._draining = True
        log.info("SIGTERM: draining (at most %.0f s): giving back %d job(s) and %d session(s)", self.drain_seconds,
                 len(self._held), len(self.sessions.table.session_ids()))
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Say `draining`, give back every held job (job_preempted, as if the API had asked: at the
        running job's next step boundary with its checkpoint, step 0 and null for a waiting one)
        and end every live session (session_ended), then stop once the API has acknowledged every
        final message. A reconnect meanwhile says it all again. Past `drain_seconds`, stop anyway
        (exit status 1): the API then sends back what it still counts here, as for a dead worker."""
        assert self._drain_changed is not None
        deadline = self._clock() + self.drain_seconds
        self._drain_turn()
        while not self._drained() and not (self._stopped is not None and self._stopped.is_set()):
            left = deadline - self._clock()
            if left <= 0:
                break
            self._drain_changed.clear()
            try:
                await asyncio.wait_for(self._drain_changed.wait(), left)
            except TimeoutError:
                break
        if self._stopped is not None and self._stopped.is_set():
            return  # stopped meanwhile (a second SIGTERM, SIGINT, a v1 API): with the status they set
        if self._drained():
            log.info("drained: every job given back and acknowledged; exiting")
        else:
            self.exit_status = EXIT_DRAIN_TIMED_OUT
            log.warning("drain deadline of %.0f s passed: %d job(s) still held, %d answer(s) not acknowledged",
                        self.drain_seconds, len(self._held), len(self._outbox.final_ids))
        self.stop()

    def _drained(self) -> bool:
        """Nothing held, nothing waiting to be sent or acknowledged: the API has everything back."""
        return not self._held and not self._outbox.final_ids and len(self._outbox) == 0

    def _drain_turn(self) -> None:
        """On a live connection (and each new one during the drain): `draining` first, then every
        held job given back and every session ended. Without a v2 API nothing can be given back:
        the drain stops at once, and the API sends the jobs back as for a dead worker."""
        if not self._live() or self._drain_said_on is self._ws:
            return
        self._drain_said_on = self._ws
        if not self.v2:
            log.warning("the API speaks protocol 1, which has no drain: stopping now")
            self.stop()
            return
        message = Draining()
        self._enqueue(Outgoing(message.type, json.dumps(message.to_wire()), None))
        for job in list(self._held.values()):
            if not job.preempt_asked:
                self._preempt_held(job)
        for session_id in self.sessions.table.session_ids():
            self.sessions.end(session_id)
            ended = SessionEnded(session_id)
            self._enqueue(Outgoing(ended.type, json.dumps(ended.to_wire()), None))
        self._drain_moved()

    def _drain_moved(self) -> None:
        if self._drain_changed is not None:
            self._drain_changed.set()

    def _live(self) -> bool:
        return self._ws is not None and self._welcomed_ws is self._ws

    def _begin_stop(self) -> None:
        assert self._stopped is not None
        self._stopped.set()
        self._drain_moved()
        if self._ws is not None:
            self._closing = asyncio.ensure_future(self._ws.close())

    async def _connect_once(self) -> None:
        """One connection, from the handshake until it closes; errors other than a refused token
        are logged (the caller retries)."""
        try:
            # The token travels in the handshake's Authorization header, never in the URL (logs).
            async with connect(self.url, additional_headers=self._headers, max_size=MAX_MESSAGE_BYTES,
                               compression=None, open_timeout=OPEN_TIMEOUT_SECONDS, close_timeout=2) as ws:
                await self._serve(ws)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise TokenRefused(f"HTTP {exc.response.status_code}") from exc
            log.warning("the API at %s rejected the handshake: %s", self.config.api_url, exc)
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            log.warning("cannot reach the API at %s: %s", self.config.api_url, exc or type(exc).__name__)

    async def _serve(self, ws: ClientConnection) -> None:
        """Say hello, then handle messages until the socket closes."""
        assert self._stopped is not None
        if self._stopped.is_set():
            return
        self._ws = ws
        self.protocol = 1  # until this connection's welcome says otherwise
        self.checkpoint_seconds = 0.0
        self.preview_steps = 0
        try:
            await ws.send(json.dumps(self.hello_message()))
            async for raw in ws:
                self._handle(raw)
        except ConnectionClosed:
            pass
        finally:
            self._ws = self._welcomed_ws = None
            self.sessions.clear()
            self._work_ended()
            tasks, self._tasks = self._tasks, []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if ws.close_code == TOKEN_REFUSED_CODE:
            raise TokenRefused()
        if not self._stopped.is_set():
            log.warning("connection to the API closed (code %s); %d job(s) held, %d message(s) waiting",
                        ws.close_code, len(self._held), len(self._outbox))

    # --- incoming -----------------------------------------------------------------------------

    def _handle(self, raw: str | bytes) -> None:
        """Dispatch one message; a bad or unknown one is logged, never fatal."""
        try:
            message = parse_api_message(json.loads(raw))
        except ValueError as exc:  # not JSON, or off the contract (MessageError)
            log.warning("ignoring a message: %s: %.200r", exc, raw)
            return
        try:
            self._handlers[type(message)](message)
        except MessageError as exc:
            log.warning("ignoring a bad %s message: %s", message.type, exc)
        except Exception:
            log.exception("error handling a %s message", message.type)

    def _on_welcome(self, message: Welcome) -> None:
        period = message.heartbeat_seconds
        if period is None:
            log.warning("welcome without a usable heartbeat_seconds; using %s", DEFAULT_HEARTBEAT_SECONDS)
            period = DEFAULT_HEARTBEAT_SECONDS
        if message.unknown_models:
            log.warning("the API does not know these models, so routes nothing of them here: %s",
                        message.unknown_models)
        self.welcome = message.to_wire()
        if self._ws is None or self._welcomed_ws is self._ws:
            return  # a repeated welcome on this connection changes nothing we run
        self._welcomed_ws = self._ws
        self.welcomes += 1
        self.protocol = message.protocol
        self.checkpoint_seconds = message.checkpoint_seconds if self.v2 else 0.0
        self.preview_steps = message.preview_steps if self.v2 else 0
        self._backoff.reset()
        log.info("welcomed by %s as %s (protocol %d, heartbeat every %s s)", self.config.api_url,
                 self.config.worker_id, self.protocol, period)
        self._outbox.reconnected()  # final messages not acknowledged go again, right after the welcome
        assert self._outbox_ready is not None
        self._tasks.append(asyncio.create_task(self._send_outbox(self._ws), name="outbox"))
        self._tasks.append(asyncio.create_task(self._heartbeat(float(period)), name="heartbeat"))
        self._outbox_ready.set()
        if self._draining:
            self._drain_turn()  # a new connection hears it all again

    def _on_job(self, message: JobOrder) -> None:
        job_id, model_id = message.job_id, message.model_id
        if job_id in self._held or self._outbox.holds_final(job_id):
            log.info("job %s is already held; ignoring the duplicate", job_id)
            return
        timing = JobTiming(job_id=job_id, model_id=model_id, received=self._clock())
        job = HeldJob(job_id=job_id, model_id=model_id, params=message.params, timing=timing,
                      priority=message.priority or 0, account=message.account, resume=message.resume)
        self.timings.append(timing)
        if self._on_demand is not None and self._on_demand.closing(model_id):  # being unloaded: no new work
            log.info("job %s (%s) refused: the model is being unloaded", job_id, model_id)
            self._post(JobFailed(job_id, f"model {model_id!r} is not served by this worker").to_wire(), job)
            return
        self._held[job_id] = job
        self._denoiser.submit(job)
        log.info("job %s (%s, attempt %s, priority %d%s) received; holding %d", job_id, model_id, message.attempt,
                 job.priority, f", from step {job.resume.step}" if job.resume else "", len(self._held))
        if self._draining and self.v2:  # sent before the API read our `draining`: given back at once
            self._preempt_held(job)

    def _on_cancel(self, message: Cancel) -> None:
        """Let the job go: a waiting one at once, the running one at its next step boundary (no
        image decoded). A v2 API is answered job_failed "cancelled" then; a v1 API gets nothing more."""
        job_id = message.job_id
        if self._outbox.holds_final(job_id):
            if self.v2:
                log.info("cancel for job %s, which already ended: its final message answers it", job_id)
            else:
                self._outbox.forget(job_id)  # v1: nothing more is sent about a cancelled job
                log.info("job %s cancelled; its final message is not sent", job_id)
            return
        job = self._held.get(job_id)
        if job is None:
            log.info("cancel for job %s, which this worker does not hold", job_id)
            return
        if self._denoiser.cancel(job, answer=self.v2):
            log.info("job %s cancelled while it waited", job_id)
            self._let_go(job)
        else:
            log.info("job %s cancelled: it stops at its next step", job_id)

    def _on_preempt(self, message: Preempt) -> None:
        """Stop the job and answer job_preempted: a waiting one at once (step 0, no checkpoint; a
        job set aside here with the checkpoint it was set aside with), the running one at its next
        step boundary. Then the job is no longer held; its answer is kept until acknowledged."""
        job_id = message.job_id
        if self._outbox.holds_final(job_id):
            log.info("preempt for job %s, which already ended: its final message answers it", job_id)
            return
        job = self._held.get(job_id)
        if job is None:
            log.info("preempt for job %s, which this worker does not hold", job_id)
            return
        self._preempt_held(job)

    def _preempt_held(self, job: HeldJob) -> None:
        """Give a held job back (the API's preempt, or a drain): job_preempted now for one that is
        not running, at its next step boundary for the running one."""
        job_id = job.job_id
        where = self._denoiser.preempt(job)
        if where is None:
            log.info("job %s preempted: it stops at its next step boundary", job_id)
            return
        job.timing.outcome = "preempted"
        log.info("job %s preempted while it waited (after step %d)", job_id, where.step)
        answer = preempted_message(job_id, where)
        self._enqueue(Outgoing(answer["type"], json.dumps(answer), job, job_id))

    def _on_job_ack(self, message: JobAck) -> None:
        out = self._outbox.ack(message.job_id)
        self._drain_moved()
        if out is None:
            log.debug("job_ack for job %s, which has no final message waiting", message.job_id)

    def _on_session_start(self, message: SessionStart) -> None:
        answer = self.sessions.start(message.session_id, message.model_id, message.params)
        self._enqueue(Outgoing(answer.type, json.dumps(answer.to_wire()), None))

    def _on_session_end(self, message: SessionEnd) -> None:
        self.sessions.end(message.session_id)
        self._work_ended()

    def _on_frame(self, message: FrameOrder) -> None:
        self.sessions.frame(message)

    # --- models loaded on demand (models_on_demand.py) ----------------------------------------

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

    def model_work(self, model_id: str) -> tuple[int, int]:
        """(jobs held, live sessions) of a model: it is not unloaded while it has any."""
        return (sum(1 for job in self._held.values() if job.model_id == model_id),
                len(self.sessions.table.of_model(model_id)))

    def send_message(self, message: Message) -> None:
        """On the event loop: a message that is no job's (dropped while the connection is down)."""
        self._enqueue(Outgoing(message.type, json.dumps(message.to_wire()), None))

    def _work_ended(self) -> None:
        if self._on_demand is not None:
            self._on_demand.work_ended()

    # --- the memory ladder ----------------------------------------------------------------------

    def _demote_model(self, model_id: str, rung: str) -> None:
        """On the denoising thread: move a model down to `rung` (freed, reloaded, placed), then
        tell the API. The other models stay loaded, and run again as soon as this returns."""
        pipeline = self.pipelines[model_id]
        old, started = pipeline.rung, time.perf_counter()
        pipeline.move_to(rung)
        log.warning("model %s moved down from rung %s to %s after running out of memory (reloaded in %.1f s)",
                    model_id, old, rung, time.perf_counter() - started)
        self._call_soon(self._rung_changed, model_id)

    def _rung_changed(self, model_id: str) -> None:
        """On the event loop: end the model's live sessions here when it lost realtime, and send
        rung_changed (the API sends those sessions back to its queue)."""
        rung = self.pipelines[model_id].rung
        self.sessions.demote(model_id, rung)
        message = RungChanged(self.sessions.hello_entry(model_id, rung))
        self._enqueue(Outgoing(message.type, json.dumps(message.to_wire()), None))

    # --- outgoing -----------------------------------------------------------------------------

    def _post(self, message: dict[str, Any], job: HeldJob | None) -> None:
        """From any thread: queue a message for the API (serialized here, off the event loop)."""
        kind, text = message["type"], json.dumps(message)
        if kind == "job_result" and len(text) > self.config.max_result_bytes:
            # Sent, it would be refused and retried forever: report it instead.
            failed = JobFailed(message["job_id"],
                               f"result of {len(text)} bytes is over the {self.config.max_result_bytes}-byte limit")
            kind, text = failed.type, json.dumps(failed.to_wire())
        self._call_soon(self._enqueue, Outgoing(kind, text, job, message.get("job_id")))

    def _post_frame(self, message: dict[str, Any]) -> None:
        """From the frame encoder: queue a frame_result, unless its session ended meanwhile."""
        self._call_soon(self._enqueue_frame, message["session_id"], json.dumps(message))

    def _enqueue_frame(self, session_id: str, text: str) -> None:
        if self.sessions.holds(session_id):
            self._enqueue(Outgoing("frame_result", text, None))

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: the worker stopped
            pass

    def _enqueue(self, out: Outgoing) -> None:
        live = self._ws is not None and self._welcomed_ws is self._ws
        if out.kind not in KEPT_WHILE_DOWN and not live:
            return  # progress and heartbeats only mean something on a live connection
        if out.job is not None and out.job.cancelled:
            if out.final:  # it ended as it was cancelled: let it go instead of reporting it
                self._let_go(out.job)
            return
        if out.final and out.job is not None:
            self._release(out.job)  # it has ended; its final message is what remains of it here
        self._outbox.append(out)
        self._wake_outbox()

    def _wake_outbox(self) -> None:
        if self._outbox_ready is not None:
            self._outbox_ready.set()

    async def _send_outbox(self, ws: ClientConnection) -> None:
        """Send queued messages in order; a message leaves the outbox only once it was sent."""
        try:
            await self._drain_outbox(ws)
        except ConnectionClosed:
            pass  # the receive loop sees the close too, and the messages stay for the next welcome
        except Exception:
            log.exception("the outbox sender failed; reconnecting")
            await ws.close(1011, "worker error")

    async def _drain_outbox(self, ws: ClientConnection) -> None:
        assert self._outbox_ready is not None
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while (out := self._outbox.peek()) is not None:
                if not self._outbox.wanted(out) or (not out.final and out.job is not None and out.job.cancelled):
                    self._outbox.popleft()  # acknowledged, dropped, or about a cancelled job
                    self._drain_moved()
                    continue
                await ws.send(out.text)
                self._outbox.popleft()
                self._outbox.sent(out, now=self._clock(), await_ack=self.v2)
                self._drain_moved()
                if out.final and out.job is not None and out.job.timing.sent is None:  # logged once
                    self._finished(out.job, FINAL_OUTCOMES[out.kind])

    async def _heartbeat(self, period: float) -> None:
        """A heartbeat every period; with a v2 API, also every final message still not
        acknowledged a period after it was sent."""
        text = json.dumps(Heartbeat().to_wire())
        cutoff = self._clock()
        while True:
            await asyncio.sleep(period)
            self._enqueue(Outgoing("heartbeat", text, None))
            if self.v2 and self._outbox.resend_sent_before(cutoff):
                self._wake_outbox()
            cutoff = self._clock()

    def _finished(self, job: HeldJob, outcome: str) -> None:
        job.timing.sent = self._clock()
        job.timing.outcome = outcome
        self._release(job)
        log.info("%s", job.timing.summary())

    def _release(self, job: HeldJob) -> bool:
        """The job is done with: a new job with its id would be a new job. True if it was held."""
        if self._held.get(job.job_id) is job:
            del self._held[job.job_id]
            self._drain_moved()
            self._work_ended()
            return True
        return False

    def _let_go(self, job: HeldJob) -> None:
        """On the event loop: a job stopped without a result (cancelled; or the worker stops). A
        v2 API that cancelled it is owed job_failed "cancelled", kept until acknowledged."""
        if not self._release(job):
            return
        if job.cancelled:
            log.info("%s", job.timing.summary())
        if job.cancelled and job.answer_cancel:
            failed = JobFailed(job.job_id, CANCELLED)
            self._enqueue(Outgoing(failed.type, json.dumps(failed.to_wire()), None, job.job_id))

    def _let_go_threadsafe(self, job: HeldJob) -> None:
        self._call_soon(self._let_go, job)
