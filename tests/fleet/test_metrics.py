"""GET /metrics: who may read it (staff token or session, the METRICS_TOKEN bearer; 401 and 403
otherwise), the state series read from the database and admission (jobs, sessions, workers, slots),
and the event series counted where they happen (job wait at dispatch, preemptions by reason, frame
round trips). Event series belong to the process: tests compare them before and after."""
from __future__ import annotations

import base64
from typing import Any

import pytest
from channels.db import database_sync_to_async
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import api_client, eventually, job_row, register_model, submit_jobs, submit_jobs_now, tiny_png
from tests.realtime import conftest as realtime

pytestmark = pytest.mark.django_db(transaction=True)

METRICS_TOKEN = "scrape-0123456789abcdef"
PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()
SESSION_STATES = {"queued", "placing", "live", "idle", "closed"}
CONTRACT_FAMILIES = {"potocolom_jobs_queued", "potocolom_jobs", "potocolom_job_wait_seconds", "potocolom_sessions",
                     "potocolom_frame_seconds", "potocolom_realtime_slots", "potocolom_workers",
                     "potocolom_model_loads", "potocolom_model_load_seconds", "potocolom_preemptions"}


@pytest.fixture
def olga(make_account):
    """An operator: a staff account."""
    return make_account("olga", staff=True)


def get_metrics(account=None, *, authorization: str | None = None):
    client = api_client(account)
    if authorization is not None:
        client.credentials(HTTP_AUTHORIZATION=authorization)
    return client.get("/metrics")


class Scrape:
    """One answer of /metrics, parsed with prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {family.name: family for family in text_string_to_metric_families(text)}

    def value(self, name: str, **labels: str) -> float | None:
        """The sample `name` with exactly these labels, or None when there is none."""
        for family in self.families.values():
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None

    def labelled(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(sample.labels.items())): sample.value
                for family in self.families.values() for sample in family.samples if sample.name == name}


def scrape_now(account) -> Scrape:
    response = get_metrics(account)
    assert response.status_code == 200, response.content
    return Scrape(response.content.decode())


scrape = database_sync_to_async(scrape_now)


# --- who may read it ------------------------------------------------------------------------------

def test_it_answers_401_without_credentials(db):
    response = get_metrics()
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'


def test_it_answers_403_to_an_account_that_is_not_staff(alice):
    assert get_metrics(alice).status_code == 403


def test_it_answers_a_staff_token_in_the_prometheus_text_format(olga):
    response = get_metrics(olga)
    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    assert CONTRACT_FAMILIES <= Scrape(response.content.decode()).families.keys()


def test_it_answers_a_staff_session(olga):
    client = api_client()
    client.force_login(olga)
    assert client.get("/metrics").status_code == 200


def test_it_answers_a_staff_token_to_a_scraper_that_accepts_only_text(olga):
    client = api_client(olga)
    response = client.get("/metrics", HTTP_ACCEPT="text/plain;version=0.0.4")
    assert (response.status_code, response["Content-Type"]) == (200, CONTENT_TYPE_LATEST)


def test_it_answers_the_metrics_token_as_bearer(db, settings):
    settings.METRICS_TOKEN = METRICS_TOKEN
    response = get_metrics(authorization=f"Bearer {METRICS_TOKEN}")
    assert response.status_code == 200
    assert "potocolom_workers" in Scrape(response.content.decode()).families


@pytest.mark.parametrize("authorization", [f"Bearer {METRICS_TOKEN}x", "Bearer wrong", "Bearer",
                                           f"Bearer {METRICS_TOKEN} {METRICS_TOKEN}"])
def test_it_answers_401_to_a_wrong_bearer(db, settings, authorization):
    settings.METRICS_TOKEN = METRICS_TOKEN
    assert get_metrics(authorization=authorization).status_code == 401


def test_a_bearer_is_no_one_while_metrics_token_is_unset(db, settings):
    settings.METRICS_TOKEN = ""
    assert get_metrics(authorization="Bearer ").status_code == 401
    assert get_metrics(authorization="Bearer anything").status_code == 401


def test_the_metrics_token_does_not_stand_for_a_non_staff_account(alice, settings):
    settings.METRICS_TOKEN = METRICS_TOKEN
    assert get_metrics(alice).status_code == 403


# --- the state read at scrape time ------------------------------------------------------------------

def test_it_counts_jobs_per_model_and_state_and_queued_jobs_per_model(alice, olga):
    register_model("tiny-a")
    register_model("tiny-b")
    submit_jobs_now(alice, 3, model_id="tiny-a")
    submit_jobs_now(alice, 1, model_id="tiny-b")

    metrics = scrape_now(olga)

    assert metrics.labelled("potocolom_jobs_queued") == {(("model_id", "tiny-a"),): 3.0,
                                                         (("model_id", "tiny-b"),): 1.0}
    assert metrics.labelled("potocolom_jobs_total") == {(("model_id", "tiny-a"), ("state", "queued")): 3.0,
                                                        (("model_id", "tiny-b"), ("state", "queued")): 1.0}
    assert metrics.families["potocolom_jobs"].type == "counter"
    assert metrics.labelled("potocolom_sessions") == {(("state", state),): 0.0 for state in SESSION_STATES}
    assert metrics.value("potocolom_workers") == 0.0
    assert metrics.labelled("potocolom_realtime_slots") == {}


def test_the_model_load_series_are_declared_before_any_load(olga):
    metrics = scrape_now(olga)
    assert metrics.families["potocolom_model_loads"].type == "counter"
    assert metrics.families["potocolom_model_load_seconds"].type == "histogram"
    assert {sample.labels["reason"] for sample in metrics.families["potocolom_preemptions"].samples
            if sample.name == "potocolom_preemptions_total"} == {"pause", "drain", "priority", "move"}


async def _load_failures_of(account, model_id: str, at_least: float) -> bool:
    return ((await scrape(account)).value("potocolom_model_loads_total", model_id=model_id, outcome="failed")
            or 0.0) >= at_least


def _model_ids(metrics: Scrape) -> set[str]:
    return {sample.labels["model_id"] for family in metrics.families.values() for sample in family.samples
            if "model_id" in sample.labels}


async def test_a_worker_naming_models_the_registry_does_not_know_creates_no_series(olga, v2_workers):
    worker = v2_workers()
    await worker.join(["tiny-a"])
    before = await scrape(olga)
    failed_before = before.value("potocolom_model_loads_total", model_id="tiny-a", outcome="failed") or 0.0
    ghost = {"rung": "full", "realtime": True, "frame_ms_p95": 40.0, "realtime_slots": 3}

    await worker.send({"type": "model_loaded", "model_id": "ghost-loaded", **ghost, "gpu": None})
    await worker.send({"type": "model_load_failed", "model_id": "ghost-failed", "error": "no", "gpu": None})
    await worker.send({"type": "rung_changed", "model_id": "ghost-rung", **ghost})
    await worker.send({"type": "model_load_failed", "model_id": "tiny-a", "error": "no", "gpu": None})
    # the worker's messages are handled in order: once tiny-a's failure counts, the others were handled
    await eventually(lambda: _load_failures_of(olga, "tiny-a", failed_before + 1))

    after = await scrape(olga)
    assert _model_ids(after) - _model_ids(before) == set()
    assert not [name for name in _model_ids(after) if name.startswith("ghost")]


async def test_a_connected_worker_is_counted_and_its_dispatches_count_in_the_job_wait_histogram(
        alice, olga, v2_workers, settings):
    settings.JOB_DISPATCH_DEPTH = 2
    await submit_jobs(alice, 3)
    before = await scrape(olga)
    assert before.value("potocolom_jobs_queued", model_id="tiny-a") == 3.0

    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(2)

    after = await scrape(olga)
    assert after.value("potocolom_workers") == 1.0
    assert after.value("potocolom_jobs_queued", model_id="tiny-a") == 1.0
    assert after.value("potocolom_jobs_total", model_id="tiny-a", state="dispatched") == 2.0
    assert after.value("potocolom_jobs_total", model_id="tiny-a", state="queued") == 1.0
    waits = after.value("potocolom_job_wait_seconds_count")
    assert waits is not None and waits == (before.value("potocolom_job_wait_seconds_count") or 0) + 2
    assert after.value("potocolom_job_wait_seconds_bucket", le="+Inf") == waits
    assert (after.value("potocolom_job_wait_seconds_sum") or 0) >= (before.value("potocolom_job_wait_seconds_sum")
                                                                     or 0)

    await worker.close()
    assert await eventually(lambda: _workers_counted(olga, 0))


async def _workers_counted(account, count: int) -> bool:
    return (await scrape(account)).value("potocolom_workers") == count


# --- preemptions, by reason -------------------------------------------------------------------------

def preempted(job_id: str, step: int) -> dict[str, Any]:
    return {"type": "job_preempted", "job_id": job_id, "step": step, "steps": 10,
            "checkpoint": base64.b64encode(f"latents after step {step}".encode()).decode()}


async def preemptions(account, reason: str) -> float:
    return (await scrape(account)).value("potocolom_preemptions_total", reason=reason) or 0.0


@database_sync_to_async
def pause(account, job_id: str) -> int:
    return api_client(account).post(f"/api/v1/jobs/{job_id}/pause/").status_code


async def _running(job_id: str) -> bool:
    return (await job_row(job_id))["state"] == "running"


async def test_a_pause_answered_with_job_preempted_counts_as_a_pause(alice, olga, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await worker.started(job_id)
    assert await eventually(lambda: _running(job_id))
    before = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}

    assert await pause(alice, job_id) == 200
    assert await worker.receive() == {"type": "preempt", "job_id": job_id}
    await worker.send(preempted(job_id, 4))
    assert await worker.receive() == {"type": "job_ack", "job_id": job_id}

    after = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}
    assert after == {**before, "pause": before["pause"] + 1}


async def test_a_job_given_back_by_a_draining_worker_counts_as_a_drain(alice, olga, v2_workers):
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    before = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}

    await worker.send({"type": "draining"})
    await worker.send(preempted(job_id, 2))
    assert await worker.receive() == {"type": "job_ack", "job_id": job_id}

    after = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}
    assert after == {**before, "drain": before["drain"] + 1}


async def test_a_job_given_back_for_an_urgent_one_counts_as_a_priority_preemption(alice, olga, v2_workers,
                                                                                    settings):
    settings.JOB_DISPATCH_DEPTH = 1
    job_id, = await submit_jobs(alice, 1)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    await worker.jobs(1)
    await worker.started(job_id)
    assert await eventually(lambda: _running(job_id))
    before = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}

    urgent, = await submit_jobs(alice, 1, priority=9)
    assert await worker.receive() == {"type": "preempt", "job_id": job_id}
    await worker.send(preempted(job_id, 3))
    assert await worker.receive() == {"type": "job_ack", "job_id": job_id}
    assert (await worker.jobs(1))[0]["job_id"] == urgent

    after = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority")}
    assert after == {**before, "priority": before["priority"] + 1}


async def test_a_job_moved_to_an_idle_worker_counts_as_a_move(alice, olga, v2_workers):
    ids = await submit_jobs(alice, 2)
    busy = v2_workers("host-a:0")
    await busy.join(["tiny-a"])
    await busy.jobs(2)
    await busy.started(ids[0])
    assert await eventually(lambda: _running(ids[0]))
    before = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority", "move")}

    await v2_workers("host-b:0").join(["tiny-a"])
    assert await busy.receive() == {"type": "preempt", "job_id": ids[1]}
    await busy.send({**preempted(ids[1], 0), "checkpoint": None})
    assert await busy.receive() == {"type": "job_ack", "job_id": ids[1]}

    after = {reason: await preemptions(olga, reason) for reason in ("pause", "drain", "priority", "move")}
    assert after == {**before, "move": before["move"] + 1}


# --- realtime: slots, sessions, frame round trips ---------------------------------------------------

models, sockets, worker_token = realtime.models, realtime.sockets, realtime.worker_token  # the session fixtures


async def test_a_live_session_uses_a_slot_and_its_frame_round_trip_is_counted_for_its_model(
        models, sockets, alice, olga):
    browser, worker = sockets
    host = await worker(slots=2)
    before = await scrape(olga)
    assert before.labelled("potocolom_realtime_slots") == {
        (("model_id", "tiny-a"), ("state", "free")): 2.0, (("model_id", "tiny-a"), ("state", "used")): 0.0}

    session = await browser(alice)
    start = await host.receive()
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})
    await session.expect_state("live")
    live = await scrape(olga)
    assert live.value("potocolom_realtime_slots", model_id="tiny-a", state="free") == 1.0
    assert live.value("potocolom_realtime_slots", model_id="tiny-a", state="used") == 1.0
    assert live.value("potocolom_sessions", state="live") == 1.0

    await session.send({"type": "frame", "seq": 1, "image": f"data:image/png;base64,{PNG_B64}",
                        "params": {"prompt": "a red square"}})
    assert (await host.receive())["seq"] == 1
    await host.send({"type": "frame_result", "session_id": start["session_id"], "seq": 1, "image": PNG_B64,
                     "gpu_ms": 5.0, "batch_size": 1})
    assert (await session.expect("frame"))["seq"] == 1

    after = await scrape(olga)
    frames = after.value("potocolom_frame_seconds_count", model_id="tiny-a") or 0
    assert frames == (before.value("potocolom_frame_seconds_count", model_id="tiny-a") or 0) + 1
    assert after.value("potocolom_frame_seconds_bucket", model_id="tiny-a", le="+Inf") == frames
