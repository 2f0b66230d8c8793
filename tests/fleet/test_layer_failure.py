"""Worker sockets when the channel layer fails (bench/soak.md, a Redis restart): a socket whose feed
fails is lost at once, as on a close, and its periodic check stops with it, so a worker that
reconnected and heartbeats is never declared dead by the crashed connection; a Redis outage leaves
the socket open."""
from __future__ import annotations

import asyncio

import pytest
import redis
from channels.db import database_sync_to_async

from tests.helpers import eventually, job_row, job_states, submit_jobs
from tests.support.layer_faults import install_layer_fault

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def layer_fault(monkeypatch):
    return install_layer_fault(monkeypatch)


@database_sync_to_async
def worker_row(worker_id: str) -> dict:
    from workers.models import Worker

    return Worker.objects.values("connected", "channel_name").get(worker_id=worker_id)


@pytest.fixture
def declared_dead(monkeypatch) -> list[str]:
    """What the worker sockets' checks declare dead ("sent nothing for 3 heartbeat periods: dead")."""
    from fleet import consumers

    said: list[str] = []
    warning = consumers.log.warning

    def recorded(message: str, *args, **kwargs) -> None:
        if "heartbeat periods: dead" in message:
            said.append(message % args)
        warning(message, *args, **kwargs)

    monkeypatch.setattr(consumers.log, "warning", recorded)
    return said


async def heartbeat(worker, seconds: float, period: float) -> None:
    for _ in range(round(seconds / period)):
        await worker.send({"type": "heartbeat"})
        await asyncio.sleep(period)


async def test_a_worker_socket_whose_feed_fails_is_lost_at_once_and_its_check_stops(
        token, alice, workers, settings, layer_fault, declared_dead):
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    [job_id] = await submit_jobs(alice, 1)
    crashed = workers("host-a:0")
    await crashed.join(["tiny-a"])
    await crashed.jobs(1)
    old_channel = (await worker_row("host-a:0"))["channel_name"]

    layer_fault.break_(RuntimeError("the channel layer broke"), channels=[old_channel])
    with pytest.raises(RuntimeError):  # the server closes the socket with 1011
        while True:
            await crashed.receive_output(timeout=3)
    crashed._disconnected = True

    row = await job_row(job_id)  # lost as on a close: its job follows the retry rule at once
    assert (row["state"], row["attempts"], row["worker_id"]) == ("queued", 2, None)
    back = workers("host-a:0")  # the worker reconnects within a period and heartbeats
    await back.join(["tiny-a"])
    assert [m["job_id"] for m in await back.jobs(1)] == [job_id]
    await heartbeat(back, 1.6, 0.1)  # 8 periods: the crashed socket has been silent for more than 3

    assert declared_dead == []
    assert await back.silent(0.05), "the reconnected socket stays open"
    assert (await worker_row("host-a:0"))["connected"] is True
    assert await job_states([job_id]) == ["dispatched"]


async def test_a_redis_outage_leaves_a_worker_socket_open_with_its_jobs(token, alice, workers, settings,
                                                                        layer_fault, declared_dead):
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    [job_id] = await submit_jobs(alice, 1)
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    layer_fault.break_(redis.ConnectionError("Connection closed by server."))
    await eventually(lambda: _raised(layer_fault, 3))
    await heartbeat(worker, 0.6, 0.1)
    layer_fault.mend()
    await heartbeat(worker, 0.6, 0.1)

    assert await worker.silent(0.05), "still open"
    assert declared_dead == []
    assert await job_states([job_id]) == ["dispatched"]
    assert (await worker_row("host-a:0"))["connected"] is True


async def _raised(fault, count: int) -> bool:
    return len(fault.raised) >= count
