"""The process bus: messages between API processes in one Redis hop, RESP spoken on asyncio
protocols (publisher with CLIENT REPLY OFF, one write per loop turn; one subscription per process
plus one shared for broadcasts). Design, order and loss: docs/design/bus.md."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import Callable, Hashable
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)
CHANNEL_PREFIX = "potocolom.bus."
EVERYONE = "*"  # the process part of the channel every process subscribes to (no process is named so)
RECONNECT_SECONDS = 0.5
FRAME_UNSENT_BYTES = 4 * 1024 * 1024  # over this waiting unsent, frames wait in their slots (newest kept)
MAX_UNSENT_BYTES = 64 * 1024 * 1024  # a Redis that stopped reading for good: reconnect, not grow without end
HELD_FRAMES_MAX = 10_000  # frame slots (one per target and session) kept while Redis reads slowly


def frame_key(message: Any) -> Hashable | None:
    """The slot of a frame message (a browser frame on its way to a worker, a worker's result on its
    way to a browser): one per kind and session (per target), where only the newest waits. None for a control
    message (placements, states, session_end, cancels, jobs), which is never dropped for a frame."""
    kind = message.get("type")
    if kind == "session.frame":  # to a browser's consumer: one session there
        return ("result",)
    if kind == "socket.send":
        inner = message.get("message")
        if isinstance(inner, dict) and inner.get("type") == "frame":
            return ("frame", inner.get("session_id"))
    return None


def process_of(channel_name: str) -> str | None:
    """The process part of a RedisChannelLayer channel name (`specific.<process>!<random>`)."""
    head, bang, _ = channel_name.partition("!")
    if not bang or "." not in head:
        return None
    return head.rpartition(".")[2] or None


def frame_seq(message: dict[str, Any]) -> int:
    """A frame message's seq (-1 when it carries none): of two frames in a slot the later seq stays."""
    inner = message.get("message") if message.get("type") == "socket.send" else message
    seq = inner.get("seq") if isinstance(inner, dict) else None
    return seq if isinstance(seq, int) else -1


def _slot(target: str, message: dict[str, Any]) -> tuple[str, Hashable] | None:
    """A frame's slot on the bus: its target and its kind and session (None: a control message)."""
    key = frame_key(message)
    return None if key is None else (target, key)


# --- RESP, the part of it pub/sub needs ------------------------------------------------------------

class RespError(Exception):
    """An error reply from Redis."""


INCOMPLETE = object()


def command(*parts: str | bytes) -> bytes:
    """One command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int] | object:
    """One RESP2 value from `buf` at `pos`: (value, position after it), or INCOMPLETE. Errors are
    returned as RespError instances, bulk strings as bytes, simple strings as str."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return INCOMPLETE
    kind, line = buf[pos], bytes(buf[pos + 1:end])
    after = end + 2
    if kind == 0x2B:  # +
        return line.decode(errors="replace"), after
    if kind == 0x2D:  # -
        return RespError(line.decode(errors="replace")), after
    if kind == 0x3A:  # :
        return int(line), after
    if kind == 0x24:  # $
        size = int(line)
        if size < 0:
            return None, after
        if len(buf) < after + size + 2:
            return INCOMPLETE
        return bytes(buf[after:after + size]), after + size + 2
    if kind in (0x2A, 0x3E):  # * (array), > (push)
        count = int(line)
        items: list[Any] = []
        for _ in range(max(count, 0)):
            parsed = parse(buf, after)
            if parsed is INCOMPLETE:
                return INCOMPLETE
            items.append(parsed[0])  # type: ignore[index]
            after = parsed[1]  # type: ignore[index]
        return (items if count >= 0 else None), after
    raise ValueError(f"not RESP: {bytes(buf[pos:pos + 20])!r}")


def _auth(url: str) -> tuple[str, int, list[bytes]]:
    """Host, port and the commands that log in, from a redis:// URL."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"the process bus speaks plain redis:// only, not {parts.scheme}://")
    login: list[bytes] = []
    if parts.password is not None:
        credentials = ([unquote(parts.username)] if parts.username else []) + [unquote(parts.password)]
        login.append(command("AUTH", *credentials))
    return parts.hostname or "127.0.0.1", parts.port or 6379, login


class _Connection(asyncio.Protocol):
    """A connection to Redis that hands every reply it reads to `on_reply`."""

    def __init__(self, on_reply: Callable[[Any], None], on_drained: Callable[[], None] | None = None) -> None:
        self.on_reply, self.on_drained = on_reply, on_drained
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        """Redis read what waited unsent (down to the low-water mark): held frames may go."""
        if self.on_drained is not None:
            self.on_drained()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        pos = 0
        try:
            while pos < len(self.buffer):
                parsed = parse(self.buffer, pos)
                if parsed is INCOMPLETE:
                    break
                pos = parsed[1]  # type: ignore[index]
                self.on_reply(parsed[0])  # type: ignore[index]
        except ValueError:
            log.exception("the process bus read something that is not RESP; reconnecting")
            assert self.transport is not None
            self.transport.abort()
            return
        del self.buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class Bus:
    """This process's end of the bus, on one event loop."""

    def __init__(self, url: str, process: str, deliver: Callable[[str, dict[str, Any]], bool], *,
                 frame_unsent_bytes: int = FRAME_UNSENT_BYTES, max_unsent_bytes: int = MAX_UNSENT_BYTES) -> None:
        self.url, self.process, self.deliver = url, process, deliver
        self.frame_unsent_bytes, self.max_unsent_bytes = frame_unsent_bytes, max_unsent_bytes
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel = CHANNEL_PREFIX + process
        self.everyone = CHANNEL_PREFIX + EVERYONE
        self._publisher: asyncio.Transport | None = None
        self._subscriber: asyncio.Transport | None = None
        self._tasks: list[asyncio.Task] = []
        self._subscribed = asyncio.Event()
        # posted this turn: (process, '[target, message]', a frame's slot or None, its seq)
        self._pending: list[tuple[str, str, tuple[str, Hashable] | None, int]] = []
        # frames that found Redis reading too slowly: (process, target, slot) -> the newest pair, in order
        self._held: collections.OrderedDict[tuple[str, str, Hashable], tuple[int, str]] = collections.OrderedDict()
        self.frames_replaced = 0  # frames dropped for a newer one of their session while Redis was slow
        self._lost = 0  # messages dropped while the publisher was away (logged once per outage)

    async def start(self) -> None:
        """Connect both ends and subscribe; returns once subscribed (raises if Redis can't be reached)."""
        self.loop = asyncio.get_running_loop()
        _auth(self.url)  # a URL this bus can't speak raises here, before any task starts
        publisher_up = asyncio.Event()
        self._tasks = [asyncio.create_task(self._subscribe(), name="potocolom-bus"),
                       asyncio.create_task(self._publish(publisher_up), name="potocolom-bus-out")]
        try:
            await asyncio.wait_for(asyncio.gather(self._subscribed.wait(), publisher_up.wait()), 10)
        except BaseException:
            await self.close()
            raise

    @property
    def subscribed(self) -> bool:
        """Whether both subscriptions are in place now."""
        return self._subscribed.is_set()

    @property
    def publishing(self) -> bool:
        """Whether a connection for publishing is up now."""
        return self._publisher is not None

    @property
    def lost(self) -> int:
        """Messages dropped since the publisher was last up (at most once, like the channel layer)."""
        return self._lost

    @property
    def unsent(self) -> int:
        """Messages posted in this turn of the loop, not yet written."""
        return len(self._pending)

    def publish_on(self, transport: asyncio.Transport) -> None:
        """Write what is published to `transport` (each new connection of the publisher)."""
        self._publisher = transport

    async def ready(self) -> None:
        """Wait until the subscription is in place (at most 10 s; then the layer is used meanwhile)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), 10)

    async def _keep_connected(self, on_reply: Callable[[Any], None], hello: bytes,
                              on_connect: Callable[[asyncio.Transport], None], on_lost: Callable[[Any], None],
                              on_drained: Callable[[], None] | None = None) -> None:
        """Connect, log in and send `hello`; when the connection drops, connect again."""
        host, port, login = _auth(self.url)
        loop = asyncio.get_running_loop()
        while True:
            transport: asyncio.Transport | None = None
            try:
                transport, connection = await loop.create_connection(  # type: ignore[assignment]
                    lambda: _Connection(on_reply, on_drained), host, port)
                assert transport is not None
                transport.write(b"".join([*login, hello]))
                on_connect(transport)
                await connection.closed
                reason: Any = "the connection closed"
            except asyncio.CancelledError:
                if transport is not None:
                    transport.close()
                raise
            except OSError as exc:
                reason = exc
            on_lost(reason)
            await asyncio.sleep(RECONNECT_SECONDS)

    # the subscriber

    async def _subscribe(self) -> None:
        await self._keep_connected(self._on_reply, command("SUBSCRIBE", self.channel, self.everyone),
                                   self._subscriber_connected, self._subscriber_lost)

    def _subscriber_connected(self, transport: asyncio.Transport) -> None:
        self._subscriber = transport

    def _subscriber_lost(self, reason: Any) -> None:
        if self._subscribed.is_set():
            log.warning("the process bus lost its Redis subscription (%s); subscribing again", reason)
        self._subscribed.clear()
        self._subscriber = None

    def _on_reply(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
            self.dispatch(reply[2], broadcast=reply[1] == self.everyone.encode())
        elif isinstance(reply, list) and reply[:1] == [b"subscribe"] and reply[2:] == [2]:
            self._subscribed.set()  # both channels
        elif isinstance(reply, RespError):  # a login refused: try again later (and say so)
            log.error("Redis refused the process bus's subscription: %s", reply)
            if self._subscriber is not None:
                self._subscriber.abort()

    def dispatch(self, data: bytes, *, broadcast: bool = False) -> None:
        """Hand one payload read from our channel (or, `broadcast`, the shared one) to its targets."""
        try:
            pairs = json.loads(data)
        except ValueError:
            pairs = None
        if broadcast and isinstance(pairs, dict):  # {"from": process, "pairs": [...]}
            if pairs.get("from") == self.process:
                return  # our own broadcast: it was meant for the others
            pairs = pairs.get("pairs")
        if not isinstance(pairs, list):  # not from a bus: someone else published on our channel
            log.warning("the process bus dropped a message it could not read")
            return
        for pair in pairs:
            try:
                target, message = pair
            except (TypeError, ValueError):
                log.warning("the process bus dropped a message it could not read")
                continue
            if not self.deliver(target, message):
                log.debug("the process bus dropped a message for %s: no such consumer here", target)

    # the publisher

    async def _publish(self, up: asyncio.Event) -> None:
        def connected(transport: asyncio.Transport) -> None:
            transport.set_write_buffer_limits(high=self.frame_unsent_bytes, low=self.frame_unsent_bytes // 4)
            self.publish_on(transport)
            if self._lost:
                log.warning("the process bus publishes again; %d message(s) were lost meanwhile", self._lost)
                self._lost = 0
            up.set()

        def lost(reason: Any) -> None:
            if self._publisher is not None:
                log.warning("the process bus lost its Redis connection for publishing (%s)", reason)
            self._publisher = None

        await self._keep_connected(self._on_publisher_reply, command("CLIENT", "REPLY", "OFF"), connected, lost,
                                   self._write_held)

    @staticmethod
    def _on_publisher_reply(reply: Any) -> None:
        if isinstance(reply, RespError):  # the login (the only command that still answers) failed
            log.error("Redis refused the process bus's publisher: %s", reply)

    def post(self, process: str, target: str, message: dict[str, Any]) -> None:
        """Queue a message for another process's consumer (on the bus's loop); it goes out with the
        others posted in this turn of the loop, at its end."""
        self._enqueue(process, json.dumps([target, message]), _slot(target, message), frame_seq(message))

    def publish_threadsafe(self, process: str, target: str, message: dict[str, Any]) -> None:
        """From a thread other than the bus's loop: queued on that loop, after what is queued there."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._enqueue, process, json.dumps([target, message]), _slot(target, message),
                                       frame_seq(message))

    def broadcast_threadsafe(self, target: str, message: dict[str, Any]) -> None:
        """From a thread: to `target` in every other process (one PUBLISH on the shared channel)."""
        self.publish_threadsafe(EVERYONE, target, message)

    def _enqueue(self, process: str, pair: str, slot: tuple[str, Hashable] | None = None, seq: int = -1) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((process, pair, slot, seq))

    def _flush(self) -> None:
        """One write for everything posted this turn: one PUBLISH per process, its messages in order.
        While Redis reads too slowly (frame_unsent_bytes wait unsent), frames wait in their slots,
        newest kept, and go once it caught up; control messages are written all the same."""
        pending, self._pending = self._pending, []
        publisher = self._publisher
        if publisher is None or publisher.is_closing():
            if not self._lost:
                log.warning("the process bus cannot publish now (Redis away); messages are lost")
            self._lost += len(pending) + len(self._held)
            self._held.clear()
            return
        slow = bool(self._held) or publisher.get_write_buffer_size() > self.frame_unsent_bytes
        per_process: dict[str, list[str]] = {}
        for process, pair, slot, seq in pending:
            if slot is not None and slow:
                self._hold((process, slot[0], slot[1]), seq, pair)
            else:
                per_process.setdefault(process, []).append(pair)
        self._write(publisher, per_process)

    def _hold(self, key: tuple[str, str, Hashable], seq: int, pair: str) -> None:
        held = self._held.get(key)
        if held is not None:
            self.frames_replaced += 1
            if held[0] > seq:
                return  # a later frame of the session waits already
        self._held[key] = (seq, pair)  # in place: the slot keeps its turn
        if len(self._held) > HELD_FRAMES_MAX:
            self._held.popitem(last=False)
            self._lost += 1

    def _write_held(self) -> None:
        """Redis caught up: the held frames go, in the order their slots were taken."""
        publisher = self._publisher
        if not self._held or publisher is None or publisher.is_closing():
            return
        held, self._held = self._held, collections.OrderedDict()
        per_process: dict[str, list[str]] = {}
        for (process, *_), (_, pair) in held.items():
            per_process.setdefault(process, []).append(pair)
        self._write(publisher, per_process)

    def _write(self, publisher: asyncio.Transport, per_process: dict[str, list[str]]) -> None:
        if per_process:
            publisher.write(b"".join(command("PUBLISH", CHANNEL_PREFIX + process, self._payload(process, pairs))
                                     for process, pairs in per_process.items()))
        if publisher.get_write_buffer_size() > self.max_unsent_bytes:
            log.warning("Redis has not read the process bus's last %d bytes; reconnecting (messages are lost)",
                        publisher.get_write_buffer_size())
            publisher.abort()

    def _payload(self, process: str, pairs: list[str]) -> str:
        listed = "[" + ",".join(pairs) + "]"
        return listed if process != EVERYONE else '{"from": ' + json.dumps(self.process) + ', "pairs": ' + listed + "}"

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        self._held.clear()
        self._publisher = None
        self._subscribed.clear()
