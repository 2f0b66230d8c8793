"""The browser socket /ws/session/: translates between the wire and the session services."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from potocolom import metrics
from potocolom.protocol import close_codes
from potocolom.protocol.browser import Error, Frame, image_data_url, parse_browser_message
from potocolom.protocol.errors import MessageError
from potocolom.protocol.events import SessionBack, SessionFrame, SessionFrameDue, SessionLive
from potocolom.protocol.worker import FrameOrder
from potocolom.transport import relay
from potocolom.transport.notify import socket_event
from potocolom.transport.relay import RelayConsumer
from potocolom.web.errors import close_code_of
from potocolom.web.sockets import presented_token, socket_account
from realtime import services
from realtime.errors import NotAuthenticated, SessionError
from realtime.frames import FrameGate
from realtime.sweeper import sweeper_hold, sweeper_release

if TYPE_CHECKING:
    from prometheus_client import Histogram

log = logging.getLogger(__name__)
RECEIVED_KEPT = 256  # receive times remembered for `ms` (frames still in flight)


def query_of(scope: dict[str, Any]) -> dict[str, str]:
    parsed = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {name: values[-1] for name, values in parsed.items()}


class SessionConsumer(RelayConsumer):
    """One drawing page's session. A Redis outage leaves it open (its frames and news come locally or
    over the bus, which reconnects); should it fail all the same, its session is closed as on a close."""

    layer_outage_waits = True
    session_id: str | None = None
    idle_watch: asyncio.Task | None = None
    due_timer: asyncio.TimerHandle | None = None
    frame_seconds: Histogram  # its model's potocolom_frame_seconds, once the session is joined

    async def connect(self) -> None:
        """Accept, then join the session or close with the code that says why not."""
        await self.accept()
        self.received: dict[int, float] = {}  # seq -> monotonic time the frame arrived (for `ms`)
        self.last_sent_seq = -1
        # One frame in flight to the worker; the next after its result or 2 x FRAME_BUDGET_MS.
        self.gate = FrameGate(wait_seconds=2 * settings.FRAME_BUDGET_MS / 1000)
        try:
            query = query_of(self.scope)
            account = await database_sync_to_async(socket_account)(
                user=self.scope.get("user"), token=presented_token(self.scope))
            if account is None:
                raise NotAuthenticated()
            model_id, params = await database_sync_to_async(services.session_request)(query=query)
            session = await database_sync_to_async(services.session_join)(
                account=account, model_id=model_id, params=params, channel_name=self.channel_name, now=timezone.now())
        except SessionError as exc:
            # A close reason is at most 123 bytes.
            await self.close(code=close_code_of(exc), reason=str(exc.detail).encode()[:120].decode(errors="ignore"))
            return
        self.frame_seconds = metrics.frame_seconds_of(session.model_id)
        self.session_id = str(session.id)
        sweeper_hold()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """A frame goes to the worker (or waits as the newest); anything else answers `error`."""
        if self.session_id is None:
            return
        arrived = time.monotonic()
        limit = settings.BROWSER_MESSAGE_MAX_BYTES
        size = len(bytes_data) if bytes_data is not None else len(text_data or "")
        if size > limit or (text_data and size * 4 > limit and len(text_data.encode()) > limit):
            await self.leave()
            await self.close(code=close_codes.MESSAGE_TOO_BIG)
            return
        try:
            if bytes_data is not None:
                raise MessageError("messages are JSON text")
            frame = parse_browser_message(text_data or "", max_pixels=settings.MAX_IMAGE_PIXELS)
        except MessageError as exc:
            await self.send_json(Error(str(exc)).to_wire())
            return
        self.remember(frame.seq, arrived)
        message = FrameOrder(self.session_id, frame.seq, frame.image, frame.params).to_wire()
        state, worker_channel = services.session_frame(session_id=self.session_id, now=timezone.now())
        await self.forward(self.gate.offer(message, live=worker_channel is not None, now=time.monotonic()),
                           worker_channel)
        if state == "idle":
            await database_sync_to_async(services.session_wake)(session_id=self.session_id, now=timezone.now())

    async def forward(self, frame: dict[str, Any] | None, worker_channel: str | None = None) -> None:
        """Send a frame the gate let go to the session's worker, and wake up when a kept frame would
        be due (the frame in flight unanswered for 2 x FRAME_BUDGET_MS)."""
        if frame is not None and self.session_id is not None:
            worker_channel = worker_channel or services.session_frame_worker(session_id=self.session_id)
            if worker_channel is not None:
                await relay.send(worker_channel, socket_event(frame))
        if self.due_timer is not None:
            self.due_timer.cancel()
            self.due_timer = None
        deadline = self.gate.deadline()
        if deadline is not None:
            # Into this consumer's own inbox: handled in turn with everything else it does.
            self.due_timer = asyncio.get_running_loop().call_at(
                deadline, relay.deliver_local, self.channel_name, SessionFrameDue().to_event())

    async def session_frame_due(self, event: dict[str, Any]) -> None:
        """The frame in flight went unanswered too long: the newest kept frame goes anyway."""
        self.due_timer = None
        await self.forward(self.gate.due(now=time.monotonic()))

    def remember(self, seq: int, arrived: float) -> None:
        self.received[seq] = arrived
        if len(self.received) > RECEIVED_KEPT:
            for old in sorted(self.received)[:-RECEIVED_KEPT]:
                del self.received[old]

    async def disconnect(self, code: int) -> None:
        await self.leave()

    async def leave(self) -> None:
        """The session leaves the queue or frees its slot (once)."""
        if self.idle_watch is not None and self.idle_watch is not asyncio.current_task():
            self.idle_watch.cancel()
        if self.due_timer is not None:
            self.due_timer.cancel()
        if self.session_id is not None:
            session_id, self.session_id = self.session_id, None
            try:
                await database_sync_to_async(services.session_close)(session_id=session_id, now=timezone.now())
            except Exception:  # the database failed the close: the row stays open until the sweep's bound
                log.exception("could not close session %s; the sweep closes it", session_id)
                services.session_forget(session_id=session_id)
            finally:
                await sweeper_release()

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(message))

    # events from the services

    async def session_live(self, event: dict[str, Any]) -> None:
        """Live on a worker: tell the browser, send it the newest frame kept while the session
        waited, and watch for idleness from now. (Several API processes: the news may be stale.)"""
        if self.session_id is None:
            return
        live = SessionLive.parse(event)
        if live.placement is not None and not services.session_live_here(session_id=self.session_id, live=live,
                                                                          now=timezone.now()):
            return
        await self.send_json(live.message)
        await self.forward(self.gate.went_live(now=time.monotonic()), live.worker_channel)
        if self.idle_watch is None or self.idle_watch.done():
            self.idle_watch = asyncio.create_task(self.watch_idle())

    async def session_back(self, event: dict[str, Any]) -> None:
        """Several API processes: the slot was lost (its worker died or was demoted); frames wait
        until the session is live again."""
        if self.session_id is not None:
            services.session_back_here(session_id=self.session_id, placement=SessionBack.parse(event).placement)

    async def session_frame(self, event: dict[str, Any]) -> None:
        """A worker's result: shown unless a newer frame was already shown; the newest kept frame
        goes next."""
        frame = SessionFrame.parse(event)
        seq = frame.seq
        await self.forward(self.gate.answered(seq, now=time.monotonic()))
        if seq <= self.last_sent_seq:
            return
        self.last_sent_seq = seq
        arrived = self.received.pop(seq, None)
        for older in [s for s in self.received if s < seq]:
            del self.received[older]
        ms = None
        if arrived is not None:
            elapsed = time.monotonic() - arrived
            self.frame_seconds.observe(elapsed)
            ms = round(elapsed * 1000, 3)
        await self.send_json(Frame(seq, image_data_url(frame.image), ms).to_wire())

    async def session_end(self, event: dict[str, Any]) -> None:
        """An operator ended the session."""
        await self.leave()
        await self.close(code=1000)

    async def session_lost(self, event: dict[str, Any]) -> None:
        """The session's row was closed without this socket (taken for gone): the page joins again."""
        await self.leave()
        await self.close(code=close_codes.SESSION_LOST)

    async def watch_idle(self) -> None:
        """Ask the service, at each moment the session could have gone idle, whether it has."""
        while self.session_id is not None:
            wait = await database_sync_to_async(services.session_idle_check)(
                session_id=self.session_id, now=timezone.now())
            if wait is None:
                return
            await asyncio.sleep(wait)
