"""Delivery between consumers: in memory to a consumer of this process, over the bus (one Redis
PUBLISH) or the channel layer to another process's. Every consumer is a RelayConsumer with one
inbox. Why and how, order and failure: docs/design/bus.md."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings

from potocolom.runtime import Slot, runtime
from potocolom.transport.bus import Bus, frame_key, frame_seq, process_of

log = logging.getLogger(__name__)
CONTROL_MAX = 10_000  # control messages waiting in one inbox; more: the consumer is stuck and fails
CLIENT_MAX = 64  # the client socket's messages waiting in one inbox; more: its feed waits (TCP pushes back)
SERVER_ERROR = 1011  # the close code of a consumer that failed (as Daphne closes it)
OUTAGE_RETRY_FIRST = 0.5  # a channel-layer receive that Redis failed is tried again after this, doubling ...
OUTAGE_RETRY_MAX = 5.0  # ... up to this
OUTAGE_LOG_SECONDS = 10.0  # a process logs a Redis outage of the layer's receives at most this often
# Group messages are notices (wake up, cancel this): the work they announce is in the database
# already, so a Redis that is restarting must not fail the request or the consumer that sends them.
# A connection a restart broke fails once, then the pool opens a new one: so one retry.
_REDIS_ERRORS = (redis.RedisError, OSError, TimeoutError)


class InboxOverflow(RuntimeError):
    """More control messages wait for this consumer than it could ever catch up with."""


class Inbox:
    """A consumer's inbox, bounded. Control messages (states, placements, session_end, cancels)
    keep their order and are never dropped; a frame waits in one slot per session, which a later
    frame (by seq) of that session takes over in place (only the newest is kept); a `queued`
    position not yet sent is replaced by a newer one while nothing else came after it; the client
    socket's messages make their feed wait while CLIENT_MAX of them are waiting. docs/design/bus.md."""

    def __init__(self, *, control_max: int = CONTROL_MAX, client_max: int = CLIENT_MAX) -> None:
        self.control_max, self.client_max = control_max, client_max
        self._items: collections.deque[Any] = collections.deque()  # messages, and _Slot markers for frames
        self._frames: dict[Hashable, dict[str, Any]] = {}
        self._controls = 0
        self._clients = 0
        self._changed = asyncio.Event()
        self._position: _Held | None = None  # a queued position not yet sent, nothing else after it
        self.replaced = 0  # frames (and queued positions) dropped for a newer one

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, message: Any) -> None:
        """From a sender on the consumer's loop (or scheduled there from a thread)."""
        if isinstance(message, dict) and is_position(message):
            if self._position is not None:  # only the newest place is worth telling
                self._position.message = message
                self.replaced += 1
                return
            self._position = _Held(message)
            self._controls += 1
            self._items.append(self._position)
            self._changed.set()
            return
        key = frame_key(message) if isinstance(message, dict) else None
        if key is not None:
            if key in self._frames:
                self.replaced += 1
                if frame_seq(self._frames[key]) <= frame_seq(message):
                    self._frames[key] = message  # in place: the slot keeps its turn
                return
            self._frames[key] = message
            self._items.append(_Slot(key))
        elif self._controls >= self.control_max and not isinstance(message, SourceFailed):
            if self._controls == self.control_max:  # once: the consumer raises it when it gets there
                self._items.append(SourceFailed(InboxOverflow(f"over {self.control_max} messages wait")))
                self._controls += 1
            return
        else:
            self._controls += 1
            self._items.append(message)
            self._position = None  # a place told later must come after this message, not before
        self._changed.set()

    async def put_from_client(self, message: Any) -> None:
        """From the client socket's feed: waits while CLIENT_MAX of its messages wait."""
        while self._clients >= self.client_max:
            self._changed.clear()
            await self._changed.wait()
        self._clients += 1
        self._items.append(_FromClient(message))
        self._changed.set()

    async def get(self) -> Any:
        while not self._items:
            self._changed.clear()
            await self._changed.wait()
        item = self._items.popleft()
        self._changed.set()  # room, for a waiting feed
        if isinstance(item, _Slot):
            return self._frames.pop(item.key)
        if isinstance(item, _FromClient):
            self._clients -= 1
            return item.message
        self._controls -= 1
        if isinstance(item, _Held):
            if item is self._position:
                self._position = None
            return item.message
        return item


class _Held:
    """A queued position waiting in the inbox; a newer one replaces its message in place."""

    __slots__ = ("message",)

    def __init__(self, message: dict[str, Any]) -> None:
        self.message = message


def is_position(message: dict[str, Any]) -> bool:
    """A `queued` state for a browser: after a burst of queue moves (a thousand sessions leaving at
    once) only the newest is worth sending, so a waiting one is replaced rather than queued behind."""
    inner = message.get("message") if message.get("type") == "socket.send" else None
    return isinstance(inner, dict) and inner.get("type") == "state" and inner.get("state") == "queued"


class _Slot:
    __slots__ = ("key",)

    def __init__(self, key: Hashable) -> None:
        self.key = key


class _FromClient:
    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message


GROUP_TARGET = "group:"  # a bus target naming a group: every local member of it


class Relay:
    """This process's end of the relay: each local consumer's inbox (and its loop), the local
    members of each group, the process-level notice listeners, and the bus while it runs."""

    def __init__(self) -> None:
        self.inboxes: dict[str, tuple[asyncio.AbstractEventLoop, Inbox]] = {}
        self.members: dict[str, set[str]] = {}  # group -> this process's channels in it (group_membership)
        self.listeners: dict[str, Callable[[dict[str, Any]], None]] = {}  # process-level notice targets
        self.bus: Bus | None = None
        self.outage_logged = -OUTAGE_LOG_SECONDS  # time.monotonic() of the last "cannot be read" warning


RELAY = Slot("potocolom.relay", make=Relay)


def _relay() -> Relay:
    return runtime.get(RELAY)


def listen(target: str, callback: Callable[[dict[str, Any]], None]) -> None:
    """Hand every notice for `target` (from `notify_all_sync`, here or over the bus) to `callback`,
    in this process: once, whatever the number of consumers (it must not block)."""
    _relay().listeners[target] = callback


def notify_all_sync(target: str, message: dict[str, Any]) -> None:
    """From sync code: a notice for `target`'s listener in every process, this one first (one PUBLISH
    on the bus for the others; without the bus they miss it, and must not rely on it alone)."""
    callback = _relay().listeners.get(target)
    if callback is not None:
        callback(message)
    bus = _running_bus()
    if bus is not None and _in_a_thread():
        bus.broadcast_threadsafe(target, message)


def has_local_members(group: str) -> bool:
    """Whether a consumer of this process is in the group (group_membership)."""
    return bool(_relay().members.get(group))


def has_local_members_in(prefix: str) -> bool:
    """Whether a consumer of this process is in any group whose name starts with `prefix`."""
    return any(members for group, members in list(_relay().members.items()) if group.startswith(prefix))


def is_local(channel_name: str) -> bool:
    return channel_name in _relay().inboxes


def deliver_local(channel_name: str, message: dict[str, Any]) -> bool:
    """Put the message into a local consumer's inbox (every local member's, for a `group:` target);
    False when there is none here."""
    relay = _relay()
    callback = relay.listeners.get(channel_name)
    if callback is not None:
        callback(message)
        return True
    if channel_name.startswith(GROUP_TARGET):
        members = list(relay.members.get(channel_name[len(GROUP_TARGET):], ()))
        return sum(deliver_local(member, message) for member in members) > 0
    entry = relay.inboxes.get(channel_name)
    if entry is None:
        return False
    loop, inbox = entry
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        inbox.put_nowait(message)
        return True
    try:
        loop.call_soon_threadsafe(inbox.put_nowait, message)
    except RuntimeError:  # that loop is closed: the consumer is gone
        return False
    return True


def deliver_local_many(deliveries: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """deliver_local for many (channel, message) pairs at once, e.g. every queued browser's new
    place: from a thread other than the consumers' loop, one wake-up of that loop carries them all
    (one wake-up each costs a write to the loop's self-pipe per message)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, dict[str, Any]]]] = {}
    relay = _relay()
    for channel_name, message in deliveries:
        entry = relay.inboxes.get(channel_name)
        if entry is None or channel_name in relay.listeners:
            deliver_local(channel_name, message)  # a listener, a group, or not here
        elif entry[0] is running:
            entry[1].put_nowait(message)
        else:
            batches.setdefault(entry[0], []).append((entry[1], message))
    for loop, batch in batches.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: its consumers are gone
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[Any, dict[str, Any]]]) -> None:
    for inbox, message in batch:
        inbox.put_nowait(message)


# --- between processes: the bus (one PUBLISH) when Redis is there, the channel layer otherwise ---

def _running_bus() -> Bus | None:
    """This process's bus, while it runs."""
    bus = _relay().bus
    return None if bus is None or bus.loop is None or bus.loop.is_closed() else bus


def _in_a_thread() -> bool:
    """No event loop runs in this thread (a sync service's): the bus is reached thread-safely."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


def _bus_target(channel_name: str) -> tuple[Bus, str] | None:
    """The bus and the target's process, when the channel is another process's and the bus runs."""
    bus = _running_bus()
    if bus is None:
        return None
    process = process_of(channel_name)
    if process is None or process == bus.process:
        return None
    return bus, process


async def _ensure_bus(layer: Any) -> None:
    """Start this process's end of the bus (REDIS_URL, a RedisChannelLayer) on the running loop."""
    if not settings.REDIS_URL or not hasattr(layer, "client_prefix"):
        return
    relay = _relay()
    loop = asyncio.get_running_loop()
    if relay.bus is not None and relay.bus.loop is loop:
        await relay.bus.ready()  # another consumer is starting it: hand out no channel before it listens
        return
    bus = Bus(settings.REDIS_URL, layer.client_prefix, deliver_local)
    relay.bus = bus
    try:
        await bus.start()
    except Exception:  # Redis unreachable: the channel layer carries everything
        log.exception("the process bus could not start; messages between processes use the channel layer")
        if relay.bus is bus:
            relay.bus = None


async def send(channel_name: str, message: dict[str, Any]) -> None:
    """From async code: to a consumer in this process directly, to another process's consumer over
    the bus (or the channel layer)."""
    if deliver_local(channel_name, message):
        return
    target = _bus_target(channel_name)
    if target is not None and target[0].loop is asyncio.get_running_loop():
        target[0].post(target[1], channel_name, message)
        return
    layer = get_channel_layer()
    if layer is not None:
        await layer.send(channel_name, message)


def send_sync(channel_name: str, message: dict[str, Any]) -> None:
    """From sync code (a service in a worker thread): the same as `send`."""
    if deliver_local(channel_name, message):
        return
    target = _bus_target(channel_name)
    if target is not None and _in_a_thread():
        target[0].publish_threadsafe(target[1], channel_name, message)
        return
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.send)(channel_name, message)


class RelayConsumer(AsyncWebsocketConsumer):
    """A websocket consumer that also takes messages from this process's senders in memory.

    The same as channels' AsyncConsumer.__call__, with the local inbox as a third source beside the
    client socket and the channel layer. Unlike channels, a consumer that fails (a source or a
    handler raised) still runs its `disconnect` before the error goes on to the server (which
    closes the socket with 1011): its session, worker or seat is let go as on a close.
    """

    # Whether the channel-layer feed waits out a Redis outage (tried again, the socket stays open;
    # what the layer carried meanwhile is lost, at most once) instead of failing the consumer.
    layer_outage_waits = False
    disconnected = False  # its disconnect() has run (or runs now): once only
    ended = False  # its loop is over: a task it started must not act for it any more

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        self.disconnected = True
        await super().websocket_disconnect(message)

    async def failed(self, error: BaseException) -> None:
        """The consumer failed: its disconnect cleanup runs all the same (once), as on a close with
        1011; a failure of the cleanup itself is logged."""
        if self.disconnected:
            return
        self.disconnected = True
        log.warning("%s %s failed (%s: %s): cleaning up as on a close", type(self).__name__,
                    getattr(self, "channel_name", "?"), type(error).__name__, error)
        try:
            await self.disconnect(SERVER_ERROR)
        except StopConsumer:
            pass
        except Exception:
            log.exception("%s %s: the cleanup after its failure failed", type(self).__name__,
                          getattr(self, "channel_name", "?"))

    async def socket_send(self, event: dict[str, Any]) -> None:
        """A wire message from a service for this socket's client (potocolom.transport.notify)."""
        await self.send(text_data=json.dumps(event["message"]))

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its `aclose_old_connections()` before every message: that is a
        hop to the one sync thread per frame (15% of an API process relaying frames). Handlers here
        reach the database only through database_sync_to_async, which closes old connections itself."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        # One inbox for everything this consumer handles: the client socket and the channel layer
        # each feed it from a task of their own, and local senders put into it directly. (Channels'
        # await_many_dispatch waits on a fresh task per source after every message instead: an
        # asyncio.wait and a new task per frame.)
        inbox = Inbox()
        sources = [receive]
        if self.channel_layer is not None:
            self.channel_name = await self.channel_layer.new_channel()
            channel_name = self.channel_name

            async def from_layer() -> dict[str, Any]:
                return await self.channel_layer.receive(channel_name)  # type: ignore[union-attr]

            sources.append(from_layer)
        else:
            self.channel_name = f"local.{id(self)}"
        await _ensure_bus(self.channel_layer)
        relay = _relay()
        relay.inboxes[self.channel_name] = (asyncio.get_running_loop(), inbox)
        waits_out = _REDIS_ERRORS if self.layer_outage_waits else ()
        feeds = [asyncio.create_task(_feed(source, inbox, client=source is receive,
                                           waits_out=() if source is receive else waits_out))
                 for source in sources]
        self.base_send = send
        try:
            while True:
                message = await inbox.get()
                if isinstance(message, SourceFailed):
                    raise message.error
                await self.dispatch(message)
        except StopConsumer:
            pass
        except Exception as exc:
            await self.failed(exc)
            raise
        finally:
            self.ended = True
            with contextlib.suppress(KeyError):
                del relay.inboxes[self.channel_name]
            for members in relay.members.values():
                members.discard(self.channel_name)
            for feed in feeds:
                feed.cancel()
            await asyncio.gather(*feeds, return_exceptions=True)


class SourceFailed:
    """A source that raised: the consumer raises it in turn, as channels' dispatch loop would."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _feed(source: Any, inbox: Inbox, *, client: bool = False,
                waits_out: tuple[type[BaseException], ...] = ()) -> None:
    """Move what a source yields into the consumer's inbox, in order, until it fails or is cancelled
    (the client socket's feed waits while its inbox is full). An error of `waits_out` (Redis away)
    does not fail it: the source is tried again, after 0.5 s, then twice as long each time up to 5 s."""
    failures = 0
    try:
        while True:
            try:
                message = await source()
            except waits_out as exc:
                failures += 1
                relay = _relay()
                if time.monotonic() - relay.outage_logged >= OUTAGE_LOG_SECONDS:
                    relay.outage_logged = time.monotonic()
                    log.warning("the channel layer cannot be read (%s: %s); the sockets wait for Redis",
                                type(exc).__name__, exc)
                await asyncio.sleep(min(OUTAGE_RETRY_FIRST * 2 ** (failures - 1), OUTAGE_RETRY_MAX))
                continue
            failures = 0
            if client:
                await inbox.put_from_client(message)
            else:
                inbox.put_nowait(message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        inbox.put_nowait(SourceFailed(exc))


def group_send_sync(group: str, message: dict[str, Any]) -> None:
    """From sync code: to every consumer in a channel-layer group, whichever process holds it
    (retried once, then logged: never raised). With the in-memory layer, members that are this
    process's consumers (all of them, but in tests) get it straight into their inboxes, without a
    hop to the loop and back (most of a job event's cost)."""
    layer = get_channel_layer()
    if layer is None:
        return
    if isinstance(layer, InMemoryChannelLayer):
        members = list(layer.groups.get(group, {}))
        if all(member in _relay().inboxes for member in members):
            deliver_local_many((member, message) for member in members)
            return
    for attempt in (1, 2):
        try:
            async_to_sync(layer.group_send)(group, message)
            return
        except _REDIS_ERRORS as exc:
            if attempt == 2:
                log.warning("could not send %s to group %s: %s", message.get("type"), group, exc)


def group_send_others_sync(group: str, message: dict[str, Any]) -> None:
    """From sync code: to the group's members in the other processes, a notice (never raised). One
    PUBLISH on the bus when it runs (this process's own members are left out); without it, the
    channel layer's group_send (to every member, this process's too)."""
    bus = _running_bus()
    if bus is not None and _in_a_thread():
        bus.broadcast_threadsafe(GROUP_TARGET + group, message)
        return
    group_send_sync(group, message)


def group_send_everywhere_sync(group: str, message: dict[str, Any]) -> None:
    """From sync code: to every member of a group in every process, a notice (never raised): this
    process's members at once and the others' with one PUBLISH on the bus when it runs; without
    it, the channel layer's group_send (to every member)."""
    bus = _running_bus()
    if bus is not None and _in_a_thread():
        deliver_local(GROUP_TARGET + group, message)
        bus.broadcast_threadsafe(GROUP_TARGET + group, message)
        return
    group_send_sync(group, message)


async def group_membership(layer: Any, group: str, channel_name: str, *, join: bool = True) -> bool:
    """Join (or leave) a channel-layer group, retried once; False (logged) when Redis is away. The
    membership counts here at once, for notices that come over the bus."""
    members = _relay().members
    if join:
        members.setdefault(group, set()).add(channel_name)
    elif group in members:
        members[group].discard(channel_name)
    for attempt in (1, 2):
        try:
            if join:
                await layer.group_add(group, channel_name)
            else:
                await layer.group_discard(group, channel_name)
            return True
        except _REDIS_ERRORS as exc:
            if attempt == 2:
                log.warning("could not %s group %s: %s", "join" if join else "leave", group, exc)
    return False
