"""Drain on the worker socket, from the API's side: a worker that says `draining` is sent no new job
(another worker is), its row says so, and the jobs it gives back as job_preempted go to another
worker at their old places with the same attempts and their checkpoints; its sessions go back to
the queue at their old places and live again on another worker; a new hello clears it."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async

from tests.helpers import eventually, job_row, job_states, submit_jobs, tiny_png
from tests.realtime import conftest as realtime
from workers.models import Worker

models, sockets, worker_token = realtime.models, realtime.sockets, realtime.worker_token  # the session fixtures

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def draining(worker_id: str) -> bool:
    return Worker.objects.filter(worker_id=worker_id, draining=True).exists()


async def test_a_draining_worker_gets_no_new_job_while_another_worker_does(alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    drained, other = v2_workers("host-a:0"), v2_workers("host-b:0")
    await drained.join(["tiny-a"])
    await other.join(["tiny-a"])
    await drained.send({"type": "draining"})
    assert await eventually(lambda: draining("host-a:0"))

    ids = await submit_jobs(alice, 2)

    first, = await other.jobs(1)
    assert first["job_id"] == ids[0]
    assert await drained.silent()
    assert await job_states(ids) == ["dispatched", "queued"]  # host-b is full: ids[1] waits for it


async def test_a_drained_job_goes_to_another_worker_at_its_old_place_with_its_attempts_and_checkpoint(
        alice, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 1
    drained = v2_workers("host-a:0")
    await drained.join(["tiny-a"])
    ids = await submit_jobs(alice, 2)
    first, = await drained.jobs(1)
    await drained.started(ids[0])
    other = v2_workers("host-b:0")
    await other.join(["tiny-a"])
    await other.jobs(1)  # ids[1]

    await drained.send({"type": "draining"})
    checkpoint = base64.b64encode(b"latents after step 4").decode()
    await drained.send({"type": "job_preempted", "job_id": ids[0], "step": 4, "steps": 10,
                        "checkpoint": checkpoint})

    assert await drained.receive() == {"type": "job_ack", "job_id": ids[0]}
    assert await drained.silent()  # not sent back to the worker that gave it back
    row = await job_row(ids[0])
    assert (row["state"], row["attempts"], row["preemptions"]) == ("queued", 1, 1)
    await other.result(ids[1], [base64.b64encode(tiny_png(2, 2)).decode()])
    assert (await other.receive())["type"] == "job_ack"
    again, = await other.jobs(1)
    assert (again["job_id"], again["attempt"]) == (ids[0], first["attempt"])
    assert again["resume"] == {"step": 4, "checkpoint": checkpoint}


async def test_a_new_hello_of_a_drained_worker_clears_its_draining(alice, v2_workers):
    drained = v2_workers("host-a:0")
    await drained.join(["tiny-a"])
    await drained.send({"type": "draining"})
    assert await eventually(lambda: draining("host-a:0"))
    await drained.close()

    again = v2_workers("host-a:0")
    await again.join(["tiny-a"])
    job_id, = await submit_jobs(alice, 1)

    assert (await again.jobs(1))[0]["job_id"] == job_id
    assert not await draining("host-a:0")


# --- sessions -----------------------------------------------------------------------------------

@database_sync_to_async
def session_rows() -> list[tuple[str, str | None, object]]:
    from realtime.models import RealtimeSession

    return list(RealtimeSession.objects.order_by("joined_at").values_list("state", "worker_id", "joined_at"))


async def test_a_draining_workers_session_goes_back_at_its_old_place_and_goes_live_on_another_worker(
        models, sockets, alice, bob):
    browser, worker = sockets
    drained = await worker("host-a:0", slots=1)
    live = await browser(alice)
    start = await drained.receive()
    await drained.send({"type": "session_accepted", "session_id": start["session_id"]})
    await live.expect_state("live")
    waiting = await browser(bob)  # joined later: behind alice's session
    await waiting.expect_state("queued", position=1)
    (_, _, joined_at), _ = await session_rows()

    await drained.send({"type": "draining"})
    await drained.send({"type": "session_ended", "session_id": start["session_id"]})

    assert await live.expect_state("queued") == {"type": "state", "state": "queued", "position": 1}
    other = await worker("host-b:0", slots=1)
    again = await other.receive()
    assert again["type"] == "session_start" and again["session_id"] == start["session_id"]
    await other.send({"type": "session_accepted", "session_id": start["session_id"]})
    await live.expect_state("live")
    (state, worker_id, joined_again), _ = await session_rows()
    assert (state, worker_id, joined_again) == ("live", "host-b:0", joined_at)
    assert [m for m in await drained.drain() if m["type"] == "session_start"] == []  # no slot for it any more
