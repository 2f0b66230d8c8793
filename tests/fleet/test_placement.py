"""Placement on the worker socket (docs/protocol.md, "Placement across workers"): a job or session
waiting for a model no connected worker has loaded gets it loaded where it is installed (idle models
unloaded first when memory is short), the job goes there once the worker answers model_loaded, a
busy model is never unloaded, a model being unloaded takes no new work, a failed load backs off, and
operators see it all on /api/v1/queues/ and /metrics. The planner runs here when the test says
(placement_run), as the placement thread of a served process would on these events."""
from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from tests.helpers import api_client, job_states, register_model, sockets_of, submit_jobs
from tests.support.worker_sockets import V2Worker, hello_v2

pytestmark = pytest.mark.django_db(transaction=True)

NEEDS = {"tiny-a": 600, "tiny-b": 700}


@pytest.fixture(autouse=True)
def second_model(token):
    register_model("tiny-b")


def entry(model_id: str, rung: str = "full", **fields: Any) -> dict[str, Any]:
    return {"model_id": model_id, "rung": rung, "realtime": False, "frame_ms_p95": None, "realtime_slots": 0,
            **fields}


def gpu(free_mib: int, total_mib: int = 1000) -> dict[str, Any]:
    return {"name": "cpu (pretend VRAM from --vram-mib)", "total_mib": total_mib, "free_mib": free_mib}


def installed(*model_ids: str) -> list[dict[str, Any]]:
    return [{"model_id": m, "needs_mib": {"full": NEEDS[m], "model_offload": NEEDS[m] // 2,
                                          "group_offload": NEEDS[m] // 4}, "step_ms": 20.0} for m in model_ids]


class PlacingWorker(V2Worker):
    """A v2 worker that says what it has installed and how much memory is free."""

    async def arrive(self, loaded: list[str], installs: list[str], free_mib: int | None, *,
                     rungs: dict[str, str] | None = None) -> None:
        await self.connect()
        message = {**hello_v2(self.worker_id, []), "models": [entry(m, (rungs or {}).get(m, "full")) for m in loaded],
                   "installed": installed(*installs), "gpu": None if free_mib is None else gpu(free_mib)}
        await self.send(message)
        assert (await self.receive())["type"] == "welcome"

    async def loaded(self, model_id: str, free_mib: int) -> None:
        await self.send({"type": "model_loaded", **entry(model_id, step_ms=20.0), "gpu": gpu(free_mib)})

    async def unloaded(self, model_id: str, free_mib: int) -> None:
        await self.send({"type": "model_unloaded", "model_id": model_id, "gpu": gpu(free_mib)})


@pytest.fixture
async def placing_workers(token):
    async with sockets_of(PlacingWorker, token) as make:
        yield make


@database_sync_to_async
def plan(*, periodic: bool = False) -> list[tuple[str, str, str]]:
    from fleet.placement.driver import placement_run

    return [(a.kind, a.worker_id, a.model_id) for a in placement_run(now=timezone.now(), periodic=periodic)]


@database_sync_to_async
def records() -> list[tuple[str, str, str, str]]:
    from workers.models import PlacementRecord

    return [(r.action, r.model_id, r.worker_id, r.outcome)
            for r in PlacementRecord.objects.order_by("sent_at", "id")]


@database_sync_to_async
def queues(staff) -> dict[str, Any]:
    client = api_client(staff)
    response = client.get("/api/v1/queues/")
    assert response.status_code == 200, response.content
    return response.json()


@pytest.fixture
def staff(make_account):
    account = make_account("operator")
    account.is_staff = True
    account.save()
    return account


async def test_a_job_for_a_model_no_worker_has_loaded_gets_it_loaded_and_runs_there(alice, placing_workers, staff):
    worker = placing_workers()
    await worker.arrive([], ["tiny-a", "tiny-b"], free_mib=1000)
    job, = await submit_jobs(alice, 1, model_id="tiny-b")
    assert await worker.silent()  # nothing serves tiny-b yet: the job waits, it does not fail

    assert await plan() == [("load", "host-a:0", "tiny-b")]
    assert await worker.receive() == {"type": "load_model", "model_id": "tiny-b", "rung": "full"}
    assert await records() == [("load", "tiny-b", "host-a:0", "")]
    assert await plan() == []  # the load is under way: not asked twice

    await worker.loaded("tiny-b", free_mib=300)
    order, = await worker.jobs(1)
    assert order["job_id"] == job
    assert await records() == [("load", "tiny-b", "host-a:0", "loaded")]

    seen = await queues(staff)
    row, = seen["workers"]
    assert [m["model_id"] for m in row["models"]] == ["tiny-b"]
    assert [m["model_id"] for m in row["installed"]] == ["tiny-a", "tiny-b"]
    assert row["gpu"]["free_mib"] == 300
    logged, = seen["placement"]
    assert (logged["action"], logged["model_id"], logged["outcome"]) == ("load", "tiny-b", "loaded")
    assert "no copy loaded" in logged["reason"] and logged["duration_seconds"] >= 0


async def test_short_memory_unloads_the_idle_model_first_then_loads(alice, placing_workers):
    worker = placing_workers()
    await worker.arrive(["tiny-a"], ["tiny-a", "tiny-b"], free_mib=400)
    await submit_jobs(alice, 1, model_id="tiny-b")

    assert await plan() == [("unload", "host-a:0", "tiny-a"), ("load", "host-a:0", "tiny-b")]
    assert await worker.receive() == {"type": "unload_model", "model_id": "tiny-a"}
    assert await worker.receive() == {"type": "load_model", "model_id": "tiny-b", "rung": "full"}

    # Being unloaded, tiny-a takes no new work here
    later, = await submit_jobs(alice, 1, model_id="tiny-a")
    assert await worker.silent()
    assert await job_states([later]) == ["queued"]

    await worker.unloaded("tiny-a", free_mib=1000)
    await worker.loaded("tiny-b", free_mib=300)
    assert (await worker.jobs(1))[0]["model_id"] == "tiny-b"
    assert [(action, model, outcome) for action, model, _, outcome in await records()] == [
        ("unload", "tiny-a", "unloaded"), ("load", "tiny-b", "loaded")]


async def test_a_model_that_holds_a_job_is_never_unloaded(alice, placing_workers):
    worker = placing_workers()
    await worker.arrive(["tiny-a"], ["tiny-a", "tiny-b"], free_mib=100)  # tiny-b fits on no rung beside it
    held, = await submit_jobs(alice, 1, model_id="tiny-a")
    assert (await worker.jobs(1))[0]["job_id"] == held
    await submit_jobs(alice, 1, model_id="tiny-b")

    assert await plan() == []  # tiny-b waits: tiny-a is busy and memory is short
    assert await worker.silent()


async def test_an_unload_is_not_sent_when_the_model_took_a_job_after_it_was_planned(alice, placing_workers):
    from fleet import lifecycle

    worker = placing_workers()
    await worker.arrive(["tiny-a"], ["tiny-a", "tiny-b"], free_mib=400)
    held, = await submit_jobs(alice, 1, model_id="tiny-a")
    assert (await worker.jobs(1))[0]["job_id"] == held
    channel = await database_sync_to_async(lambda: __import__("workers.models").models.Worker.objects.get(
        worker_id="host-a:0").channel_name)()

    sent = await database_sync_to_async(lifecycle.worker_model_unload_begins)(
        worker_id="host-a:0", model_id="tiny-a", channel_name=channel, now=timezone.now())

    assert sent is False
    more, = await submit_jobs(alice, 1, model_id="tiny-a")
    assert (await worker.jobs(1))[0]["job_id"] == more  # it still serves tiny-a


async def test_a_failed_load_is_not_asked_again_of_that_worker_and_another_worker_is_asked(alice, placing_workers):
    first, second = placing_workers("host-a:0"), placing_workers("host-b:0")
    await first.arrive([], ["tiny-b"], free_mib=1000)
    await submit_jobs(alice, 1, model_id="tiny-b")
    assert await plan() == [("load", "host-a:0", "tiny-b")]
    assert (await first.receive())["type"] == "load_model"
    await first.send({"type": "model_load_failed", "model_id": "tiny-b", "error": "out of memory", "gpu": gpu(1000)})
    assert await first.silent()

    assert await plan() == []  # the back-off: host-a is not asked again for a minute
    await second.arrive([], ["tiny-b"], free_mib=1000)
    assert await plan() == [("load", "host-b:0", "tiny-b")]
    assert (await second.receive())["model_id"] == "tiny-b"
    outcomes = [(w, outcome) for _, _, w, outcome in await records()]
    assert outcomes == [("host-a:0", "failed"), ("host-b:0", "")]


async def test_a_waiting_session_gets_its_model_loaded_on_rung_full(alice, placing_workers):
    from realtime.models import RealtimeSession, SessionState

    worker = placing_workers()
    await worker.arrive([], ["tiny-a"], free_mib=1000)
    await database_sync_to_async(RealtimeSession.objects.create)(
        account=alice, model_id="tiny-a", state=SessionState.QUEUED, joined_at=timezone.now())

    assert await plan() == [("load", "host-a:0", "tiny-a")]
    assert await worker.receive() == {"type": "load_model", "model_id": "tiny-a", "rung": "full"}


async def test_workers_that_do_not_say_what_they_have_installed_or_drain_are_never_asked(alice, placing_workers,
                                                                                          v2_workers, workers):
    old = workers("host-v1:0")
    await old.join(["tiny-a"])
    quiet = v2_workers("host-v2:0")
    await quiet.join(["tiny-a"])
    draining = placing_workers("host-c:0")
    await draining.arrive([], ["tiny-b"], free_mib=1000)
    await draining.send({"type": "draining"})
    assert await draining.silent()
    await submit_jobs(alice, 1, model_id="tiny-b")

    assert await plan(periodic=True) == []
    assert await old.silent() and await quiet.silent() and await draining.silent()


async def test_placement_off_plans_nothing(alice, placing_workers, settings):
    settings.PLACEMENT = "off"
    worker = placing_workers()
    await worker.arrive([], ["tiny-b"], free_mib=1000)
    await submit_jobs(alice, 1, model_id="tiny-b")

    assert await plan() == []
    assert await worker.silent()


async def test_loads_are_counted_on_metrics(alice, placing_workers, staff):
    worker = placing_workers()
    await worker.arrive([], ["tiny-b"], free_mib=1000)
    await submit_jobs(alice, 1, model_id="tiny-b")

    def loads() -> float:
        text = api_client(staff).get("/metrics").content.decode()
        line = next((row for row in text.splitlines()
                     if row.startswith('potocolom_model_loads_total{model_id="tiny-b",outcome="loaded"}')), None)
        return 0.0 if line is None else float(line.rsplit(" ", 1)[1])

    before = await database_sync_to_async(loads)()
    await plan()
    await worker.receive()
    await worker.loaded("tiny-b", free_mib=300)
    assert (await worker.jobs(1))[0]["model_id"] == "tiny-b"
    assert await database_sync_to_async(loads)() == before + 1


async def test_a_burst_of_jobs_gets_another_copy_at_once_on_an_event(alice, placing_workers):
    from workers.models import PlacementRecord

    first, second = placing_workers("host-a:0"), placing_workers("host-b:0")
    await first.arrive(["tiny-a"], ["tiny-a"], free_mib=400)
    await second.arrive([], ["tiny-a"], free_mib=1000)
    await submit_jobs(alice, 10)
    assert await plan() == []  # 10 jobs x 30 steps x 20 ms in the last 10 s: its one copy 60 % busy, within 95 %

    await submit_jobs(alice, 10)  # 120 %: a burst
    assert await plan() == [("load", "host-b:0", "tiny-a")]
    assert await second.receive() == {"type": "load_model", "model_id": "tiny-a", "rung": "full"}
    reason = await database_sync_to_async(lambda: PlacementRecord.objects.get().reason)()
    assert reason.startswith("load: a burst: 600 steps came in the last 10 s")
    assert await plan() == []  # one copy at a time: the next waits for this one


@pytest.mark.parametrize(("retire", "expected"), [(True, [("unload", "host-b:0", "tiny-a")]), (False, [])])
async def test_a_spare_copy_on_group_offload_is_unloaded_only_with_placement_retire_slow_copies(
        placing_workers, settings, retire, expected):
    from workers.models import PlacementRecord

    settings.PLACEMENT_RETIRE_SLOW_COPIES = retire
    fast, slow = placing_workers("host-a:0"), placing_workers("host-b:0")
    await fast.arrive(["tiny-a"], ["tiny-a"], free_mib=400)
    await slow.arrive(["tiny-a"], ["tiny-a"], free_mib=850, rungs={"tiny-a": "group_offload"})

    assert await plan(periodic=True) == expected
    if retire:
        assert await slow.receive() == {"type": "unload_model", "model_id": "tiny-a"}
        reason = await database_sync_to_async(lambda: PlacementRecord.objects.get().reason)()
        assert reason.startswith("unload: a spare copy on group_offload, slower than a full copy elsewhere")
    assert await fast.silent()


async def test_the_burst_rule_can_be_turned_off(alice, placing_workers, settings):
    settings.PLACEMENT_BURST_BUSY_SHARE = 0.0
    first, second = placing_workers("host-a:0"), placing_workers("host-b:0")
    await first.arrive(["tiny-a"], ["tiny-a"], free_mib=400)
    await second.arrive([], ["tiny-a"], free_mib=1000)
    await submit_jobs(alice, 20)

    assert await plan() == []
    assert await second.silent()
