"""A restarted API rebuilds its queue from the database: same order, same positions, and no job
that a worker already holds is dispatched again while that worker may still come back."""
from __future__ import annotations

from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from potocolom.runtime import runtime
from scheduling import services
from scheduling.dispatcher import DISPATCHER, dispatcher
from scheduling.models import Job, JobState
from scheduling.services import JobRequest, job_submit
from tests.helpers import (
    api_client,
    job_row,
    job_states,
    register_model,
    tiny_png,
)

PROMPT = {"prompt": "a red circle"}


def restart() -> None:
    """What a restarted API process has: no in-process state, only the database."""
    runtime.reset(DISPATCHER)


# --- order and positions (REST) -----------------------------------------------------------------

@pytest.mark.django_db
def test_it_rebuilds_the_queue_with_the_same_order_and_positions(alice, bob, django_capture_on_commit_callbacks):
    register_model("tiny-a")
    register_model("tiny-b", cost=2.0)
    submitted = [(alice, "tiny-a", 0), (bob, "tiny-a", 5), (alice, "tiny-b", 0), (alice, "tiny-a", 0),
                 (bob, "tiny-a", 9), (bob, "tiny-b", 3), (alice, "tiny-a", 5)]
    with django_capture_on_commit_callbacks(execute=True):
        jobs = [(account, job_submit(account=account, now=timezone.now(),
                                     request=JobRequest(params=PROMPT, model_id=model_id, priority=priority)))
                for account, model_id, priority in submitted]
    services.job_cancel(job=jobs[1][1], now=timezone.now())  # an ended job is not queued again

    def positions():
        return [api_client(account).get(f"/api/v1/jobs/{job.id}/").json()["position"] for account, job in jobs]

    before = positions()
    restart()
    after = positions()

    # tiny-a: alice's turn first (her oldest job), then bob's: a-p5, b-p9, a-p0, a-p0; tiny-b: alice, bob
    assert before == after == [3, None, 1, 4, 2, 2, 1]


@pytest.mark.django_db
def test_it_rebuilds_only_queued_jobs(alice, django_capture_on_commit_callbacks):
    register_model("tiny-a")
    with django_capture_on_commit_callbacks(execute=True):
        ids = [str(job_submit(account=alice, now=timezone.now(),
                              request=JobRequest(params=PROMPT, model_id="tiny-a")).id) for _ in range(5)]
    for job_id, state in zip(ids, [JobState.DISPATCHED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED],
                             strict=False):
        Job.objects.filter(id=job_id).update(state=state, worker_id="host-a:0")

    restart()

    queue = dispatcher().queues
    assert [job.job_id for job in queue.queued("tiny-a")] == [ids[4]]
    assert dispatcher().position(ids[4]) == 1


# --- dispatched jobs across a restart (sockets) -------------------------------------------------

@pytest.fixture
def token(transactional_db) -> str:
    from workers.services import worker_token_create

    register_model("tiny-a")
    return worker_token_create(name="hosts")


@database_sync_to_async
def submit_many(account, priorities: list[int]) -> list[str]:
    return [str(job_submit(account=account, now=timezone.now(),
                           request=JobRequest(params={"prompt": f"job {n}"}, model_id="tiny-a", priority=priority)).id)
            for n, priority in enumerate(priorities)]


sweep = database_sync_to_async(services.orphans_sweep)


async def held_by(job_ids: list[str]) -> list[tuple[str, str | None, int]]:
    rows = [await job_row(job_id) for job_id in job_ids]
    return [(row["state"], row["worker_id"], row["attempts"]) for row in rows]


@pytest.mark.django_db(transaction=True)
async def test_it_dispatches_in_the_same_order_after_a_restart(alice, workers):
    ids = await submit_many(alice, [0, 5, 0, 9, 5])

    restart()
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])

    order = [m["job_id"] for m in await worker.jobs(2)]
    for job_id in order:
        await worker.result(job_id, [_png()])
        order += [m["job_id"] for m in await worker.jobs(1)]
        if len(order) == 5:
            break
    assert order == [ids[3], ids[1], ids[4], ids[0], ids[2]]


@pytest.mark.django_db(transaction=True)
async def test_accounts_take_turns_through_a_worker(alice, bob, carol, workers):
    """The contract's example through a worker socket: a1..a6 then b1, b2; the worker takes a1 and
    b1; carol's c1 joins the round after them."""
    alices = await submit_many(alice, [0] * 6)
    bobs = await submit_many(bob, [0, 0])
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    order = [m["job_id"] for m in await worker.jobs(2)]
    assert order == [alices[0], bobs[0]]
    carols = await submit_many(carol, [0])
    assert await position(carol, carols[0]) == 3

    for finished in range(7):  # each result lets the next job through
        await worker.result(order[finished], [_png()])
        order += [m["job_id"] for m in await worker.jobs(1)]
    assert order[2:] == [alices[1], bobs[1], carols[0], *alices[2:]]


@pytest.mark.django_db(transaction=True)
async def test_an_accounts_turn_survives_a_restart(alice, bob, workers):
    """alice was served before bob even submitted, so her next job goes before his: she has gone
    longest without a dispatch. The turn comes back from the database after a restart."""
    first_two = await submit_many(alice, [0, 0])
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == first_two
    (bobs,) = await submit_many(bob, [0])
    (third,) = await submit_many(alice, [0])
    assert (await position(alice, third), await position(bob, bobs)) == (1, 2)

    restart()
    await worker.close()  # the old process's socket is gone with it
    assert (await position(alice, third), await position(bob, bobs)) == (1, 2)
    back = workers("host-a:0")
    await back.join(["tiny-a"])  # it still holds alice's two
    await back.result(first_two[0], [_png()])
    assert [m["job_id"] for m in await back.jobs(1)] == [third]


@database_sync_to_async
def position(account, job_id: str) -> int | None:
    return api_client(account).get(f"/api/v1/jobs/{job_id}/").json()["position"]


def _png() -> str:
    import base64

    return base64.b64encode(tiny_png()).decode()


@pytest.mark.django_db(transaction=True)
async def test_it_does_not_redispatch_held_jobs_while_their_worker_may_reconnect(alice, workers):
    ids = await submit_many(alice, [0, 0, 0, 0])
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    assert [m["job_id"] for m in await old.jobs(2)] == ids[:2]

    restart()
    await old.close()  # the old process's socket is gone with it
    assert await held_by(ids[:2]) == [("dispatched", "host-a:0", 1)] * 2

    newcomer = workers("host-b:0")
    await newcomer.join(["tiny-a"])
    assert [m["job_id"] for m in await newcomer.jobs(2)] == ids[2:]
    assert await newcomer.silent()

    # 39 s on, within 4 heartbeat periods: a sweep at that moment leaves its jobs with it
    await sweep(now=timezone.now() + timedelta(seconds=39))
    assert await held_by(ids[:2]) == [("dispatched", "host-a:0", 1)] * 2
    back = workers("host-a:0")  # the same worker_id on a new connection
    await back.join(["tiny-a"])

    assert await back.silent()  # it still holds two: no room, and nothing sent twice
    assert await held_by(ids[:2]) == [("dispatched", "host-a:0", 1)] * 2
    await back.result(ids[0], [_png()])
    extra = await submit_many(alice, [0])
    assert [m["job_id"] for m in await back.jobs(1)] == extra
    assert await job_states(ids[:2]) == ["succeeded", "dispatched"]


@pytest.mark.django_db(transaction=True)
async def test_it_requeues_held_jobs_whose_worker_does_not_come_back_in_time(alice, workers, settings):
    ids = await submit_many(alice, [0, 0, 0])
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)
    restart()
    await old.close()
    newcomer = workers("host-b:0")
    await newcomer.join(["tiny-a"])
    assert [m["job_id"] for m in await newcomer.jobs(1)] == [ids[2]]

    # past 4 heartbeat periods, the sweep (every heartbeat period, and at every hello) sends them back
    await sweep(now=timezone.now() + timedelta(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS + 1))

    assert [(m["job_id"], m["attempt"]) for m in await newcomer.jobs(1)] == [(ids[0], 2)]
    assert await held_by(ids) == [("dispatched", "host-b:0", 2), ("queued", None, 2), ("dispatched", "host-b:0", 1)]
    late = workers("host-a:0")
    await late.join(["tiny-a"])
    assert [(m["job_id"], m["attempt"]) for m in await late.jobs(1)] == [(ids[1], 2)]


@pytest.mark.django_db(transaction=True)
async def test_it_tells_a_returning_worker_about_a_job_cancelled_while_it_was_away(alice, workers):
    ids = await submit_many(alice, [0, 0])
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)
    restart()
    await old.close()

    cancelled = await database_sync_to_async(lambda: api_client(alice).post(f"/api/v1/jobs/{ids[0]}/cancel/"))()
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    waiting = await submit_many(alice, [0])
    back = workers("host-a:0")  # it is still denoising both jobs it held
    await back.join(["tiny-a"])

    messages = await back.drain()
    assert {"type": "cancel", "job_id": ids[0]} in messages, messages
    assert [m["job_id"] for m in messages if m["type"] == "job"] == waiting
