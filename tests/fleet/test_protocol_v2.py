"""The worker socket's v2 (a hello with "protocol": 2): the welcome says 2; every job_result and
job_failed is acknowledged once stored (job_ack), and a storage error leaves the socket open and
the result unacknowledged, for the worker to send again; a v2 hello after an API restart keeps only
the jobs it lists; a v2 worker's cancelled job counts against its depth until it lets it go."""
from __future__ import annotations

import base64
import uuid

import pytest
from channels.db import database_sync_to_async

from potocolom.runtime import runtime
from scheduling.dispatcher import DISPATCHER
from tests.helpers import api_client, eventually, job_row, job_states, submit_jobs, tiny_png
from tests.support.worker_sockets import hello_v2

pytestmark = pytest.mark.django_db(transaction=True)

PNG = tiny_png(2, 2)
PNG_B64 = base64.b64encode(PNG).decode()


@database_sync_to_async
def cancel(account, job_id: str) -> dict:
    response = api_client(account).post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 200
    return response.json()


async def held(job_id: str) -> tuple[str, str | None, int]:
    row = await job_row(job_id)
    return row["state"], row["worker_id"], row["attempts"]


def ack(job_id: str) -> dict:
    return {"type": "job_ack", "job_id": job_id}


# --- the handshake ------------------------------------------------------------------------------

async def test_a_v2_hello_gets_a_v2_welcome(v2_workers):
    worker = v2_workers()

    assert await worker.join(["tiny-a"]) == {"type": "welcome", "unknown_models": [], "heartbeat_seconds": 10.0,
                                             "frame_budget_ms": 500.0, "protocol": 2,
                                             "checkpoint_seconds": 10.0, "preview_steps": 4}


async def test_a_later_protocol_is_answered_in_v2(workers):
    worker = workers()
    await worker.connect()

    await worker.send({**hello_v2("host-a:0", ["tiny-a"]), "protocol": 3})

    assert (await worker.receive())["protocol"] == 2


async def test_a_v1_worker_never_receives_job_ack(alice, workers):
    ids = await submit_jobs(alice, 2)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)

    await worker.result(ids[0], [PNG_B64])
    await worker.failed(ids[1], "out of memory")
    await worker.result(ids[0], [PNG_B64])  # a duplicate

    assert await worker.silent(0.3)
    assert await job_states(ids) == ["succeeded", "failed"]


# --- results at least once ----------------------------------------------------------------------

async def test_a_v2_worker_gets_job_ack_for_a_result_once_it_is_stored(alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.result(job_id, [PNG_B64])

    assert await worker.receive() == ack(job_id)
    row = await job_row(job_id)
    assert row["state"] == "succeeded" and len(row["images"]) == 1


async def test_a_v2_worker_gets_job_ack_for_a_failure(alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.failed(job_id, "out of memory on rung group_offload, the lowest there is")

    assert await worker.receive() == ack(job_id)
    assert await held(job_id) == ("failed", "host-a:0", 1)


async def test_a_duplicate_or_a_job_the_worker_no_longer_holds_is_acked_and_changes_nothing(alice, v2_workers):
    ids = await submit_jobs(alice, 3)
    worker, other = v2_workers("host-a:0"), v2_workers("host-b:0")
    await worker.join(["tiny-a"])
    await worker.jobs(2)
    await other.join(["tiny-a"])
    assert [m["job_id"] for m in await other.jobs(1)] == [ids[2]]
    await worker.result(ids[0], [PNG_B64])
    assert await worker.receive() == ack(ids[0])
    stored = await job_row(ids[0])

    await worker.result(ids[0], [PNG_B64])  # sent again: the ack was lost
    await worker.failed(ids[0], "and now a failure")
    await worker.result(ids[2], [PNG_B64])  # another worker's job
    nobodys = str(uuid.uuid4())
    await worker.failed(nobodys, "no such job")

    assert [await worker.receive() for _ in range(4)] == [ack(ids[0]), ack(ids[0]), ack(ids[2]), ack(nobodys)]
    assert await job_row(ids[0]) == stored
    assert await held(ids[2]) == ("dispatched", "host-b:0", 1)
    assert await worker.silent()


async def test_a_storage_error_keeps_the_socket_open_and_the_result_unacked_until_a_resend_succeeds(
        alice, v2_workers, settings):
    settings.STORAGES = {**settings.STORAGES, "default": {"BACKEND": "tests.support.flaky_storage.FullDiskStorage",
                                                          "OPTIONS": {"failures": 1}}}
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.result(job_id, [PNG_B64, PNG_B64])

    assert await worker.silent(0.3)  # no ack, and not closed
    assert await held(job_id) == ("dispatched", "host-a:0", 1)
    await worker.send({"type": "heartbeat"})  # still open
    await worker.result(job_id, [PNG_B64, PNG_B64])  # the worker's resend, a heartbeat period later
    assert await worker.receive() == ack(job_id)
    done = await database_sync_to_async(lambda: api_client(alice).get(f"/api/v1/jobs/{job_id}/").json())()
    assert done["state"] == "succeeded" and len(done["images"]) == 2
    served = await database_sync_to_async(lambda: api_client(alice).get(done["images"][0]))()
    assert b"".join(served.streaming_content) == PNG


# --- held jobs across an API restart ------------------------------------------------------------

async def test_after_a_restart_a_v2_hello_keeps_the_jobs_it_lists_and_the_others_follow_the_dead_worker_rule(
        alice, workers, v2_workers):
    ids = await submit_jobs(alice, 2)
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)
    runtime.reset(DISPATCHER)  # the API process restarts
    await old.close()

    back = v2_workers("host-a:0")
    await back.join(["tiny-a"], jobs=[ids[0]])  # it lost the other one (say, it restarted too)

    # ids[1] went back to the queue at once (attempt 2), and the worker had room for it again
    assert [(m["job_id"], m["attempt"]) for m in await back.jobs(1)] == [(ids[1], 2)]
    assert [await held(job_id) for job_id in ids] == [("dispatched", "host-a:0", 1), ("dispatched", "host-a:0", 2)]
    assert await back.silent()


async def test_a_job_a_v2_hello_lists_that_the_api_does_not_give_that_worker_gets_cancel(alice, workers,
                                                                                        v2_workers):
    ids = await submit_jobs(alice, 3)
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)
    runtime.reset(DISPATCHER)
    await old.close()
    await cancel(alice, ids[0])  # while it was away
    stranger = str(uuid.uuid4())

    back = v2_workers("host-a:0")
    await back.join(["tiny-a"], jobs=[ids[0], ids[1], stranger])

    messages = await back.drain()
    assert sorted(m["job_id"] for m in messages if m["type"] == "cancel") == sorted([ids[0], stranger])
    # The two it must let go count against its depth (2) with the one it keeps: no new job yet.
    assert not [m for m in messages if m["type"] == "job"]
    await back.failed(ids[0], "cancelled")
    await back.failed(stranger, "cancelled")
    later = await back.drain()
    assert sorted(m["job_id"] for m in later if m["type"] == "job_ack") == sorted([ids[0], stranger])
    assert [m["job_id"] for m in later if m["type"] == "job"] == [ids[2]]
    assert await job_states(ids) == ["cancelled", "dispatched", "dispatched"]


async def test_after_a_restart_a_v1_hello_keeps_every_job(alice, workers):
    ids = await submit_jobs(alice, 3)
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)
    runtime.reset(DISPATCHER)
    await old.close()

    back = workers("host-a:0")
    await back.join(["tiny-a"])

    assert await back.silent()
    assert [await held(job_id) for job_id in ids] == [("dispatched", "host-a:0", 1)] * 2 + [("queued", None, 1)]


async def test_while_the_api_runs_a_closed_v2_socket_is_a_dead_worker(alice, v2_workers):
    ids = await submit_jobs(alice, 2)
    first = v2_workers("host-a:0")
    await first.join(["tiny-a"])
    await first.jobs(2)

    await first.close()
    assert [await held(job_id) for job_id in ids] == [("queued", None, 2)] * 2
    again = v2_workers("host-a:0")
    await again.join(["tiny-a"], jobs=ids)  # it is still denoising both

    # Not the API's to give it any more: cancel, and they count against its depth until it lets go.
    assert sorted((m["type"], m["job_id"]) for m in await again.drain()) == sorted(
        [("cancel", ids[0]), ("cancel", ids[1])])
    for job_id in ids:
        await again.failed(job_id, "cancelled")
    later = await again.drain()
    assert sorted(m["job_id"] for m in later if m["type"] == "job_ack") == sorted(ids)
    assert sorted((m["job_id"], m["attempt"]) for m in later if m["type"] == "job") == sorted(
        [(ids[0], 2), (ids[1], 2)])


# --- cancel and depth ---------------------------------------------------------------------------

async def test_a_v2_workers_cancelled_job_counts_against_its_depth_until_it_lets_it_go(alice, v2_workers):
    ids = await submit_jobs(alice, 4)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == ids[:2]

    assert (await cancel(alice, ids[0]))["state"] == "cancelled"  # the REST state, at once

    assert await worker.receive() == {"type": "cancel", "job_id": ids[0]}
    assert await worker.silent(0.3)  # still two held: nothing more is sent
    assert await job_states(ids) == ["cancelled", "dispatched", "queued", "queued"]

    await worker.failed(ids[0], "cancelled")  # let go at its next step boundary

    assert await worker.receive() == ack(ids[0])
    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[2]]
    assert await worker.silent()
    assert await held(ids[0]) == ("cancelled", "host-a:0", 1)  # the answer changed nothing


async def test_a_v2_worker_that_finishes_a_cancelled_job_anyway_frees_its_place(alice, v2_workers):
    ids = await submit_jobs(alice, 2)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == ids
    await cancel(alice, ids[1])
    assert (await worker.receive())["type"] == "cancel"
    extra, = await submit_jobs(alice, 1)
    assert await worker.silent()

    await worker.result(ids[1], [PNG_B64])  # its last step was under way

    assert await worker.receive() == ack(ids[1])
    assert [m["job_id"] for m in await worker.jobs(1)] == [extra]
    row = await job_row(ids[1])
    assert row["state"] == "cancelled" and row["images"] == []


async def test_a_v1_workers_cancelled_job_frees_its_place_at_once(alice, workers):
    ids = await submit_jobs(alice, 3)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)

    await cancel(alice, ids[0])

    assert await worker.receive() == {"type": "cancel", "job_id": ids[0]}
    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[2]]


async def test_a_v2_worker_that_dies_before_letting_go_frees_nothing_twice(alice, v2_workers):
    ids = await submit_jobs(alice, 3)
    dying = v2_workers("host-a:0")
    await dying.join(["tiny-a"])
    await dying.jobs(2)
    await cancel(alice, ids[0])
    assert (await dying.receive())["type"] == "cancel"

    await dying.close()
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])

    got = [(m["job_id"], m["attempt"]) for m in await other.jobs(2)]
    assert sorted(got) == sorted([(ids[1], 2), (ids[2], 1)])
    assert await eventually(lambda: _state_is(ids[0], "cancelled"))


async def _state_is(job_id: str, state: str) -> bool:
    return (await job_row(job_id))["state"] == state


async def test_the_answer_to_a_cancel_does_not_touch_the_jobs_next_run_on_the_same_worker(alice, v2_workers,
                                                                                        settings):
    settings.JOB_DISPATCH_DEPTH = 3
    job_id, = await submit_jobs(alice, 1)
    first = v2_workers("host-a:0")
    await first.join(["tiny-a"])
    await first.jobs(1)
    await first.close()  # dead: the job is queued again (attempt 2)

    again = v2_workers("host-a:0")
    await again.join(["tiny-a"], jobs=[job_id])  # still running the first attempt
    messages = await again.drain()
    assert sorted((m["type"], m.get("attempt")) for m in messages) == [("cancel", None), ("job", 2)]

    await again.failed(job_id, "cancelled")  # about the first run
    assert await again.receive() == ack(job_id)
    assert await held(job_id) == ("dispatched", "host-a:0", 2)
    await again.result(job_id, [PNG_B64])  # the second run's
    assert await again.receive() == ack(job_id)
    assert await held(job_id) == ("succeeded", "host-a:0", 2)
