"""The worker socket /ws/worker/?token=T: translates between the wire and the services."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from django.conf import settings

from potocolom import relay
from potocolom.relay import RelayConsumer
from realtime import services as sessions
from scheduling import services as jobs
from scheduling.jobs import worker_is_dead
from workers import services
from workers.messages import (
    MessageError,
    parse_frame_result,
    parse_hello,
    parse_job_failed,
    parse_job_id,
    parse_job_progress,
    parse_job_result,
    parse_rung_changed,
    parse_session_id,
    parse_session_refused,
)

log = logging.getLogger(__name__)
CLOSE_UNAUTHENTICATED = 4001
CLOSE_REPLACED = 4002  # a newer connection with the same worker_id took over
CLOSE_SILENT = 4008  # no message for 3 heartbeat periods


def query_token(scope: dict[str, Any]) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


def shared_queue() -> bool:
    return bool(settings.JOB_QUEUE == "redis")


_dispatching = False
_dispatch_again = False


async def dispatch_soon() -> None:
    """Run the dispatch once for this process however many of its worker sockets are woken at once:
    a wake-up during a run makes one more run after it, not one per socket."""
    global _dispatching, _dispatch_again
    if _dispatching:
        _dispatch_again = True
        return
    _dispatching = True
    try:
        while True:
            _dispatch_again = False
            await database_sync_to_async(jobs.dispatch)()
            if not _dispatch_again:
                return
    finally:
        _dispatching = False


class WorkerConsumer(RelayConsumer):
    """One GPU worker's connection."""

    worker_id: str | None = None
    credential: Any = None
    watchdog: asyncio.Task | None = None
    lost = False

    async def connect(self) -> None:
        """Accept, then close with 4001 unless the token is a worker credential."""
        await self.accept()
        self.credential = await database_sync_to_async(services.worker_token_check)(token=query_token(self.scope))
        if self.credential is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.last_seen = time.monotonic()
        self.routes: dict[str, str] = {}  # several API processes: session_id -> browser channel
        # A connection that never says hello, or falls silent later, is closed all the same.
        self.watchdog = asyncio.create_task(self.watch())

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Parse a JSON message and hand it to its handler; a bad message is logged, never fatal."""
        if self.credential is None or self.lost:
            return
        self.last_seen = time.monotonic()
        try:
            message = json.loads(text_data or "")
            if not isinstance(message, dict):
                raise MessageError("a message must be a JSON object")
            kind = message.get("type")
            if kind == "hello":
                await self.on_hello(message)
            elif self.worker_id is None:
                raise MessageError("the first message must be hello")
            elif kind == "heartbeat":
                pass
            elif kind == "frame_result":
                await self.on_frame_result(message)
            elif kind in self.HANDLERS:
                await database_sync_to_async(self.HANDLERS[kind])(self, message)
            else:
                log.info("worker %s sent a message this API does not handle yet: %r", self.worker_id, kind)
        except (ValueError, MessageError) as exc:
            log.warning("worker %s: bad message: %s", self.worker_id or "(no hello)", exc)

    async def on_hello(self, message: dict[str, Any]) -> None:
        hello = parse_hello(message)
        if self.worker_id is not None and hello.worker_id != self.worker_id:
            raise MessageError("a connection cannot change its worker_id")
        served, unknown = await database_sync_to_async(services.worker_hello)(
            worker_id=hello.worker_id, token=self.credential, gpu=hello.gpu,
            models=[m.as_dict() for m in hello.models])
        self.worker_id = hello.worker_id
        await self.send(text_data=json.dumps({
            "type": "welcome", "unknown_models": unknown,
            "heartbeat_seconds": settings.WORKER_HEARTBEAT_SECONDS, "frame_budget_ms": settings.FRAME_BUDGET_MS}))
        if shared_queue():
            await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name)
        replaced = await database_sync_to_async(jobs.worker_connected)(
            worker_id=hello.worker_id, channel_name=self.channel_name, models=[m["model_id"] for m in served])
        if replaced:
            await relay.send(replaced, {"type": "worker.replaced"})
        await database_sync_to_async(sessions.worker_slots_set)(
            worker_id=hello.worker_id, channel_name=self.channel_name, models=served)

    def on_job_started(self, message: dict[str, Any]) -> None:
        jobs.job_started(worker_id=self.worker_id or "", job_id=parse_job_id(message))

    def on_job_progress(self, message: dict[str, Any]) -> None:
        job_id, step, steps = parse_job_progress(message)
        jobs.job_progress(worker_id=self.worker_id or "", job_id=job_id, step=step, steps=steps)

    def on_job_result(self, message: dict[str, Any]) -> None:
        result = parse_job_result(message)
        jobs.job_finish(worker_id=self.worker_id or "", job_id=result.job_id, images=result.images,
                        gpu_ms=result.gpu_ms, rung=result.rung)

    def on_job_failed(self, message: dict[str, Any]) -> None:
        job_id, error = parse_job_failed(message)
        jobs.job_fail(worker_id=self.worker_id or "", job_id=job_id, error=error)

    def on_session_accepted(self, message: dict[str, Any]) -> None:
        sessions.session_accept(worker_id=self.worker_id or "", session_id=parse_session_id(message),
                                now=time.monotonic(), channel_name=self.channel_name)

    def on_session_refused(self, message: dict[str, Any]) -> None:
        session_id, reason = parse_session_refused(message)
        self.routes.pop(session_id, None)
        sessions.session_refuse(worker_id=self.worker_id or "", session_id=session_id, reason=reason)

    def on_rung_changed(self, message: dict[str, Any]) -> None:
        change = parse_rung_changed(message)
        services.worker_rung_set(worker_id=self.worker_id or "", model_id=change.model_id, entry={
            "model_id": change.model_id, "rung": change.rung, "realtime": change.realtime,
            "frame_ms_p95": change.frame_ms_p95, "realtime_slots": change.realtime_slots})
        sessions.worker_rung_changed(worker_id=self.worker_id or "", model_id=change.model_id,
                                     realtime=change.realtime, realtime_slots=change.realtime_slots,
                                     frame_ms_p95=change.frame_ms_p95, channel_name=self.channel_name)

    async def on_frame_result(self, message: dict[str, Any]) -> None:
        """A frame goes straight to its browser (no database on this path). With several API
        processes the browser's channel came with the session_start (`routes`)."""
        result = parse_frame_result(message)
        browser = self.routes.get(result.session_id) or sessions.frame_result_route(
            worker_id=self.worker_id or "", session_id=result.session_id)
        if browser is not None:
            await relay.send(browser, {"type": "session.frame", "seq": result.seq,
                                       "image": result.image, "gpu_ms": result.gpu_ms})

    HANDLERS = {"job_started": on_job_started, "job_progress": on_job_progress,
                "job_result": on_job_result, "job_failed": on_job_failed,
                "session_accepted": on_session_accepted, "session_refused": on_session_refused,
                "rung_changed": on_rung_changed}

    async def watch(self) -> None:
        """Every heartbeat period: a worker silent for 3 periods is dead; workers that held jobs
        before this API process started and did not come back lose them."""
        period = settings.WORKER_HEARTBEAT_SECONDS
        while not self.lost:
            await asyncio.sleep(period)
            try:
                if shared_queue() and self.worker_id is not None and not worker_is_dead(
                        last_seen=self.last_seen, now=time.monotonic(), heartbeat_seconds=period):
                    # Other API processes read this to tell a worker connected here from a lost one.
                    await database_sync_to_async(jobs.worker_seen)(worker_id=self.worker_id)
                    # Groups expire, and a restarted Redis has none: join again every period.
                    await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name)
                    # A wake-up (jobs.available) lost meanwhile costs a queued job one period, not forever.
                    await dispatch_soon()
                await database_sync_to_async(jobs.sweep_orphans)()
            except Exception:  # the database or Redis is away this period: the watch goes on
                log.exception("worker %s: the periodic check failed", self.worker_id or "(no hello)")
            if worker_is_dead(last_seen=self.last_seen, now=time.monotonic(), heartbeat_seconds=period):
                log.warning("worker %s sent nothing for 3 heartbeat periods: dead", self.worker_id or "(no hello)")
                await self.lose()
                await self.close(code=CLOSE_SILENT)
                return

    async def lose(self) -> None:
        """This connection is over: its jobs follow the retry rule (once)."""
        if self.lost or self.worker_id is None:
            self.lost = True
            return
        self.lost = True
        current = await database_sync_to_async(jobs.worker_disconnected)(worker_id=self.worker_id,
                                                                         channel_name=self.channel_name)
        if current:
            await database_sync_to_async(services.worker_gone)(worker_id=self.worker_id)
        await database_sync_to_async(sessions.worker_sessions_return)(worker_id=self.worker_id,
                                                                      channel_name=self.channel_name)

    async def disconnect(self, code: int) -> None:
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        if shared_queue() and self.channel_layer is not None:
            await relay.group_membership(self.channel_layer, jobs.WORKERS_GROUP, self.channel_name, join=False)
        await self.lose()

    # messages from other API processes (a shared queue)

    async def jobs_available(self, event: dict[str, Any]) -> None:
        """A job waits that the process that queued it could not place: look at the queue again."""
        if self.worker_id is not None and not self.lost:
            await dispatch_soon()

    async def worker_cancel(self, event: dict[str, Any]) -> None:
        """Another process cancelled (or requeued) a job of this worker: tell it, free its place."""
        if event.get("worker_id") == self.worker_id and not self.lost:
            await self.send(text_data=json.dumps({"type": "cancel", "job_id": event["job_id"]}))
            await database_sync_to_async(jobs.job_left_worker)(worker_id=self.worker_id or "",
                                                               job_id=event["job_id"])

    async def worker_send(self, event: dict[str, Any]) -> None:
        """A message for the worker from a service (job, cancel, session_start, session_end). A
        session_start of shared admission names the browser's channel, for its frame results."""
        if not self.lost:
            message = event["message"]
            if event.get("browser"):
                self.routes[message["session_id"]] = event["browser"]
            elif message.get("type") == "session_end":
                self.routes.pop(message.get("session_id", ""), None)
            await self.send(text_data=json.dumps(message))

    async def worker_replaced(self, event: dict[str, Any]) -> None:
        """A newer connection of this worker took over: leave without sending its jobs back."""
        self.lost = True
        await self.close(code=CLOSE_REPLACED)
