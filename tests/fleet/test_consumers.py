"""The worker socket /ws/worker/?token=T, driven with channels' WebsocketCommunicator."""
from __future__ import annotations

import asyncio
import base64
from io import StringIO

import pytest
from channels.db import database_sync_to_async
from django.core.management import call_command
from django.utils import timezone

from scheduling.services import JobRequest, job_submit
from tests.helpers import (
    api_client,
    eventually,
    hello,
    job_row,
    job_states,
    register_model,
    tiny_png,
)
from workers.services import worker_token_create

pytestmark = pytest.mark.django_db(transaction=True)

PNG = tiny_png(2, 2)
PNG_B64 = base64.b64encode(PNG).decode()


@pytest.fixture
def models(db):
    register_model("tiny-a", cost=1.0)
    register_model("tiny-b", cost=2.0)


@pytest.fixture
def token(db) -> str:
    return worker_token_create(name="host-a")


@database_sync_to_async
def submit(account, *, model_id: str = "tiny-a", priority: int = 0, prompt: str = "a red circle") -> str:
    job = job_submit(account=account, now=timezone.now(),
                     request=JobRequest(params={"prompt": prompt}, model_id=model_id, priority=priority))
    return str(job.id)


async def submit_many(account, count: int, **options) -> list[str]:
    return [await submit(account, prompt=f"job {n}", **options) for n in range(count)]


@database_sync_to_async
def rest(account, method: str, path: str):
    return getattr(api_client(account), method)(path)


async def rest_job(account, job_id: str) -> dict:
    response = await rest(account, "get", f"/api/v1/jobs/{job_id}/")
    assert response.status_code == 200
    return response.json()


def state_is(job_id: str, state: str):
    async def check():
        return (await job_row(job_id))["state"] == state
    return check


@database_sync_to_async
def snapshot() -> list[tuple]:
    """Everything a message could change about the jobs."""
    from scheduling.models import Job

    return list(Job.objects.order_by("id").values_list("id", "state", "worker_id", "attempts", "progress_step",
                                                       "progress_steps", "images", "error", "started_at",
                                                       "finished_at"))


# --- authentication -----------------------------------------------------------------------------

@database_sync_to_async
def api_token_of(account) -> str:
    from rest_framework.authtoken.models import Token

    return Token.objects.get(user=account).key


@database_sync_to_async
def revoked_worker_token() -> str:
    from workers.models import WorkerToken

    secret = worker_token_create(name="old-host")
    WorkerToken.objects.filter(name="old-host").update(revoked=True)
    return secret


@pytest.mark.parametrize("kind", ["no token", "empty token", "wrong token", "an account's API token",
                                  "a revoked worker token", "a very long token"])
async def test_it_accepts_then_closes_a_socket_without_a_worker_token_with_4001(models, alice, workers, kind):
    presented = {"no token": None, "empty token": "", "wrong token": "wk_not-a-token",
                 "a very long token": "x" * 5000}.get(kind)
    if kind == "an account's API token":
        presented = await api_token_of(alice)
    elif kind == "a revoked worker token":
        presented = await revoked_worker_token()
    await submit(alice)
    worker = workers(token=presented)

    await worker.connect()

    assert await worker.expect_close() == 4001
    await worker.send(hello("intruder:0", ["tiny-a"]))
    assert await worker.silent()
    assert await job_states([]) == []
    assert (await snapshot())[0][1] == "queued"


async def test_it_accepts_a_token_made_by_create_worker_token(models, alice, workers):
    out = StringIO()
    await database_sync_to_async(call_command)("create_worker_token", "host-z", stdout=out)
    secret = out.getvalue().splitlines()[-1]

    welcome = await workers("host-z:0", token=secret).join(["tiny-a"])

    assert welcome["type"] == "welcome"


# --- hello / welcome ----------------------------------------------------------------------------

@database_sync_to_async
def worker_record(worker_id: str) -> dict:
    from workers.models import Worker

    return Worker.objects.values("connected", "served_models", "unknown_models", "gpu").get(worker_id=worker_id)


async def test_it_welcomes_a_worker_and_names_the_models_it_does_not_know(models, workers):
    worker = workers("host-a:0")
    await worker.connect()

    await worker.send(hello("host-a:0", ["tiny-a", "not-registered", "tiny-b", "also-unknown"]))

    assert await worker.receive() == {"type": "welcome", "unknown_models": ["not-registered", "also-unknown"],
                                      "heartbeat_seconds": 10.0, "frame_budget_ms": 500.0}
    record = await worker_record("host-a:0")
    assert record["connected"] is True
    assert [m["model_id"] for m in record["served_models"]] == ["tiny-a", "tiny-b"]
    assert record["unknown_models"] == ["not-registered", "also-unknown"]
    assert record["gpu"]["name"] == "Fake GPU"


async def test_it_welcomes_with_the_configured_heartbeat_and_frame_budget(models, workers, settings):
    settings.WORKER_HEARTBEAT_SECONDS = 7.5
    settings.FRAME_BUDGET_MS = 250.0

    welcome = await workers().join(["tiny-a"])

    assert (welcome["heartbeat_seconds"], welcome["frame_budget_ms"]) == (7.5, 250.0)


async def test_it_wants_hello_before_anything_else(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.connect()

    await worker.started(job_id)
    await worker.send({"type": "heartbeat"})
    await worker.send({"type": "hello", "worker_id": "host-a:0", "models": "tiny-a"})  # a bad hello

    assert await worker.silent()
    assert await job_states([job_id]) == ["queued"]
    await worker.send(hello("host-a:0", ["tiny-a"]))
    assert (await worker.receive())["type"] == "welcome"
    assert (await worker.receive())["job_id"] == job_id


# --- the job flow -------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [1, 2, 3])
async def test_it_sends_a_worker_at_most_job_dispatch_depth_jobs(models, alice, workers, settings, depth):
    settings.JOB_DISPATCH_DEPTH = depth
    ids = await submit_many(alice, 5)
    worker = workers()

    await worker.join(["tiny-a"])
    sent = await worker.jobs(depth)

    assert [m["job_id"] for m in sent] == ids[:depth]
    assert await worker.silent()
    assert await job_states(ids) == ["dispatched"] * depth + ["queued"] * (5 - depth)
    assert (await job_row(ids[0]))["worker_id"] == "host-a:0"

    await worker.result(ids[0], [PNG_B64])

    assert [m["job_id"] for m in await worker.jobs(1)] == [ids[depth]]
    assert await worker.silent()


async def test_it_sends_the_job_with_its_attempt_model_and_params(models, alice, workers):
    job_id = await submit(alice, prompt="a blue square")
    worker = workers()

    await worker.join(["tiny-a"])

    assert await worker.receive() == {"type": "job", "job_id": job_id, "attempt": 1, "model_id": "tiny-a",
                                      "params": {"prompt": "a blue square"}}


async def test_it_sends_the_init_image_as_submitted_though_the_row_keeps_none(models, alice, workers):
    sent = "data:image/png;base64," + PNG_B64
    job_id = str((await database_sync_to_async(job_submit)(
        account=alice, now=timezone.now(),
        request=JobRequest(params={"prompt": "repaint", "init_image": sent}, model_id="tiny-a"))).id)
    worker = workers()

    await worker.join(["tiny-a"])

    assert (await worker.receive())["params"] == {"prompt": "repaint", "init_image": sent}
    assert "init_image" not in (await job_row(job_id))["params"]


async def test_a_job_whose_init_image_is_gone_fails_and_its_place_frees(models, alice, workers):
    from django.core.files.storage import default_storage

    job = await database_sync_to_async(job_submit)(
        account=alice, now=timezone.now(),
        request=JobRequest(params={"prompt": "repaint", "init_image": PNG_B64}, model_id="tiny-a"))
    next_id = await submit(alice, prompt="after it")
    await database_sync_to_async(default_storage.delete)(job.init_image)
    worker = workers()

    await worker.join(["tiny-a"])

    assert (await worker.receive())["job_id"] == next_id  # never the job that would run as another
    row = await job_row(str(job.id))
    assert row["state"] == "failed" and "init_image" in row["error"]


async def test_it_sends_a_job_submitted_while_the_worker_waits(models, alice, workers):
    worker = workers()
    await worker.join(["tiny-a"])
    assert await worker.silent()

    job_id = await submit(alice, prompt="a blue square")

    assert await worker.receive() == {"type": "job", "job_id": job_id, "attempt": 1, "model_id": "tiny-a",
                                      "params": {"prompt": "a blue square"}}


async def test_it_walks_a_job_from_dispatched_to_succeeded_and_serves_its_image(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    assert (await rest_job(alice, job_id))["state"] == "dispatched"

    await worker.started(job_id)
    await eventually(state_is(job_id, "running"))
    running = await rest_job(alice, job_id)
    assert running["started_at"] and running["worker_id"] == "host-a:0" and running["position"] is None

    await worker.progress(job_id, 3, 10)
    progress = await eventually(lambda: _progress_of(alice, job_id))
    assert progress == {"step": 3, "steps": 10}

    await worker.result(job_id, [PNG_B64], gpu_ms=42.0, rung="full")
    await eventually(state_is(job_id, "succeeded"))
    done = await rest_job(alice, job_id)
    assert done["finished_at"] and done["error"] is None and len(done["images"]) == 1
    assert done["rung"] == "full"
    row = await job_row(job_id)
    assert (row["gpu_ms"], row["rung"]) == (42.0, "full")

    image = await rest(alice, "get", done["images"][0])
    assert image.status_code == 200
    assert image["Content-Type"] == "image/png"
    assert b"".join(image.streaming_content) == PNG
    assert (await rest(await _bob(), "get", done["images"][0])).status_code == 404


async def _progress_of(account, job_id: str):
    return (await rest_job(account, job_id))["progress"]


@database_sync_to_async
def _bob():
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    bob = get_user_model().objects.create_user(username="bob-late", password="pw")
    Token.objects.create(user=bob)
    return bob


async def test_it_takes_progress_before_job_started_as_running(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.progress(job_id, 1, 4)

    await eventually(state_is(job_id, "running"))
    assert (await job_row(job_id))["progress_step"] == 1


async def test_it_stores_several_images_in_order(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    second = tiny_png(3, 1, shade=10)

    await worker.result(job_id, [PNG_B64, "data:image/png;base64," + base64.b64encode(second).decode()])

    await eventually(state_is(job_id, "succeeded"))
    urls = (await rest_job(alice, job_id))["images"]
    served = [b"".join((await rest(alice, "get", url)).streaming_content) for url in urls]
    assert served == [PNG, second]


async def test_it_fails_a_job_the_worker_reports_failed_and_does_not_retry_it(models, alice, workers):
    failing, following = await submit(alice), await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)

    await worker.failed(failing, "CUDA out of memory")

    await eventually(state_is(failing, "failed"))
    job = await rest_job(alice, failing)
    assert job["error"] == "CUDA out of memory" and job["attempts"] == 1 and job["finished_at"]
    other = workers("host-b:0")
    await other.join(["tiny-a"])
    assert await other.silent()
    assert await job_states([failing, following]) == ["failed", "dispatched"]


async def test_it_fails_a_job_whose_result_is_not_an_image(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    await worker.result(job_id, [base64.b64encode(b"GIF89a not a png").decode()])

    await eventually(state_is(job_id, "failed"))
    assert "image" in (await job_row(job_id))["error"]


async def test_it_only_sends_a_worker_jobs_for_the_models_in_its_hello(models, alice, workers):
    for_b = await submit(alice, model_id="tiny-b", priority=9)
    for_a = await submit(alice, model_id="tiny-a")
    worker_a = workers("host-a:0")

    await worker_a.join(["tiny-a", "unregistered"])

    assert [m["job_id"] for m in await worker_a.jobs(1)] == [for_a]
    assert await worker_a.silent()
    assert await job_states([for_b]) == ["queued"]
    worker_b = workers("host-b:0")
    await worker_b.join(["tiny-b"])
    assert [(m["job_id"], m["model_id"]) for m in await worker_b.jobs(1)] == [(for_b, "tiny-b")]


async def test_it_sends_cancel_to_the_worker_holding_a_cancelled_job(models, alice, workers):
    held, queued = await submit(alice), await submit(alice, prompt="next")
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)
    third = await submit(alice)
    assert await worker.silent()

    response = await rest(alice, "post", f"/api/v1/jobs/{held}/cancel/")

    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    assert await worker.receive() == {"type": "cancel", "job_id": held}
    assert [m["job_id"] for m in await worker.jobs(1)] == [third]
    assert await job_states([held, queued, third]) == ["cancelled", "dispatched", "dispatched"]


async def test_it_ignores_a_result_for_a_job_cancelled_meanwhile(models, alice, workers):
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await rest(alice, "post", f"/api/v1/jobs/{job_id}/cancel/")
    assert (await worker.receive())["type"] == "cancel"

    await worker.result(job_id, [PNG_B64])

    assert await worker.silent()
    row = await job_row(job_id)
    assert row["state"] == "cancelled" and row["images"] == []


# --- dead workers -------------------------------------------------------------------------------

async def positions(account, ids: list[str]) -> list[int | None]:
    return [(await rest_job(account, job_id))["position"] for job_id in ids]


async def test_it_requeues_a_dead_workers_jobs_once_then_fails_them_with_worker_lost(models, alice, workers):
    ids = await submit_many(alice, 4)
    first = workers("host-a:0")
    await first.join(["tiny-a"])
    await first.jobs(2)
    await first.started(ids[0])
    await first.progress(ids[0], 2, 8)
    await eventually(state_is(ids[0], "running"))

    await first.close()

    assert await job_states(ids) == ["queued"] * 4
    assert await positions(alice, ids) == [1, 2, 3, 4]
    requeued = await rest_job(alice, ids[0])
    assert requeued["attempts"] == 2 and requeued["worker_id"] is None and requeued["progress"] is None
    assert requeued["started_at"] is None
    assert (await rest_job(alice, ids[2]))["attempts"] == 1
    assert (await worker_record("host-a:0"))["connected"] is False

    second = workers("host-b:0")
    await second.join(["tiny-a"])
    again = await second.jobs(2)
    assert [(m["job_id"], m["attempt"]) for m in again] == [(ids[0], 2), (ids[1], 2)]

    await second.close()

    assert await job_states(ids) == ["failed", "failed", "queued", "queued"]
    for job_id in ids[:2]:
        lost = await rest_job(alice, job_id)
        assert lost["error"] == "worker_lost" and lost["attempts"] == 2 and lost["finished_at"]
    assert await positions(alice, ids[2:]) == [1, 2]


async def test_it_hands_a_dead_workers_jobs_to_a_live_one_at_once(models, alice, workers):
    ids = await submit_many(alice, 2)
    dying, alive = workers("host-a:0"), workers("host-b:0")
    await dying.join(["tiny-a"])
    await dying.jobs(2)
    await alive.join(["tiny-a"])
    assert await alive.silent()

    await dying.close()

    assert [(m["job_id"], m["attempt"]) for m in await alive.jobs(2)] == [(ids[0], 2), (ids[1], 2)]


async def test_it_declares_a_silent_worker_dead_and_requeues_its_jobs(models, alice, workers, settings):
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    job_id = await submit(alice)
    worker = workers()
    welcome = await worker.join(["tiny-a"])
    assert welcome["heartbeat_seconds"] == 0.2
    await worker.jobs(1)

    code = await worker.expect_close(timeout=3)  # dead after 3 silent periods, noticed within 4

    assert code == 4008
    row = await job_row(job_id)
    assert (row["state"], row["attempts"], row["worker_id"]) == ("queued", 2, None)
    assert (await worker_record("host-a:0"))["connected"] is False


async def test_it_keeps_a_worker_that_heartbeats(models, alice, workers, settings):
    settings.WORKER_HEARTBEAT_SECONDS = 0.1
    job_id = await submit(alice)
    worker = workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)

    for _ in range(10):  # one second: ten heartbeat periods, each with a heartbeat
        await worker.send({"type": "heartbeat"})
        await asyncio.sleep(0.1)

    assert await worker.silent(0.05)
    assert await job_states([job_id]) == ["dispatched"]
    assert await worker.expect_close(timeout=3) == 4008


async def test_it_lets_a_new_connection_of_the_same_worker_take_over(models, alice, workers):
    ids = await submit_many(alice, 3)
    old = workers("host-a:0")
    await old.join(["tiny-a"])
    await old.jobs(2)

    new = workers("host-a:0")
    await new.join(["tiny-a"])

    assert await old.expect_close() == 4002
    assert await new.silent()  # it still holds the two jobs: no room, and nothing sent twice
    await old.close()
    assert await job_states(ids) == ["dispatched", "dispatched", "queued"]
    assert [(await job_row(job_id))["attempts"] for job_id in ids] == [1, 1, 1]

    await new.result(ids[0], [PNG_B64])

    assert [m["job_id"] for m in await new.jobs(1)] == [ids[2]]


# --- bad messages -------------------------------------------------------------------------------

async def test_it_ignores_bad_messages_without_closing_or_changing_a_job(models, alice, workers):
    mine = await submit(alice)
    theirs = await submit(alice, model_id="tiny-b")
    other_theirs = await submit(alice, model_id="tiny-b")
    nobodys = await submit(alice, model_id="tiny-b")  # stays queued: the other worker is full
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(1)] == [mine]
    other = workers("host-b:0")
    await other.join(["tiny-b"])
    assert [m["job_id"] for m in await other.jobs(2)] == [theirs, other_theirs]
    before = await snapshot()

    for text in ["not json", " ", "[1, 2]", '"hello"', "null", "{", "\u0000"]:
        await worker.send_text(text)
    await worker.communicator.send_to(bytes_data=b"\x00\x01 binary")
    bad = [
        {},
        {"type": "bogus"},
        {"type": None},
        {"type": "job_result", "job_id": theirs, "images": [PNG_B64]},  # another worker's job
        {"type": "job_result", "job_id": nobodys, "images": [PNG_B64]},  # a queued job
        {"type": "job_started", "job_id": nobodys},
        {"type": "job_failed", "job_id": nobodys, "error": "not mine"},
        {"type": "job_started", "job_id": theirs},
        {"type": "job_progress", "job_id": theirs, "step": 1, "steps": 2},
        {"type": "job_result", "job_id": "00000000-0000-4000-8000-000000000000", "images": [PNG_B64]},  # no such job
        {"type": "job_started", "job_id": "not-a-uuid"},
        {"type": "job_result", "job_id": "12", "images": [PNG_B64]},
        {"type": "job_failed", "job_id": 5, "error": "x"},
        {"type": "job_failed", "job_id": mine},  # no error
        {"type": "job_started"},
        {"type": "job_progress", "job_id": mine, "step": -1, "steps": 2},
        {"type": "job_progress", "job_id": mine, "step": "1", "steps": 2},
        {"type": "job_result", "job_id": mine, "images": []},
        {"type": "job_result", "job_id": mine, "images": "abc"},
        {"type": "job_result", "job_id": mine, "images": [PNG_B64], "gpu_ms": "fast"},
        {"type": "hello", "worker_id": "someone-else:0", "gpu": None, "models": []},  # a new worker_id
        {"type": "hello", "worker_id": "host-a:0", "gpu": None, "models": [{"model_id": "tiny-a", "rung": "x"}]},
    ]
    for message in bad:
        await worker.send(message)

    assert await worker.silent(0.3)  # not closed, nothing sent
    assert await other.silent(0.05)
    assert await snapshot() == before
    await worker.started(mine)  # and the socket still works
    await eventually(state_is(mine, "running"))


async def test_it_ignores_a_job_failed_for_a_job_another_worker_holds(models, alice, workers):
    await submit(alice, model_id="tiny-a")
    theirs = [await submit(alice, model_id="tiny-b") for _ in range(3)]
    worker = workers("host-a:0")
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    other = workers("host-b:0")
    await other.join(["tiny-b"])
    await other.jobs(2)
    before = await snapshot()

    await worker.failed(theirs[0], "not mine to fail")

    assert await other.silent(0.3), "the other worker got a job beyond JOB_DISPATCH_DEPTH"
    assert await snapshot() == before
    assert await job_states(theirs) == ["dispatched", "dispatched", "queued"]


@database_sync_to_async
def served_models(worker_id: str):
    from workers.models import Worker

    return Worker.objects.get(worker_id=worker_id).served_models


async def test_a_rung_changed_updates_what_operators_see_of_the_worker_and_nothing_else(models, alice, workers):
    worker = workers()
    await worker.join(["tiny-a", "tiny-b"])

    await worker.send({"type": "rung_changed", "model_id": "tiny-a", "rung": "model_offload", "realtime": False,
                       "realtime_slots": 0})

    changed = {"model_id": "tiny-a", "rung": "model_offload", "realtime": False, "frame_ms_p95": None,
               "realtime_slots": 0}
    assert await eventually(lambda: _served_if(changed))
    assert (await served_models("host-a:0"))[1] == {"model_id": "tiny-b", "rung": "full", "realtime": False,
                                                    "frame_ms_p95": None, "realtime_slots": 0}
    job_id = await submit(alice)  # jobs still go to the model on its new rung
    assert (await worker.receive())["job_id"] == job_id


async def _served_if(entry):
    return entry in await served_models("host-a:0")
