"""The open-socket counts behind ACCOUNT_SOCKET_LIMIT: in the process, and in Redis for every API
process (entries a process stops refreshing lapse: a killed process's sockets stop counting)."""
from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import redis

from potocolom.web.socket_limit import LocalSocketCounts, RedisSocketCounts, SocketSeats

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"
LEASE = 60.0


def redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def redis_counts(prefix: str) -> RedisSocketCounts:
    """One API process's counts on the shared Redis (processes of one deployment share `prefix`)."""
    return RedisSocketCounts(redis.Redis.from_url(REDIS_URL), prefix=prefix, lease_seconds=LEASE)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.skipif(
    not redis_up(), reason=f"no Redis at {REDIS_URL}"))])
def counts(request):
    return LocalSocketCounts() if request.param == "local" else redis_counts(f"test-{uuid.uuid4().hex}:")


def test_an_account_holds_at_most_the_limit_and_a_closed_socket_frees_its_place(counts):
    assert [counts.take(account="alice", socket=f"s{n}", limit=2, now=1000.0) for n in range(3)] == [
        True, True, False]
    assert counts.take(account="bob", socket="b0", limit=2, now=1000.0)
    assert counts.take(account="alice", socket="s0", limit=2, now=1001.0), "a socket already counted stays"

    counts.release(account="alice", socket="s1")

    assert counts.take(account="alice", socket="s3", limit=2, now=1002.0)
    assert not counts.take(account="alice", socket="s4", limit=2, now=1002.0)


def test_whether_anybody_listens_at_all_counts_every_accounts_sockets(counts):
    assert counts.count_all(now=1000.0) == 0
    counts.take(account="alice", socket="s0", limit=2, now=1000.0)
    counts.take(account="bob", socket="b0", limit=2, now=1000.0)
    assert not counts.take(account="alice", socket="s1", limit=1, now=1000.0)  # refused: not counted

    assert counts.count_all(now=1000.0) == 2
    counts.release(account="alice", socket="s0")
    assert counts.count_all(now=1000.0) == 1
    counts.release(account="bob", socket="b0")
    assert counts.count_all(now=1000.0) == 0


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
def test_a_killed_processs_sockets_lapse_from_everyones_count_too():
    prefix = f"test-{uuid.uuid4().hex}:"
    killed, live = redis_counts(prefix), redis_counts(prefix)
    killed.take(account="alice", socket="p1!a", limit=2, now=1000.0)
    live.take(account="bob", socket="p2!a", limit=2, now=1000.0)
    live.refresh(held=[("bob", "p2!a")], now=1000.0 + LEASE / 2)

    assert live.count_all(now=1000.0 + LEASE + 1) == 1  # alice's lapsed, bob's was refreshed


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
def test_every_api_process_counts_the_same_sockets():
    prefix = f"test-{uuid.uuid4().hex}:"
    first, second = redis_counts(prefix), redis_counts(prefix)
    assert first.take(account="alice", socket="p1!a", limit=2, now=1000.0)
    assert second.take(account="alice", socket="p2!a", limit=2, now=1000.0)

    assert not first.take(account="alice", socket="p1!b", limit=2, now=1001.0)
    assert not second.take(account="alice", socket="p2!b", limit=2, now=1001.0)
    assert redis_counts(f"test-{uuid.uuid4().hex}:").take(account="alice", socket="x", limit=2, now=1001.0), (
        "another deployment (another database) counts apart")


@pytest.mark.skipif(not redis_up(), reason=f"no Redis at {REDIS_URL}")
async def test_a_killed_processs_sockets_lapse_and_a_live_ones_are_kept():
    prefix, now = f"test-{uuid.uuid4().hex}:", [1000.0]
    killed, live = (SocketSeats(redis_counts(prefix), clock=lambda: now[0]) for _ in range(2))
    assert await killed.take(account="alice", socket="p1!a", limit=2)
    assert await live.take(account="alice", socket="p2!a", limit=2)
    now[0] = 1000.0 + LEASE - 1
    assert not await live.take(account="alice", socket="p2!b", limit=2)

    now[0] = 1000.0 + LEASE / 2
    live.refresh_now()  # the live process's pass; the killed one makes none

    now[0] = 1000.0 + LEASE + 1
    assert await live.take(account="alice", socket="p2!b", limit=2)
    assert not await live.take(account="alice", socket="p2!c", limit=2)
    for socket in ("p2!a", "p2!b"):
        await live.release(socket=socket)
    await killed.release(socket="p1!a")


async def test_seats_refuse_past_the_limit_and_release_once():
    seats = SocketSeats(LocalSocketCounts())
    assert [await seats.take(account="alice", socket=f"s{n}", limit=2) for n in range(3)] == [True, True, False]
    assert seats.task is not None, "the refresh pass runs while this process holds a socket"

    await seats.release(socket="s2")  # never counted: changes nothing
    assert not await seats.take(account="alice", socket="s3", limit=2)
    await seats.release(socket="s0")
    await seats.release(socket="s0")
    assert await seats.take(account="alice", socket="s4", limit=2)
    await seats.release(socket="s1")
    await seats.release(socket="s4")
    assert seats.task is None, "and stops with the last"


async def test_a_redis_that_is_away_lets_the_socket_stay_uncounted():
    seats = SocketSeats(RedisSocketCounts(redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1),
                                          prefix="away:"))

    assert await seats.take(account="alice", socket="s0", limit=1)
    assert seats.held == {}


async def test_an_accounts_turns_are_first_come_first_served_and_then_forgotten():
    seats, order = SocketSeats(LocalSocketCounts()), []

    async def one(n: int) -> None:
        async with seats.turn("alice"):
            await asyncio.sleep(0)  # let the others ask meanwhile
            order.append(n)

    await asyncio.gather(*(one(n) for n in range(4)))

    assert order == [0, 1, 2, 3] and seats.turns == {}
