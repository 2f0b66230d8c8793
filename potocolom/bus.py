"""Messages between API processes in one Redis round trip: each process subscribes to one Redis
pub/sub channel of its own, and a message for a consumer of another process is published there.

RedisChannelLayer takes about 8 Redis round trips a message and serves 170-275 messages/s per
process on this kind of machine (STACK-NOTES); a PUBLISH is one. The process is named in every
channel name the layer hands out (`specific.<client_prefix>!<random>`), so the sender knows where
to publish without asking anyone.

Order: a process publishes on one connection from its event loop, through one queue that sync
senders also feed, and Redis delivers one publisher's messages to a channel in order; what queues
up during one round trip goes out in the next pipeline. Like the channel layer, delivery is at most
once: a message for a process that is gone, or one published while the subscriber's connection is
being re-established, is lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)
CHANNEL_PREFIX = "potocolom.bus."
RECONNECT_SECONDS = 0.5


def process_of(channel_name: str) -> str | None:
    """The process part of a RedisChannelLayer channel name (`specific.<process>!<random>`)."""
    head, bang, _ = channel_name.partition("!")
    if not bang or "." not in head:
        return None
    return head.rpartition(".")[2] or None


class Bus:
    """This process's end of the bus, on one event loop."""

    def __init__(self, url: str, process: str, deliver: Callable[[str, dict[str, Any]], bool]) -> None:
        self.url, self.process, self.deliver = url, process, deliver
        self.loop: asyncio.AbstractEventLoop | None = None
        self._publisher: aioredis.Redis | None = None
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        """Subscribe to this process's channel; returns once subscribed."""
        self.loop = asyncio.get_running_loop()
        self._publisher = aioredis.Redis.from_url(self.url, socket_timeout=None, socket_connect_timeout=2)
        self._reader = asyncio.create_task(self._read(), name="potocolom-bus")
        self._writer = asyncio.create_task(self._write(), name="potocolom-bus-out")
        await asyncio.wait_for(self._subscribed.wait(), 10)

    async def ready(self) -> None:
        """Wait until the subscription is in place (at most 10 s; then the layer is used meanwhile)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), 10)

    async def _read(self) -> None:
        channel = CHANNEL_PREFIX + self.process
        while True:
            client = aioredis.Redis.from_url(self.url, socket_timeout=None, socket_connect_timeout=2)
            try:
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(channel)
                    self._subscribed.set()
                    async for item in pubsub.listen():
                        if item.get("type") == "message":
                            self._dispatch(item["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarted: subscribe again (what was published meanwhile is lost)
                log.warning("the process bus lost its Redis subscription (%s); subscribing again", exc)
                await asyncio.sleep(RECONNECT_SECONDS)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()

    def _dispatch(self, data: bytes) -> None:
        try:
            target, message = json.loads(data)
        except (ValueError, TypeError):
            log.warning("the process bus dropped a message it could not read")
            return
        if not self.deliver(target, message):
            log.debug("the process bus dropped a message for %s: no such consumer here", target)

    async def publish(self, process: str, target: str, message: dict[str, Any]) -> None:
        """Queue a message for another process; the writer sends what is queued in one pipeline."""
        self._outbox.put_nowait((CHANNEL_PREFIX + process, json.dumps([target, message])))

    def publish_threadsafe(self, process: str, target: str, message: dict[str, Any]) -> None:
        """From a thread other than the bus's loop: queued on that loop, after what is queued there."""
        assert self.loop is not None
        item = (CHANNEL_PREFIX + process, json.dumps([target, message]))
        self.loop.call_soon_threadsafe(self._outbox.put_nowait, item)

    async def _write(self) -> None:
        """Send queued messages in order: whatever queued up during one round trip goes in the next."""
        assert self._publisher is not None
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            try:
                async with self._publisher.pipeline(transaction=False) as pipe:
                    for channel, payload in batch:
                        pipe.publish(channel, payload)
                    await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: these messages are lost, as on the channel layer
                log.warning("the process bus could not publish %d message(s): %s", len(batch), exc)

    async def close(self) -> None:
        for task in (self._reader, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._publisher is not None:
            await self._publisher.aclose()
