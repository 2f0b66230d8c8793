"""Messages between API processes in one Redis round trip: each process subscribes to one Redis
pub/sub channel of its own, and a message for a consumer of another process is published there.

RedisChannelLayer takes about 8 Redis round trips a message and serves 170-275 messages/s per
process on this kind of machine (STACK-NOTES); a PUBLISH is one. The process is named in every
channel name the layer hands out (`specific.<client_prefix>!<random>`), so the sender knows where
to publish without asking anyone. Order: one process publishes on one connection from its event
loop (sync senders hand their messages to that loop), and Redis delivers one publisher's messages
to a channel in order. Like the channel layer, delivery is at most once: a message for a process
that is gone, or one published while the subscriber's connection is being re-established, is lost.
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
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        """Subscribe to this process's channel; returns once subscribed."""
        self.loop = asyncio.get_running_loop()
        self._publisher = aioredis.Redis.from_url(self.url, socket_timeout=None, socket_connect_timeout=2)
        self._reader = asyncio.create_task(self._read(), name="potocolom-bus")
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
        assert self._publisher is not None
        await self._publisher.publish(CHANNEL_PREFIX + process, json.dumps([target, message]))

    def publish_threadsafe(self, process: str, target: str, message: dict[str, Any]) -> None:
        """From a thread other than the bus's loop: publish on that loop (one connection, in order)."""
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(self.publish(process, target, message), self.loop).result(10)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._publisher is not None:
            await self._publisher.aclose()
