"""Moving a waiting job, on the worker socket: a job held behind another job on a busy worker is
asked back (`preempt`) when a worker serving its model holds nothing, and goes to that worker once
the busy one answers; a job that has begun, a worker's only job, and a v1 worker's jobs stay. And
the dispatch's tie-break that shares the rungs: between workers holding as many jobs, the faster copy."""
from __future__ import annotations

import base64

import pytest

from tests.helpers import eventually, job_row, submit_jobs, tiny_png
from tests.scheduling.test_priority_preemption import holding_two_of, running

pytestmark = pytest.mark.django_db(transaction=True)
PNG_B64 = base64.b64encode(tiny_png()).decode()


def given_back(job_id: str) -> dict:
    return {"type": "job_preempted", "job_id": job_id, "step": 0, "steps": 10, "checkpoint": None}


async def test_a_job_waiting_behind_another_moves_to_a_worker_that_connects_idle(alice, v2_workers):
    busy = v2_workers("host-a:0")
    ids = await holding_two_of(alice, busy)

    idle = v2_workers("host-b:0")
    await idle.join(["tiny-a"])

    assert await busy.receive() == {"type": "preempt", "job_id": ids[1]}
    assert await idle.silent(), "the job goes nowhere before its worker lets it go"
    await busy.send(given_back(ids[1]))
    assert await busy.receive() == {"type": "job_ack", "job_id": ids[1]}
    order, = await idle.jobs(1)
    assert order["job_id"] == ids[1]
    row = await job_row(ids[1])
    assert (row["state"], row["worker_id"], row["attempts"], row["preemptions"]) == ("dispatched", "host-b:0", 1, 1)
    assert (await job_row(ids[0]))["worker_id"] == "host-a:0"


async def test_a_worker_that_finishes_its_job_takes_the_one_waiting_on_another(alice, v2_workers):
    first = v2_workers("host-a:0")
    job_a, = await submit_jobs(alice, 1)
    await first.join(["tiny-a"])
    await first.jobs(1)
    second = v2_workers("host-b:0")
    await second.join(["tiny-a"])
    submitted = set(await submit_jobs(alice, 2))
    job_b = (await second.jobs(1))[0]["job_id"]
    job_c = (await first.jobs(1))[0]["job_id"]
    assert {job_b, job_c} == submitted, "each worker holds two"
    await first.started(job_a)
    await second.started(job_b)
    assert await eventually(lambda: running(job_a))

    await second.result(job_b, [PNG_B64])

    assert await second.receive() == {"type": "job_ack", "job_id": job_b}
    assert await first.receive() == {"type": "preempt", "job_id": job_c}
    await first.send(given_back(job_c))
    assert await first.receive() == {"type": "job_ack", "job_id": job_c}
    assert (await second.jobs(1))[0]["job_id"] == job_c


async def test_a_job_that_has_begun_is_not_moved(alice, v2_workers):
    busy = v2_workers("host-a:0")
    ids = await holding_two_of(alice, busy)
    await busy.started(ids[1])  # the worker interleaves both (within an account, by priority)
    assert await eventually(lambda: running(ids[1]))

    await v2_workers("host-b:0").join(["tiny-a"])

    assert await busy.silent()


async def test_a_worker_s_only_job_is_not_moved(alice, v2_workers):
    busy = v2_workers("host-a:0")
    job_id, = await submit_jobs(alice, 1)
    await busy.join(["tiny-a"])
    await busy.jobs(1)

    await v2_workers("host-b:0").join(["tiny-a"])

    assert await busy.silent()


async def test_no_job_moves_to_an_idle_worker_that_does_not_serve_its_model(alice, v2_workers):
    busy = v2_workers("host-a:0")
    await holding_two_of(alice, busy)

    await v2_workers("host-b:0").join(["tiny-b"])

    assert await busy.silent()


async def test_a_v1_worker_is_never_asked_to_give_a_job_back(alice, workers, v2_workers):
    busy = workers("host-a:0")
    ids = await submit_jobs(alice, 2)
    await busy.join(["tiny-a"])
    await busy.jobs(2)

    await v2_workers("host-b:0").join(["tiny-a"])

    assert await busy.silent()
    assert (await job_row(ids[1]))["worker_id"] == "host-a:0"


async def test_a_moving_job_that_ends_where_it_was_leaves_the_idle_worker_free_for_the_queue(alice, v2_workers):
    busy = v2_workers("host-a:0")
    ids = await holding_two_of(alice, busy)
    idle = v2_workers("host-b:0")
    await idle.join(["tiny-a"])
    assert await busy.receive() == {"type": "preempt", "job_id": ids[1]}

    await busy.result(ids[1], [PNG_B64])  # it had begun and finished before the preempt arrived
    assert await busy.receive() == {"type": "job_ack", "job_id": ids[1]}
    later, = await submit_jobs(alice, 1)

    assert (await idle.jobs(1))[0]["job_id"] == later


async def join_on(worker, rung: str) -> None:
    """The worker says hello serving tiny-a on `rung`."""
    from tests.support.worker_sockets import hello_v2

    await worker.connect()
    message = hello_v2(worker.worker_id, ["tiny-a"])
    message["models"][0]["rung"] = rung
    await worker.send(message)
    assert (await worker.receive())["type"] == "welcome"


async def test_a_job_waiting_on_a_full_copy_is_not_moved_to_a_slower_one(alice, v2_workers):
    busy = v2_workers("host-a:0")
    await holding_two_of(alice, busy)

    await join_on(v2_workers("host-b:0"), "group_offload")  # 3.7x a full step: waiting is quicker

    assert await busy.silent()


async def test_a_job_moves_to_a_copy_on_the_same_rung_as_its_own(alice, v2_workers):
    busy = v2_workers("host-a:0")
    await join_on(busy, "model_offload")
    ids = await submit_jobs(alice, 2)
    assert [m["job_id"] for m in await busy.jobs(2)] == ids
    await busy.started(ids[0])
    assert await eventually(lambda: running(ids[0]))

    await join_on(v2_workers("host-b:0"), "model_offload")

    assert await busy.receive() == {"type": "preempt", "job_id": ids[1]}


async def slow_then_fast(alice, v2_workers, rung: str):
    """`slow` joins first on `rung` and takes two of three jobs; `fast` joins on full and takes the
    one left queued (which also shows it is registered). Returns them and the jobs `slow` holds."""
    slow = v2_workers("host-a:0")
    await join_on(slow, rung)  # joined first: a plain tie would go its way
    submitted = set(await submit_jobs(alice, 3))
    on_slow = [m["job_id"] for m in await slow.jobs(2)]
    fast = v2_workers("host-b:0")
    await join_on(fast, "full")
    on_fast = [m["job_id"] for m in await fast.jobs(1)]
    assert set(on_slow + on_fast) == submitted
    return slow, fast, on_slow


async def test_between_workers_holding_as_many_a_job_goes_to_the_copy_on_the_faster_rung(alice, v2_workers):
    slow, fast, on_slow = await slow_then_fast(alice, v2_workers, "model_offload")
    await slow.started(on_slow[0])
    await slow.result(on_slow[0], [PNG_B64])
    assert await slow.receive() == {"type": "job_ack", "job_id": on_slow[0]}

    fourth, = await submit_jobs(alice, 1)  # each holds one now

    assert (await fast.jobs(1))[0]["job_id"] == fourth
    assert await slow.silent()


async def test_a_copy_on_group_offload_takes_a_job_only_while_no_faster_copy_has_room(alice, v2_workers):
    slow, fast, on_slow = await slow_then_fast(alice, v2_workers, "group_offload")
    for job_id in on_slow:  # slow holds none now, fast one
        await slow.started(job_id)
        await slow.result(job_id, [PNG_B64])
        assert await slow.receive() == {"type": "job_ack", "job_id": job_id}

    fourth, fifth = await submit_jobs(alice, 2)

    assert [m["job_id"] for m in await fast.jobs(1)] == [fourth]  # the less loaded copy waits ...
    assert [m["job_id"] for m in await slow.jobs(1)] == [fifth]  # ... until the faster one is full


async def test_a_copy_demoted_to_a_slower_rung_takes_no_job_waiting_on_a_faster_one(alice, v2_workers):
    busy = v2_workers("host-a:0")
    running_id, = await submit_jobs(alice, 1)
    await busy.join(["tiny-a"])
    await busy.jobs(1)
    await busy.started(running_id)
    demoted = v2_workers("host-b:0")
    await demoted.join(["tiny-a"])
    await demoted.send({"type": "rung_changed", "model_id": "tiny-a", "rung": "group_offload", "realtime": False,
                        "frame_ms_p95": None, "realtime_slots": 0})
    submitted = set(await submit_jobs(alice, 2))
    waiting = (await busy.jobs(1))[0]["job_id"]  # busy's room first: a copy on group offload is overflow
    its_own = (await demoted.jobs(1))[0]["job_id"]
    assert {its_own, waiting} == submitted

    await demoted.result(its_own, [PNG_B64])

    assert await demoted.receive() == {"type": "job_ack", "job_id": its_own}
    assert await busy.silent(), "moved to a copy 3.7x slower"
