"""potocolom.bus against the real Redis: a message published for another process reaches the
consumer named in it, in order; process names come from the channel layer's channel names."""
from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest

from potocolom.bus import Bus, process_of

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"


@pytest.mark.parametrize(("channel", "process"), [
    ("specific.0123abcd!f00", "0123abcd"),
    ("specific.abc!", "abc"),
    ("prefix.specific.abc!x", "abc"),
    ("local.1234", None),
    ("specific!x", None),
    ("", None),
])
def test_it_reads_the_process_out_of_a_channel_name(channel, process):
    assert process_of(channel) == process


def redis_up() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
async def test_a_message_reaches_the_consumer_of_the_other_process_in_order():
    got: list[tuple[str, dict[str, Any]]] = []
    done = asyncio.Event()

    def deliver(target: str, message: dict[str, Any]) -> bool:
        got.append((target, message))
        if len(got) == 200:
            done.set()
        return target.startswith("specific.b")

    a = Bus(REDIS_URL, f"a{uuid.uuid4().hex}", lambda target, message: False)
    b_process = f"b{uuid.uuid4().hex}"
    b = Bus(REDIS_URL, b_process, deliver)
    await a.start()
    await b.start()
    try:
        target = f"specific.{b_process}!consumer"
        for n in range(150):
            await a.publish(b_process, target, {"type": "session.frame", "seq": n, "image": "x" * 100})
        for n in range(150, 200):  # from a thread (a sync service): on the bus's loop, after the others
            await asyncio.to_thread(a.publish_threadsafe, b_process, target, {"type": "session.frame", "seq": n})
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await a.close()
        await b.close()
    assert [message["seq"] for _, message in got] == list(range(200))
    assert {target for target, _ in got} == {target}
