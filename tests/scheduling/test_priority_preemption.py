"""The API's priority preemption, on the worker socket: when every worker serving a job's model is
full and one holds a job of the same account with a lower priority, that worker gets `preempt` for
it (one not yet started first), and once it answers, the waiting job goes there; another account's
job is never preempted for it (fair share), and a v1 worker is never preempted."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async

from tests.helpers import eventually, job_row, job_states, submit_jobs

pytestmark = pytest.mark.django_db(transaction=True)


def preempted(job_id: str, step: int, steps: int, checkpoint: bytes | None) -> dict:
    return {"type": "job_preempted", "job_id": job_id, "step": step, "steps": steps,
            "checkpoint": None if checkpoint is None else base64.b64encode(checkpoint).decode()}


async def running(job_id: str) -> bool:
    return (await job_row(job_id))["state"] == "running"


async def holding_two_of(account, worker) -> list[str]:
    """`account` submits two priority-0 jobs; the worker (depth 2) gets both and starts the first."""
    ids = await submit_jobs(account, 2)
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == ids
    await worker.started(ids[0])
    assert await eventually(lambda: running(ids[0]))
    return ids


async def test_an_urgent_job_takes_the_place_of_its_account_s_job_not_yet_started_and_runs_there(
        alice, bob, v2_workers):
    worker = v2_workers()
    ids = await holding_two_of(alice, worker)
    ahead, = await submit_jobs(bob, 1)  # waits too, its turn before the urgent job's

    urgent, = await submit_jobs(alice, 1, priority=9)

    assert await worker.receive() == {"type": "preempt", "job_id": ids[1]}  # not started: before the running one
    assert await job_states([urgent, ahead]) == ["queued", "queued"]
    await worker.send(preempted(ids[1], 0, 10, None))
    assert await worker.receive() == {"type": "job_ack", "job_id": ids[1]}
    order, = await worker.jobs(1)
    assert (order["job_id"], order["priority"]) == (urgent, 9)  # the place it was made, not bob's turn
    row = await job_row(ids[1])
    assert (row["state"], row["preemptions"], row["attempts"]) == ("queued", 1, 1)
    assert await job_states([ids[0], ahead]) == ["running", "queued"]


async def test_the_running_job_is_preempted_when_it_is_the_account_s_only_lower_one(alice, bob, v2_workers):
    worker = v2_workers()
    ids = await submit_jobs(alice, 1)
    others = await submit_jobs(bob, 1)
    await worker.join(["tiny-a"])
    assert {m["job_id"] for m in await worker.jobs(2)} == {ids[0], others[0]}
    await worker.started(ids[0])
    assert await eventually(lambda: running(ids[0]))

    urgent, = await submit_jobs(alice, 1, priority=5)

    assert await worker.receive() == {"type": "preempt", "job_id": ids[0]}
    await worker.send(preempted(ids[0], 3, 10, b"latents after step 3"))
    assert await worker.receive() == {"type": "job_ack", "job_id": ids[0]}
    assert (await worker.jobs(1))[0]["job_id"] == urgent
    row = await job_row(ids[0])
    assert (row["state"], row["checkpoint_step"], row["preemptions"]) == ("queued", 3, 1)


async def test_another_account_s_job_is_never_preempted_for_a_higher_priority(alice, bob, v2_workers):
    worker = v2_workers()
    await holding_two_of(bob, worker)

    urgent, = await submit_jobs(alice, 1, priority=9)

    assert await worker.silent()
    assert await job_states([urgent]) == ["queued"]


async def test_an_equal_priority_preempts_nothing(alice, v2_workers):
    worker = v2_workers()
    await holding_two_of(alice, worker)

    later, = await submit_jobs(alice, 1)

    assert await worker.silent()
    assert await job_states([later]) == ["queued"]


async def test_a_v1_worker_is_never_preempted(alice, workers):
    worker = workers()
    await holding_two_of(alice, worker)

    urgent, = await submit_jobs(alice, 1, priority=9)

    assert await worker.silent()
    assert await job_states([urgent]) == ["queued"]


async def test_a_job_is_preempted_once_and_two_urgent_jobs_take_two_places(alice, v2_workers):
    worker = v2_workers()
    ids = await holding_two_of(alice, worker)

    first, = await submit_jobs(alice, 1, priority=5)
    assert await worker.receive() == {"type": "preempt", "job_id": ids[1]}
    second, = await submit_jobs(alice, 1, priority=9)
    assert await worker.receive() == {"type": "preempt", "job_id": ids[0]}
    third, = await submit_jobs(alice, 1, priority=9)
    assert await worker.silent()  # nothing of lower priority is left to give back

    await worker.send(preempted(ids[0], 2, 10, b"step 2"))
    await worker.send(preempted(ids[1], 0, 10, None))
    messages = [m for m in await worker.drain() if m["type"] == "job"]
    assert sorted(m["job_id"] for m in messages) == sorted([first, second])
    assert await job_states([third, ids[0], ids[1]]) == ["queued", "queued", "queued"]


async def test_an_urgent_job_cancelled_before_the_answer_leaves_the_place_to_the_queue(alice, v2_workers):
    from tests.helpers import api_client

    worker = v2_workers()
    ids = await holding_two_of(alice, worker)
    urgent, = await submit_jobs(alice, 1, priority=9)
    assert await worker.receive() == {"type": "preempt", "job_id": ids[1]}

    response = await database_sync_to_async(lambda: api_client(alice).post(f"/api/v1/jobs/{urgent}/cancel/"))()
    assert response.status_code in (200, 204), response.content
    await worker.send(preempted(ids[1], 0, 10, None))

    assert await worker.receive() == {"type": "job_ack", "job_id": ids[1]}
    again, = await worker.jobs(1)
    assert again["job_id"] == ids[1]  # back in its own place: nothing is lost
    assert await job_states([urgent, ids[1]]) == ["cancelled", "dispatched"]


async def test_after_an_api_restart_the_jobs_a_worker_still_holds_can_be_preempted(alice, v2_workers):
    from potocolom.runtime import runtime
    from scheduling.dispatcher import DISPATCHER

    worker = v2_workers()
    ids = await holding_two_of(alice, worker)
    runtime.reset(DISPATCHER)  # what the database says is all this process knows now
    again = v2_workers()  # the same worker, connecting again
    await again.join(["tiny-a"], jobs=ids)
    await again.progress(ids[0], 1, 10)  # handled once its hello has been, to the end
    assert await eventually(lambda: _progress_is(ids[0], 1))

    urgent, = await submit_jobs(alice, 1, priority=9)

    assert await again.receive() == {"type": "preempt", "job_id": ids[1]}  # still known not to have started
    assert await job_states([urgent]) == ["queued"]


async def _progress_is(job_id: str, step: int) -> bool:
    return (await job_row(job_id))["progress_step"] == step


async def test_a_place_made_on_a_worker_that_came_back_without_the_model_goes_to_no_job_of_it(alice, v2_workers):
    from tests.helpers import register_model

    await database_sync_to_async(register_model)("tiny-b")
    worker = v2_workers()
    ids = await holding_two_of(alice, worker)
    urgent, = await submit_jobs(alice, 1, priority=9)
    assert await worker.receive() == {"type": "preempt", "job_id": ids[1]}
    again = v2_workers()  # the same worker connects again, serving another model now
    await again.join(["tiny-b"], jobs=ids)
    await again.progress(ids[0], 1, 10)  # handled once its hello has been, to the end
    assert await eventually(lambda: _progress_is(ids[0], 1))

    await again.send(preempted(ids[1], 0, 10, None))

    assert await again.receive() == {"type": "job_ack", "job_id": ids[1]}
    assert await again.silent()  # neither the urgent job nor the one it gave back: not its model now
    assert await job_states([urgent, ids[1]]) == ["queued", "queued"]
