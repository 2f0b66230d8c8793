"""Pausing jobs that workers hold, and what a worker's step-boundary answers do (sockets): a v2
worker gets `preempt` and its `job_preempted` (the service the worker socket calls) pauses the job
with its checkpoint stored; a v1 worker gets `cancel` and the job is paused at once; an unasked
`job_preempted` (a drain) queues the job again at its old place; checkpoints are replaced, and
deleted when the job ends."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async
from django.core.files.storage import default_storage
from django.utils import timezone

from potocolom.runtime import runtime
from scheduling import services
from scheduling.checkpoints import checkpoint_read
from scheduling.dispatcher import DISPATCHER
from tests.helpers import api_client, eventually, job_row, job_states, register_model, submit_jobs, tiny_png
from tests.support.worker_sockets import V2Worker

pytestmark = pytest.mark.django_db(transaction=True)

PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()


@pytest.fixture
def token(transactional_db) -> str:
    """A worker token, and the model tiny-a registered."""
    from workers.services import worker_token_create

    register_model("tiny-a")
    return worker_token_create(name="hosts")


@pytest.fixture
async def v2_workers(token):
    """Factory of workers whose hello says `"protocol": 2`; every one still open is closed at the end."""
    from tests.helpers import close_sync_thread_connections

    made: list[V2Worker] = []

    def make(worker_id: str = "host-a:0") -> V2Worker:
        made.append(V2Worker(token, worker_id))
        return made[-1]

    yield make
    for worker in made:
        await worker.close()
    await close_sync_thread_connections()


@database_sync_to_async
def post(account, job_id: str, verb: str) -> dict:
    response = api_client(account).post(f"/api/v1/jobs/{job_id}/{verb}/")
    assert response.status_code == 200, response.content
    return response.json()


@database_sync_to_async
def shown(account, job_id: str) -> dict:
    return api_client(account).get(f"/api/v1/jobs/{job_id}/").json()


@database_sync_to_async
def preempted(job_id: str, step: int, steps: int, checkpoint: bytes | None, worker_id: str = "host-a:0") -> bool:
    """What the worker socket does with a `job_preempted` (its checkpoint decoded)."""
    return services.job_preempted(worker_id=worker_id, job_id=job_id, step=step, steps=steps, checkpoint=checkpoint,
                                  now=timezone.now())


@database_sync_to_async
def checkpointed(job_id: str, step: int, checkpoint: bytes, worker_id: str = "host-a:0") -> bool:
    """What the worker socket does with a `job_checkpoint`."""
    return services.job_checkpoint(worker_id=worker_id, job_id=job_id, step=step, steps=10, checkpoint=checkpoint,
                                   now=timezone.now())


stored = database_sync_to_async(checkpoint_read)
exists = database_sync_to_async(default_storage.exists)


# --- queued jobs and a worker -------------------------------------------------------------------

async def test_a_worker_gets_the_next_job_instead_of_a_paused_one_and_the_resumed_one_at_its_old_place(alice,
                                                                                                    workers):
    ids = await submit_jobs(alice, 4)
    await post(alice, ids[0], "pause")
    worker = workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == ids[1:3]

    assert (await post(alice, ids[0], "resume"))["position"] == 1  # ahead of ids[3], submitted after it
    await worker.result(ids[1], [PNG_B64])

    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[0]]
    assert await job_states(ids) == ["dispatched", "succeeded", "dispatched", "queued"]


# --- a v2 worker: preempt, then job_preempted ---------------------------------------------------

async def test_pausing_a_job_a_v2_worker_holds_preempts_it_and_its_answer_pauses_it_with_its_checkpoint(
        alice, v2_workers):
    ids = await submit_jobs(alice, 3)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == ids[:2]
    await worker.started(ids[0])
    assert await eventually(lambda: _state_is(ids[0], "running"))

    answer = await post(alice, ids[0], "pause")

    assert answer["state"] == "running"  # paused once the worker stops it
    assert await worker.receive() == {"type": "preempt", "job_id": ids[0]}
    assert await worker.silent()  # still held: it counts against the worker's depth

    assert await preempted(ids[0], 4, 10, b"latents after step 4") is True

    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[2]]  # its place went to the next job
    job = await shown(alice, ids[0])
    assert (job["state"], job["position"], job["worker_id"]) == ("paused", None, None)
    assert (job["checkpoint_step"], job["preemptions"], job["attempts"]) == (4, 1, 1)
    assert await stored((await job_row(ids[0]))["checkpoint"]) == b"latents after step 4"

    assert (await post(alice, ids[0], "resume"))["state"] == "queued"


async def test_an_unasked_job_preempted_queues_the_job_again_at_its_old_place_from_its_checkpoint(
        alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    ids = await submit_jobs(alice, 2)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(1)] == ids[:1]

    await preempted(ids[0], 6, 10, b"step 6")  # e.g. the worker is draining

    again, = await worker.jobs(1)  # back at its place, ahead of ids[1]: this worker has room again
    assert (again["job_id"], again["attempt"]) == (ids[0], 1)
    row = await job_row(ids[0])
    assert (row["preemptions"], row["checkpoint_step"], row["attempts"]) == (1, 6, 1)


async def test_a_null_checkpoint_keeps_the_one_stored_before(alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await preempted(job_id, 6, 10, b"step 6")
    await worker.jobs(1)  # resumed from step 6 on the same worker

    await preempted(job_id, 0, 10, None)  # preempted again before its step 7 began

    row = await job_row(job_id)
    assert (row["preemptions"], row["checkpoint_step"]) == (2, 6)
    assert await stored(row["checkpoint"]) == b"step 6"


async def test_a_newer_checkpoint_replaces_the_stored_one_and_the_jobs_end_deletes_it(alice, v2_workers):
    ids = await submit_jobs(alice, 2)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)
    names = []
    for step in (2, 5):
        assert await checkpointed(ids[0], step, f"step {step}".encode()) is True
        names.append((await job_row(ids[0]))["checkpoint"])
    assert [await exists(name) for name in names] == [False, True]
    assert (await shown(alice, ids[0]))["checkpoint_step"] == 5
    await checkpointed(ids[1], 1, b"step 1")
    last = (await job_row(ids[1]))["checkpoint"]

    await worker.result(ids[0], [PNG_B64])
    await worker.failed(ids[1], "out of memory")

    assert [(await worker.receive())["type"] for _ in range(2)] == ["job_ack", "job_ack"]
    assert await job_states(ids) == ["succeeded", "failed"]
    for job_id, name in [(ids[0], names[1]), (ids[1], last)]:
        row = await job_row(job_id)
        assert (row["checkpoint"], row["checkpoint_step"]) == ("", None)
        assert not await exists(name)


async def test_the_answer_to_a_preempt_for_a_job_cancelled_meanwhile_keeps_nothing_and_frees_the_place(
        alice, v2_workers):
    ids = await submit_jobs(alice, 3)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)
    await post(alice, ids[0], "pause")
    assert (await worker.receive())["type"] == "preempt"
    await post(alice, ids[0], "cancel")
    assert (await worker.receive())["type"] == "cancel"

    assert await preempted(ids[0], 4, 10, b"step 4") is False

    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[2]]
    row = await job_row(ids[0])
    assert (row["state"], row["checkpoint"], row["preemptions"]) == ("cancelled", "", 0)
    assert not await exists(f"jobs/{ids[0]}/checkpoint-4.bin")


async def test_a_job_whose_worker_dies_while_it_is_being_paused_is_paused_not_queued(alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    dying = v2_workers("host-a:0")
    await dying.join(["tiny-a"])
    await dying.jobs(1)
    await post(alice, job_id, "pause")
    assert (await dying.receive())["type"] == "preempt"

    await dying.close()

    assert await eventually(lambda: _state_is(job_id, "paused"))
    assert (await job_row(job_id))["attempts"] == 2  # a death is still an attempt
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])
    assert await other.silent()


async def test_a_worker_back_after_an_api_restart_still_holding_a_job_being_paused_gets_preempt_again(
        alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    old = v2_workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(1)
    await post(alice, job_id, "pause")
    assert (await old.receive())["type"] == "preempt"
    runtime.reset(DISPATCHER)  # the API process restarts before the worker's answer arrives
    await old.close()

    back = v2_workers("host-a:0")
    await back.join(["tiny-a"], jobs=[job_id])

    assert await back.receive() == {"type": "preempt", "job_id": job_id}
    assert await preempted(job_id, 2, 10, b"step 2") is True
    assert (await job_row(job_id))["state"] == "paused"


async def _state_is(job_id: str, state: str) -> bool:
    return (await job_row(job_id))["state"] == state


# --- a v1 worker: cancel, paused at once --------------------------------------------------------

async def test_pausing_a_job_a_v1_worker_holds_cancels_it_there_and_pauses_it_at_once(alice, workers):
    ids = await submit_jobs(alice, 3)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)

    answer = await post(alice, ids[0], "pause")

    assert (answer["state"], answer["worker_id"], answer["preemptions"], answer["checkpoint_step"]) == (
        "paused", None, 1, None)
    assert await worker.receive() == {"type": "cancel", "job_id": ids[0]}
    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[2]]  # a v1 worker's place frees at once

    await worker.result(ids[0], [PNG_B64])  # it had finished before the cancel arrived: changes nothing
    assert await worker.silent()
    assert (await job_row(ids[0]))["state"] == "paused"


# --- a pause asked on another API process -------------------------------------------------------

async def test_a_pause_relayed_from_another_process_preempts_the_job_on_this_one(alice, v2_workers):
    from scheduling.models import Job

    ids = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    # what job_pause wrote on the other process, before its worker.preempt event reached this one
    await database_sync_to_async(Job.objects.filter(id=ids[0]).update)(pause_requested=True)

    await database_sync_to_async(services.job_preempt_held)(worker_id="host-a:0", job_id=ids[0], now=timezone.now())

    assert await worker.receive() == {"type": "preempt", "job_id": ids[0]}
    assert await preempted(ids[0], 0, 10, None) is True
    assert (await shown(alice, ids[0]))["state"] == "paused"


async def test_a_relayed_pause_for_a_job_no_longer_being_paused_or_a_bad_id_changes_nothing(alice, v2_workers):
    ids = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    for job_id in (ids[0], "not-a-job"):
        await database_sync_to_async(services.job_preempt_held)(worker_id="host-a:0", job_id=job_id,
                                                                now=timezone.now())

    assert await worker.silent()
    assert (await shown(alice, ids[0]))["state"] == "dispatched"
