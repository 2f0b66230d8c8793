"""Step-boundary scheduling on the worker socket, from the API's side: a v2 worker's `job_preempted`
(acknowledged like a result) queues the job again at its old place with its checkpoint stored, and
the next `job` carries `resume`; `job_checkpoint` replaces the stored checkpoint, and a dead
worker's job resumes from it on its retry; a v2 `job` carries priority and an opaque account key, a
v1 worker's `job` and `welcome` stay v1; bad messages change nothing and leave the socket open."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async
from django.core.files.storage import default_storage

from potocolom.protocol.worker import MAX_CHECKPOINT_CHARS
from scheduling.checkpoints import checkpoint_read
from tests.helpers import eventually, job_row, job_states, submit_jobs, tiny_png

pytestmark = pytest.mark.django_db(transaction=True)

PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()
V1_JOB_FIELDS = {"type", "job_id", "attempt", "model_id", "params"}

stored = database_sync_to_async(checkpoint_read)
exists = database_sync_to_async(default_storage.exists)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def preempted(job_id: str, step: int, steps: int, checkpoint: bytes | None) -> dict:
    return {"type": "job_preempted", "job_id": job_id, "step": step, "steps": steps,
            "checkpoint": None if checkpoint is None else b64(checkpoint)}


def checkpointed(job_id: str, step: int, steps: int, checkpoint: bytes) -> dict:
    return {"type": "job_checkpoint", "job_id": job_id, "step": step, "steps": steps, "checkpoint": b64(checkpoint)}


async def checkpoint_of(job_id: str) -> tuple[int | None, bytes | None]:
    row = await job_row(job_id)
    return row["checkpoint_step"], await stored(row["checkpoint"])


# --- job_preempted ------------------------------------------------------------------------------

async def test_a_job_preempted_is_acknowledged_and_the_job_comes_back_at_its_old_place_with_resume(
        alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    ids = await submit_jobs(alice, 2)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    first, = await worker.jobs(1)
    assert "resume" not in first
    await worker.started(ids[0])

    await worker.send(preempted(ids[0], 6, 10, b"latents after step 6"))

    assert await worker.receive() == {"type": "job_ack", "job_id": ids[0]}
    again, = await worker.jobs(1)  # its old place is ahead of ids[1]
    assert (again["job_id"], again["attempt"], again["params"]) == (ids[0], 1, first["params"])
    assert again["resume"] == {"step": 6, "checkpoint": b64(b"latents after step 6")}
    assert await checkpoint_of(ids[0]) == (6, b"latents after step 6")
    row = await job_row(ids[0])
    assert (row["state"], row["preemptions"], row["attempts"]) == ("dispatched", 1, 1)
    assert await job_states(ids) == ["dispatched", "queued"]


async def test_a_job_preempted_before_it_started_keeps_no_checkpoint_and_comes_back_without_resume(
        alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.send(preempted(job_id, 0, 10, None))

    assert (await worker.receive())["type"] == "job_ack"
    again, = await worker.jobs(1)
    assert again["job_id"] == job_id and "resume" not in again
    assert await checkpoint_of(job_id) == (None, None)


async def test_a_duplicate_job_preempted_is_acknowledged_and_changes_nothing(alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    ids = await submit_jobs(alice, 2)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])
    await other.jobs(1)
    await worker.send(preempted(ids[0], 3, 10, b"step 3"))
    assert (await worker.receive())["type"] == "job_ack"
    await worker.jobs(1)  # back on this worker, whose place it freed

    await other.send(preempted(ids[0], 5, 10, b"not the holder's"))  # another worker's job

    assert await other.receive() == {"type": "job_ack", "job_id": ids[0]}
    assert await worker.silent()
    row = await job_row(ids[0])
    assert (row["state"], row["worker_id"], row["preemptions"]) == ("dispatched", "host-a:0", 1)
    assert await checkpoint_of(ids[0]) == (3, b"step 3")


# --- job_checkpoint -----------------------------------------------------------------------------

async def test_a_job_checkpoint_is_stored_and_the_next_one_replaces_it(alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await worker.started(job_id)

    await worker.send(checkpointed(job_id, 4, 20, b"step 4"))
    assert await eventually(lambda: _checkpoint_is(job_id, 4))
    first = (await job_row(job_id))["checkpoint"]
    await worker.send(checkpointed(job_id, 9, 20, b"step 9"))
    assert await eventually(lambda: _checkpoint_is(job_id, 9))

    assert await checkpoint_of(job_id) == (9, b"step 9")
    assert not await exists(first)
    assert await worker.silent()  # a checkpoint is not acknowledged: the next one supersedes it
    assert (await job_row(job_id))["state"] == "running"


async def test_a_dead_workers_job_resumes_from_its_latest_checkpoint_on_its_retry(alice, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    dying = v2_workers("host-a:0")
    await dying.join(["tiny-a"])
    await dying.jobs(1)
    await dying.send(checkpointed(job_id, 7, 20, b"step 7"))
    assert await eventually(lambda: _checkpoint_is(job_id, 7))

    await dying.close()
    assert await eventually(lambda: _state_is(job_id, "queued"))
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])

    retry, = await other.jobs(1)
    assert (retry["job_id"], retry["attempt"]) == (job_id, 2)
    assert retry["resume"] == {"step": 7, "checkpoint": b64(b"step 7")}


async def test_a_checkpoint_whose_file_is_gone_gives_a_job_without_resume(alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await worker.send(checkpointed(job_id, 2, 20, b"step 2"))
    assert await eventually(lambda: _checkpoint_is(job_id, 2))
    await database_sync_to_async(default_storage.delete)((await job_row(job_id))["checkpoint"])

    await worker.send(preempted(job_id, 0, 20, None))

    assert (await worker.receive())["type"] == "job_ack"
    again, = await worker.jobs(1)
    assert again["job_id"] == job_id and "resume" not in again  # it restarts from step 0, it does not fail


# --- what a job order carries -------------------------------------------------------------------

async def test_a_v2_job_carries_its_priority_and_an_account_key_that_is_the_same_for_one_account_only(
        alice, bob, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 4
    alices = await submit_jobs(alice, 2, priority=3)
    bobs = await submit_jobs(bob, 1, priority=7)
    worker = v2_workers()
    await worker.join(["tiny-a"])

    orders = {m["job_id"]: m for m in await worker.jobs(3)}

    assert [orders[job_id]["priority"] for job_id in [*alices, *bobs]] == [3, 3, 7]
    keys = [orders[job_id]["account"] for job_id in [*alices, *bobs]]
    assert keys[0] == keys[1] != keys[2]
    for key, account in [(keys[0], alice), (keys[2], bob)]:
        assert isinstance(key, str) and len(key) >= 16
        assert str(account.pk) != key and account.username not in key


async def test_a_v1_worker_gets_a_v1_job_and_welcome_even_for_a_job_with_a_stored_checkpoint(
        alice, workers, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    v2 = v2_workers("host-a:0")
    await v2.join(["tiny-a"])
    await v2.jobs(1)
    await v2.send(checkpointed(job_id, 5, 20, b"step 5"))
    assert await eventually(lambda: _checkpoint_is(job_id, 5))
    await v2.close()  # it dies: the job is retried, with its checkpoint stored
    assert await eventually(lambda: _state_is(job_id, "queued"))
    v1 = workers("host-b:0")

    welcome = await v1.join(["tiny-a"])
    order, = await v1.jobs(1)

    assert set(welcome) == {"type", "unknown_models", "heartbeat_seconds", "frame_budget_ms"}
    assert set(order) == V1_JOB_FIELDS and (order["job_id"], order["attempt"]) == (job_id, 2)


async def test_the_welcome_says_the_checkpoint_period_of_the_setting(v2_workers, settings):
    settings.JOB_CHECKPOINT_SECONDS = 0

    welcome = await v2_workers().join(["tiny-a"])

    assert welcome["checkpoint_seconds"] == 0.0


# --- bad messages -------------------------------------------------------------------------------

async def test_bad_step_boundary_messages_change_nothing_and_leave_the_socket_open(alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    mine, theirs = await submit_jobs(alice, 2)
    worker = v2_workers("host-a:0")
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])
    await other.jobs(1)
    await worker.send(checkpointed(mine, 2, 10, b"step 2"))
    assert await eventually(lambda: _checkpoint_is(mine, 2))
    before = [await job_row(job_id) for job_id in (mine, theirs)]
    too_big = "A" * (MAX_CHECKPOINT_CHARS + 4)

    for message in [
        {**preempted(mine, 11, 10, b"x")},  # step past steps
        {**preempted(mine, -1, 10, b"x")},
        {**preempted(mine, 1, 0, b"x")},  # no steps
        {**preempted(mine, "3", 10, b"x")},
        {**preempted(mine, 3, 10, b"x"), "checkpoint": "not base64!"},
        {**preempted(mine, 3, 10, b"x"), "checkpoint": too_big},
        {**preempted(mine, 3, 10, b"x"), "checkpoint": 12},
        {**preempted(mine, 3, 10, b"x"), "job_id": "not-a-uuid"},
        {"type": "job_preempted", "job_id": mine},
        {**checkpointed(mine, 3, 10, b"x"), "checkpoint": None},  # job_checkpoint needs one
        {**checkpointed(mine, 3, 10, b"x"), "checkpoint": ""},
        {**checkpointed(mine, 3, 10, b"x"), "checkpoint": too_big},
        {**checkpointed(mine, 3, 10, b"x"), "steps": True},
        checkpointed(theirs, 3, 10, b"another worker's job"),  # well formed, not this worker's
    ]:
        await worker.send(message)

    assert await worker.silent(0.3)  # not closed, nothing answered
    assert [await job_row(job_id) for job_id in (mine, theirs)] == before
    assert await checkpoint_of(mine) == (2, b"step 2")
    at_the_limit = "A" * MAX_CHECKPOINT_CHARS  # the largest the contract allows is stored
    await worker.send({**checkpointed(mine, 3, 10, b""), "checkpoint": at_the_limit})
    assert await eventually(lambda: _checkpoint_is(mine, 3))


async def _checkpoint_is(job_id: str, step: int) -> bool:
    return (await job_row(job_id))["checkpoint_step"] == step


async def _state_is(job_id: str, state: str) -> bool:
    return (await job_row(job_id))["state"] == state


async def test_cancelling_a_job_running_from_its_checkpoint_tells_the_worker_at_once_and_deletes_the_checkpoint(
        alice, v2_workers, settings):
    from tests.helpers import api_client

    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await worker.started(job_id)
    await worker.send(preempted(job_id, 5, 10, b"step 5"))
    assert await worker.receive() == {"type": "job_ack", "job_id": job_id}
    resumed, = await worker.jobs(1)
    assert resumed["resume"]["step"] == 5
    name = (await job_row(job_id))["checkpoint"]

    answer = await database_sync_to_async(lambda: api_client(alice).post(f"/api/v1/jobs/{job_id}/cancel/"))()

    assert answer.status_code == 200 and answer.json()["state"] == "cancelled", answer.content
    assert await worker.receive() == {"type": "cancel", "job_id": job_id}
    assert not await exists(name)
    row = await job_row(job_id)
    assert (row["checkpoint"], row["checkpoint_step"]) == ("", None)
