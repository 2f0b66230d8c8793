"""The worker socket /ws/worker/ (token in `Authorization: Token T` or `?token=T`): translates between
the wire (potocolom.protocol.worker) and fleet.lifecycle, scheduling and realtime. v2 messages
(job_ack, preempt, a job's resume) go only to a worker whose hello said `"protocol": 2`. The story:
docs/protocol.md."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from fleet import lifecycle
from potocolom.protocol import close_codes
from potocolom.protocol.errors import MessageError
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


def shared_queue() -> bool:
    return bool(settings.JOB_QUEUE == "redis")


class WorkerConsumer(RelayConsumer):
    """One GPU worker's connection."""

    worker_id: str | None = None
    credential: Any = None
    watchdog: asyncio.Task | None = None
    lost = False
    protocol = PROTOCOL_V1  # its hello's
    seen_written = 0.0  # when last_seen was last written to its row (time.monotonic())

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
        self.watchdog = asyncio.create_task(self.watch())

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
        """Any message after the hello."""
        try:
            if isinstance(message, FrameResult):
                await self.on_frame_result(message)
            elif isinstance(message, (JobResult, JobFailed, JobPreempted)):
                await self.on_final(message)
            elif not isinstance(message, Heartbeat):
                await database_sync_to_async(self.handle)(message)
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
            await relay.send(replaced, {"type": "worker.replaced"})

    async def on_final(self, message: JobResult | JobFailed | JobPreempted) -> None:
        """Store a job's result, failure or preemption; a v2 worker gets job_ack once it is stored
        (also when it changed nothing: a duplicate, or a job it no longer holds). A storage or
        database error is logged and not acked: the worker sends it again."""
        try:
            await database_sync_to_async(self.handle)(message)
        except Exception:
            log.exception("worker %s: could not store the %s of job %s; not acknowledged", self.worker_id,
                          message.type, message.job_id)
            return
        if self.protocol >= PROTOCOL_V2:
            await self.send(text_data=json.dumps(JobAck(message.job_id).to_wire()))

    def handle(self, message: WorkerMessage) -> None:
        """A job or session message: the service it concerns (on the database thread)."""
        worker_id, now = self.worker_id or "", timezone.now()
        if isinstance(message, JobStarted):
            jobs.job_started(worker_id=worker_id, job_id=message.job_id, now=now)
        elif isinstance(message, JobProgress):
            jobs.job_progress(worker_id=worker_id, job_id=message.job_id, step=message.step, steps=message.steps,
                              preview=message.preview, now=now)
        elif isinstance(message, JobResult):
            jobs.job_finish(worker_id=worker_id, job_id=message.job_id, images=message.images,
                            gpu_ms=message.gpu_ms, rung=message.rung, now=now)
        elif isinstance(message, JobFailed):
            jobs.job_fail(worker_id=worker_id, job_id=message.job_id, error=message.error, now=now)
        elif isinstance(message, JobPreempted):
            checkpoint = None if message.checkpoint is None else checkpoint_bytes(message.checkpoint)
            jobs.job_preempted(worker_id=worker_id, job_id=message.job_id, step=message.step, steps=message.steps,
                               checkpoint=checkpoint, now=now)
        elif isinstance(message, JobCheckpoint):
            jobs.job_checkpoint(worker_id=worker_id, job_id=message.job_id, step=message.step, steps=message.steps,
                                checkpoint=checkpoint_bytes(message.checkpoint), now=now)
        elif isinstance(message, SessionAccepted):
            sessions.session_accept(worker_id=worker_id, session_id=message.session_id,
                                    channel_name=self.channel_name, now=now)
        elif isinstance(message, SessionRefused):
            sessions.session_refuse(worker_id=worker_id, session_id=message.session_id, reason=message.reason,
                                    now=now)
        elif isinstance(message, Draining):
            log.info("worker %s is draining: no new job or session goes to it", worker_id)
            lifecycle.worker_draining(worker_id=worker_id, channel_name=self.channel_name, now=now)
        elif isinstance(message, SessionEnded):
            # Only a draining worker ends sessions itself, after `draining`, which already sent
            # its sessions back to the queue: nothing is left to do.
            log.info("worker %s ended session %s", worker_id, message.session_id)
        elif isinstance(message, RungChanged):
            lifecycle.worker_rung_changed(worker_id=worker_id, entry=message.entry, channel_name=self.channel_name,
                                          now=now)
        elif isinstance(message, ModelLoaded):
            log.info("worker %s loaded %s on rung %s", worker_id, message.entry.model_id, message.entry.rung)
            lifecycle.worker_model_loaded(worker_id=worker_id, entry=message.entry, gpu=message.gpu,
                                          channel_name=self.channel_name, now=now)
        elif isinstance(message, ModelLoadFailed):
            log.warning("worker %s could not load %s: %s", worker_id, message.model_id, message.error)
            lifecycle.worker_model_load_failed(worker_id=worker_id, model_id=message.model_id, error=message.error,
                                               gpu=message.gpu, now=now)
        elif isinstance(message, ModelUnloaded):
            log.info("worker %s unloaded %s", worker_id, message.model_id)
            lifecycle.worker_model_unloaded(worker_id=worker_id, model_id=message.model_id, gpu=message.gpu, now=now)

    async def on_frame_result(self, result: FrameResult) -> None:
        """A frame goes straight to its browser (no database on this path)."""
        browser = sessions.frame_result_route(worker_id=self.worker_id or "", session_id=result.session_id)
        if browser is not None:
            await relay.send(browser, {"type": "session.frame", "seq": result.seq,
                                       "image": result.image, "gpu_ms": result.gpu_ms})

    async def watch(self) -> None:
        """Every heartbeat period: a revoked token closes the socket (4001), and a worker silent for
        3 periods is dead (4008). (Workers of other processes: fleet.sweeper.)"""
        period = settings.WORKER_HEARTBEAT_SECONDS
        while not self.lost:
            await asyncio.sleep(period)
            if self.credential is None:
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
            if worker_is_dead(last_seen=self.last_seen, now=time.monotonic(), heartbeat_seconds=period):
                log.warning("worker %s sent nothing for 3 heartbeat periods: dead", self.worker_id or "(no hello)")
                await self.lose()
                await self.close(code=close_codes.SILENT)
                return

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
            await lifecycle.dispatch_soon(waiting=jobs.waiting_of(event))

    async def worker_cancel(self, event: dict[str, Any]) -> None:
        """Another process cancelled (or requeued) a job of this worker: tell it, free its place."""
        if event.get("worker_id") == self.worker_id and not self.lost:
            await self.send(text_data=json.dumps(Cancel(event["job_id"]).to_wire()))
            await database_sync_to_async(jobs.job_left_worker)(worker_id=self.worker_id or "",
                                                               job_id=event["job_id"], now=timezone.now())

    async def worker_preempt(self, event: dict[str, Any]) -> None:
        """Another process paused a job of this worker: it is preempted here (or cancelled on v1)."""
        if event.get("worker_id") == self.worker_id and not self.lost:
            await database_sync_to_async(jobs.job_preempt_held)(worker_id=self.worker_id or "",
                                                                job_id=str(event.get("job_id", "")), now=timezone.now())

    async def worker_place(self, event: dict[str, Any]) -> None:
        """Placement's action for this worker (fleet.placement.driver), in the order planned: load_model at
        once; unload_model only once the model takes no new work here and holds none."""
        if event.get("worker_id") != self.worker_id or self.lost or self.protocol < PROTOCOL_V2:
            return
        model_id = str(event.get("model_id", ""))
        if event.get("action") == "load":
            await self.send(text_data=json.dumps(LoadModel(model_id, event.get("rung")).to_wire()))
            return
        if await database_sync_to_async(lifecycle.worker_model_unload_begins)(
                worker_id=self.worker_id or "", model_id=model_id, channel_name=self.channel_name, now=timezone.now()):
            await self.send(text_data=json.dumps(UnloadModel(model_id).to_wire()))

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
