"""The worker socket /ws/worker/: translates between the wire (potocolom.protocol.worker), with one
handler per message type, and fleet.lifecycle, scheduling and realtime; v2 messages only to a v2
worker. docs/protocol.md, "Worker socket"."""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

from asgiref.sync import ThreadSensitiveContext
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connection, connections
from django.utils import timezone

from fleet import lifecycle
from potocolom.protocol import close_codes
from potocolom.protocol.errors import MessageError
from potocolom.protocol.events import (
    JobsAvailable,
    SessionFrame,
    WorkerCancel,
    WorkerPlace,
    WorkerPreempt,
    WorkerReplaced,
)
from potocolom.protocol.worker import (
    PROTOCOL_V1,
    PROTOCOL_V2,
    Cancel,
    Draining,
    FrameResult,
    Heartbeat,
    Hello,
    JobAck,
    JobCheckpoint,
    JobFailed,
    JobPreempted,
    JobProgress,
    JobResult,
    JobStarted,
    LoadModel,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    RungChanged,
    SessionAccepted,
    SessionEnded,
    SessionRefused,
    UnloadModel,
    Welcome,
    WorkerMessage,
    checkpoint_bytes,
    parse_worker_message,
)
from potocolom.transport import relay
from potocolom.transport.relay import RelayConsumer
from potocolom.web.errors import close_code_of
from realtime import services as sessions
from scheduling import services as jobs
from workers import services
from workers.errors import WorkerIdTaken
from workers.liveness import worker_is_dead
from workers.placement_state import LOAD

log = logging.getLogger(__name__)


def query_token(scope: dict[str, Any]) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


def presented_token(scope: dict[str, Any]) -> str | None:
    """The worker token of the handshake: its `Authorization: Token T` header (which keeps the
    token out of URLs and logs), else `?token=T`."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "token" and token.strip():
                return token.strip()
    return query_token(scope)


def own_threads() -> bool:
    """Whether worker sockets get a database thread each (WorkerConsumer.__call__)."""
    return not getattr(connection, "is_in_memory_db", lambda: False)()


def shared_queue() -> bool:
    return bool(settings.JOB_QUEUE == "redis")


class WorkerConsumer(RelayConsumer):
    """One GPU worker's connection. A Redis outage leaves it open (the workers group is joined again
    every period); should it fail all the same, it is lost as on a close, and its watch stops."""

    layer_outage_waits = True
    worker_id: str | None = None
    credential: Any = None
    watchdog: asyncio.Task | None = None
    lost = False
    protocol = PROTOCOL_V1  # its hello's
    seen_written = 0.0  # when last_seen was last written to its row (time.monotonic())
    outer: contextvars.Context | None = None  # the context outside the socket's own thread

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Each worker socket's database calls run on a thread of its own with its own database
        connection (closed when the socket ends), one call at a time, in order: a worker's reports
        wait for no other worker's (on asgiref's one shared thread, a report stuck on a locked row
        held up every worker of the process, and all their reports went one at a time). Its watch,
        which may outlive the socket, keeps the shared thread. Not with an in-memory SQLite database
        (the tests'), whose shared cache refuses a second writer at once instead of waiting."""
        if not own_threads():
            await super().__call__(scope, receive, send)
            return
        self.outer = contextvars.copy_context()
        executor = ThreadPoolExecutor(1, thread_name_prefix="worker-socket")
        try:
            async with ThreadSensitiveContext(executor=executor):
                await super().__call__(scope, receive, send)
        finally:
            executor.submit(connections.close_all)
            executor.shutdown(wait=False)

    async def connect(self) -> None:
        """Accept, then close with 4001 unless the token is a worker credential."""
        await self.accept()
        self.credential = await database_sync_to_async(services.worker_token_check)(
            token=presented_token(self.scope))
        if self.credential is None:
            await self.close(code=close_codes.NOT_AUTHENTICATED)
            return
        self.last_seen = time.monotonic()
        # A connection that never says hello, or falls silent later, is closed all the same.
        self.watchdog = asyncio.create_task(self.watch(), context=self.outer)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Parse a message and hand it to its handler; a bad message is logged, never fatal, and so
        is a database or storage error after the hello (the socket stays; a v2 worker sends an
        unacked result again). A hello that fails so ends the connection: the worker says it again."""
        if self.credential is None or self.lost:
            return
        self.last_seen = time.monotonic()
        try:
            message = parse_worker_message(json.loads(text_data or ""))
            if isinstance(message, Hello):
                await self.on_hello(message)
                return
            if self.worker_id is None:
                raise MessageError("the first message must be hello")
            await self.on_message(message)
        except (ValueError, MessageError) as exc:
            log.warning("worker %s: bad message: %s", self.worker_id or "(no hello)", exc)

    async def on_message(self, message: WorkerMessage) -> None:
        """Any message after the hello, to its handler `on_<type>` (channels' rule); a failure of a
        handler is logged and leaves the socket open."""
        try:
            await getattr(self, f"on_{message.type}")(message)
            await self.heard()
        except (ValueError, MessageError):
            raise
        except Exception:
            log.exception("worker %s: a %s could not be handled", self.worker_id, message.type)

    async def heard(self) -> None:
        """Its row's last_seen moves with its messages, written at most once a heartbeat period."""
        if self.worker_id is None or self.lost:
            return
        if self.last_seen - self.seen_written >= settings.WORKER_HEARTBEAT_SECONDS:
            self.seen_written = self.last_seen
            await database_sync_to_async(services.worker_seen)(worker_id=self.worker_id, now=timezone.now())

    async def on_hello(self, hello: Hello) -> None:
        """Record the hello, welcome (in the protocol both speak), then give the worker its jobs. A
        worker_id bound to another token closes this socket with 4003; its live connection stays."""
        if self.worker_id is not None and hello.worker_id != self.worker_id:
            raise MessageError("a connection cannot change its worker_id")
        try:
            arrival = await database_sync_to_async(lifecycle.worker_arrives)(
                hello=hello, token=self.credential, channel_name=self.channel_name, now=timezone.now())
        except WorkerIdTaken as exc:
            log.warning("worker %s: refused: %s", hello.worker_id, exc)
            self.credential = None  # nothing more from this socket is read
            await self.close(code=close_code_of(exc))
            return
        self.worker_id, self.protocol, self.seen_written = hello.worker_id, hello.protocol, time.monotonic()
        welcome = Welcome(arrival.unknown, settings.WORKER_HEARTBEAT_SECONDS, settings.FRAME_BUDGET_MS,
                          protocol=hello.protocol, checkpoint_seconds=float(settings.JOB_CHECKPOINT_SECONDS),
                          preview_steps=settings.PREVIEW_STEPS)
        await self.send(text_data=json.dumps(welcome.to_wire()))
        if shared_queue():
            await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name)
        replaced = await database_sync_to_async(lifecycle.worker_connected)(
            hello=hello, channel_name=self.channel_name, arrival=arrival, now=timezone.now())
        if replaced:
            await relay.send(replaced, WorkerReplaced().to_event())

    async def in_database(self, service: Callable[..., object], **fields: Any) -> None:
        """Call a service with this worker's id and the time, on the database thread."""
        await database_sync_to_async(service)(worker_id=self.worker_id or "", now=timezone.now(), **fields)

    async def store_final(self, message: JobResult | JobFailed | JobPreempted, service: Callable[..., object],
                          **fields: Any) -> None:
        """Store a job's result, failure or preemption; a v2 worker gets job_ack once it is stored
        (also when it changed nothing: a duplicate, or a job it no longer holds). A storage or
        database error is logged and not acked: the worker sends it again."""
        try:
            await self.in_database(service, job_id=message.job_id, **fields)
        except Exception:
            log.exception("worker %s: could not store the %s of job %s; not acknowledged", self.worker_id,
                          message.type, message.job_id)
            return
        if self.protocol >= PROTOCOL_V2:
            await self.send(text_data=json.dumps(JobAck(message.job_id).to_wire()))

    # one handler per worker message (after the hello)

    async def on_heartbeat(self, message: Heartbeat) -> None:
        """Nothing but being heard."""

    async def on_job_started(self, message: JobStarted) -> None:
        await self.in_database(jobs.job_started, job_id=message.job_id)

    async def on_job_progress(self, message: JobProgress) -> None:
        await self.in_database(jobs.job_progress, job_id=message.job_id, step=message.step, steps=message.steps,
                               preview=message.preview)

    async def on_job_result(self, message: JobResult) -> None:
        await self.store_final(message, jobs.job_finish, images=message.images, gpu_ms=message.gpu_ms,
                               rung=message.rung)

    async def on_job_failed(self, message: JobFailed) -> None:
        await self.store_final(message, jobs.job_fail, error=message.error)

    async def on_job_preempted(self, message: JobPreempted) -> None:
        checkpoint = None if message.checkpoint is None else checkpoint_bytes(message.checkpoint)
        await self.store_final(message, jobs.job_preempted, step=message.step, steps=message.steps,
                               checkpoint=checkpoint)

    async def on_job_checkpoint(self, message: JobCheckpoint) -> None:
        await self.in_database(jobs.job_checkpoint, job_id=message.job_id, step=message.step, steps=message.steps,
                               checkpoint=checkpoint_bytes(message.checkpoint))

    async def on_session_accepted(self, message: SessionAccepted) -> None:
        await self.in_database(sessions.session_accept, session_id=message.session_id,
                               channel_name=self.channel_name)

    async def on_session_refused(self, message: SessionRefused) -> None:
        await self.in_database(sessions.session_refuse, session_id=message.session_id, reason=message.reason)

    async def on_session_ended(self, message: SessionEnded) -> None:
        """Only a draining worker ends sessions itself, after `draining`, which already sent its
        sessions back to the queue: nothing is left to do."""
        log.info("worker %s ended session %s", self.worker_id, message.session_id)

    async def on_draining(self, message: Draining) -> None:
        log.info("worker %s is draining: no new job or session goes to it", self.worker_id)
        await self.in_database(lifecycle.worker_draining, channel_name=self.channel_name)

    async def on_rung_changed(self, message: RungChanged) -> None:
        await self.in_database(lifecycle.worker_rung_changed, entry=message.entry, channel_name=self.channel_name)

    async def on_model_loaded(self, message: ModelLoaded) -> None:
        log.info("worker %s loaded %s on rung %s", self.worker_id, message.entry.model_id, message.entry.rung)
        await self.in_database(lifecycle.worker_model_loaded, entry=message.entry, gpu=message.gpu,
                               channel_name=self.channel_name)

    async def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        log.warning("worker %s could not load %s: %s", self.worker_id, message.model_id, message.error)
        await self.in_database(lifecycle.worker_model_load_failed, model_id=message.model_id, error=message.error,
                               gpu=message.gpu)

    async def on_model_unloaded(self, message: ModelUnloaded) -> None:
        log.info("worker %s unloaded %s", self.worker_id, message.model_id)
        await self.in_database(lifecycle.worker_model_unloaded, model_id=message.model_id, gpu=message.gpu)

    async def on_frame_result(self, result: FrameResult) -> None:
        """A frame goes straight to its browser (no database on this path)."""
        browser = sessions.frame_result_route(worker_id=self.worker_id or "", session_id=result.session_id)
        if browser is not None:
            await relay.send(browser, SessionFrame(result.seq, result.image, result.gpu_ms).to_event())

    async def watch(self) -> None:
        """Every heartbeat period: a revoked token closes the socket (4001), and a worker silent for
        3 periods is dead (4008). (Workers of other processes: fleet.sweeper.)"""
        period = settings.WORKER_HEARTBEAT_SECONDS
        while not self.lost:
            await asyncio.sleep(period)
            if self.credential is None or self.ended:
                await self.after_end()
                return
            alive = not worker_is_dead(last_seen=self.last_seen, now=time.monotonic(), heartbeat_seconds=period)
            try:
                if not await database_sync_to_async(services.worker_token_holds)(token_id=self.credential.pk):
                    log.warning("worker %s: its token %s was revoked", self.worker_id or "(no hello)",
                                self.credential.name)
                    await self.lose()
                    await self.close(code=close_codes.NOT_AUTHENTICATED)
                    return
                if shared_queue() and alive and self.worker_id is not None:
                    # Groups expire, and a restarted Redis has none: join again every period.
                    await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name)
                    # A wake-up (jobs.available) lost meanwhile costs a queued job one period, not forever.
                    await lifecycle.dispatch_soon()
            except Exception:  # the database or Redis is away this period: the watch goes on
                log.exception("worker %s: the periodic check failed", self.worker_id or "(no hello)")
            if self.ended:
                await self.after_end()
                return
            if worker_is_dead(last_seen=self.last_seen, now=time.monotonic(), heartbeat_seconds=period):
                log.warning("worker %s sent nothing for 3 heartbeat periods: dead", self.worker_id or "(no hello)")
                await self.lose()
                await self.close(code=close_codes.SILENT)
                return

    async def after_end(self) -> None:
        """The watch outlived its consumer (one that ended without its disconnect, e.g. cancelled):
        the connection is lost, quietly; its worker's silence on this socket says nothing of the
        worker, which may well be heard on a newer connection."""
        if self.ended and not self.lost:
            await self.lose()

    async def lose(self) -> None:
        """This connection is over: its jobs follow the retry rule (once)."""
        if self.lost or self.worker_id is None:
            self.lost = True
            return
        self.lost = True
        await database_sync_to_async(lifecycle.worker_lost)(worker_id=self.worker_id, channel_name=self.channel_name,
                                                           now=timezone.now())

    async def disconnect(self, code: int) -> None:
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        if shared_queue() and self.channel_layer is not None:
            await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name, join=False)
        await self.lose()

    # events from services and other API processes

    async def jobs_available(self, event: dict[str, Any]) -> None:
        """A job waits that the process that queued it could not place: look at the queue again."""
        if self.worker_id is not None and not self.lost:
            await lifecycle.dispatch_soon(waiting=jobs.waiting_of(JobsAvailable.parse(event)))

    async def worker_cancel(self, event: dict[str, Any]) -> None:
        """Another process cancelled (or requeued) a job of this worker: tell it, free its place."""
        cancel = WorkerCancel.parse(event)
        if cancel.worker_id == self.worker_id and not self.lost:
            await self.send(text_data=json.dumps(Cancel(cancel.job_id).to_wire()))
            await self.in_database(jobs.job_left_worker, job_id=cancel.job_id)

    async def worker_preempt(self, event: dict[str, Any]) -> None:
        """Another process paused a job of this worker: it is preempted here (or cancelled on v1)."""
        preempt = WorkerPreempt.parse(event)
        if preempt.worker_id == self.worker_id and not self.lost:
            await self.in_database(jobs.job_preempt_held, job_id=preempt.job_id)

    async def worker_place(self, event: dict[str, Any]) -> None:
        """Placement's action for this worker (fleet.placement.driver), in the order planned: load_model at
        once; unload_model only once the model takes no new work here and holds none."""
        place = WorkerPlace.parse(event)
        if place.worker_id != self.worker_id or self.lost or self.protocol < PROTOCOL_V2:
            return
        if place.action == LOAD:
            await self.send(text_data=json.dumps(LoadModel(place.model_id, place.rung).to_wire()))
            return
        if await database_sync_to_async(lifecycle.worker_model_unload_begins)(
                worker_id=self.worker_id or "", model_id=place.model_id, channel_name=self.channel_name,
                now=timezone.now()):
            await self.send(text_data=json.dumps(UnloadModel(place.model_id).to_wire()))

    async def socket_send(self, event: dict[str, Any]) -> None:
        """A message for the worker from a service (job, cancel, session_start, session_end). A
        session_start of the shared admission names the browser's channel, for its frame results."""
        if self.lost:
            return
        message = event["message"]
        if event.get("browser"):
            sessions.session_route(session_id=message["session_id"], worker_id=self.worker_id or "",
                                   worker_channel=self.channel_name, browser=event["browser"])
        elif message.get("type") == "session_end":
            sessions.session_unroute(session_id=message.get("session_id", ""), worker_id=self.worker_id or "")
        await self.send(text_data=json.dumps(message))

    async def worker_replaced(self, event: dict[str, Any]) -> None:
        """A newer connection of this worker took over: leave without sending its jobs back."""
        self.lost = True
        await self.close(code=close_codes.REPLACED)
