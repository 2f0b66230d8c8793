"""The dead-worker sweep runs once per API process, whatever is connected to it: jobs held by a
worker that no process hears any more (its process died, or this one restarted and it did not come
back) follow the dead-worker rule, with no socket open here. Time is injected."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from fleet.lifecycle import dead_workers_sweep
from fleet.sweeper import DeadWorkerSweeper
from potocolom.runtime import runtime
from scheduling.dispatcher import DISPATCHER
from tests.helpers import eventually, job_row, submit_jobs

pytestmark = pytest.mark.django_db(transaction=True)


async def held(job_id: str) -> tuple[str, str | None, int]:
    row = await job_row(job_id)
    return row["state"], row["worker_id"], row["attempts"]


@database_sync_to_async
def connected(worker_id: str) -> bool:
    from workers.models import Worker

    return Worker.objects.get(worker_id=worker_id).connected


async def a_worker_whose_process_died(workers, account) -> list[str]:
    """Jobs held by a worker of an API process that is gone: the database says the worker holds
    them; this process has never had its socket (a restarted dispatcher: nothing in memory)."""
    ids = await submit_jobs(account, 3)
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    await worker.jobs(2)
    runtime.reset(DISPATCHER)
    await worker.close()  # the socket went with that process: this one never heard it close
    return ids


@pytest.fixture
def sweeper():
    """A sweeper on its own thread, stopped at the end of the test."""
    made: list[DeadWorkerSweeper] = []

    def make(**options) -> DeadWorkerSweeper:
        made.append(DeadWorkerSweeper(**options))
        return made[-1]

    yield make
    for each in made:
        each.stop()


def later(seconds: float):
    """A clock that reads `seconds` ahead of the real one."""
    return lambda: timezone.now() + timedelta(seconds=seconds)


async def test_the_sweep_sends_back_the_jobs_of_a_worker_no_process_hears_with_nothing_connected(
        alice, workers, sweeper, settings):
    ids = await a_worker_whose_process_died(workers, alice)

    running = sweeper(period=lambda: 0.05, clock=later(4 * settings.WORKER_HEARTBEAT_SECONDS + 1))
    assert running.start()

    async def swept():  # the sweep sends the jobs back, then its row stops reading as connected
        return ([await held(job_id) for job_id in ids[:2]] == [("queued", None, 2)] * 2
                and await connected("host-a:0") is False)
    assert await eventually(swept, timeout=30)  # a thread of its own: slow on a loaded machine
    assert await held(ids[2]) == ("queued", None, 1)


async def test_within_four_heartbeat_periods_the_sweep_leaves_the_jobs_with_their_worker(
        alice, workers, settings):
    ids = await a_worker_whose_process_died(workers, alice)

    await database_sync_to_async(dead_workers_sweep)(
        now=timezone.now() + timedelta(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS - 2))

    assert [await held(job_id) for job_id in ids[:2]] == [("dispatched", "host-a:0", 1)] * 2
    back = workers("host-a:0")  # it comes back in time: it keeps them
    await back.join(["tiny-a"])
    assert await back.silent()
    await database_sync_to_async(dead_workers_sweep)(
        now=timezone.now() + timedelta(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS + 1))
    assert [await held(job_id) for job_id in ids[:2]] == [("dispatched", "host-a:0", 1)] * 2


async def test_a_sweep_that_fails_is_logged_and_the_next_one_runs(sweeper, caplog):
    calls: list[datetime] = []
    twice = threading.Event()

    def sweep(*, now: datetime) -> None:
        calls.append(now)
        if len(calls) == 1:
            raise ConnectionError("the database is away")
        twice.set()

    running = sweeper(period=lambda: 0.01, sweep=sweep)
    running.start()

    assert await database_sync_to_async(twice.wait)(5)
    assert "the dead-worker sweep failed" in caplog.text


def test_it_starts_once(sweeper):
    running = sweeper(period=lambda: 60.0)

    assert running.start() is True
    assert running.start() is False
    running.stop()
    assert not running.thread.is_alive()
