"""A queued job's estimated wait: the pure estimate (tables and Hypothesis), the first estimates
kept to measure it, and eta_seconds through REST with its error measured when the job starts."""
from __future__ import annotations

import base64

import pytest
from channels.db import database_sync_to_async
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from scheduling.eta import FirstEtas, ModelLoad, error_ratio, eta_seconds, job_overhead_seconds, steps_per_second
from tests.helpers import api_client, eventually, hello, register_model, tiny_png

# --- the estimate, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize(("position", "load", "expected"), [
    # one copy at 100 ms a step (10 steps a second), nothing held, first in line: no wait
    (1, ModelLoad(1, 20, 0, (100.0,)), 0.0),
    # the copy's held jobs have 20 steps left: 2 s
    (1, ModelLoad(1, 20, 20, (100.0,)), 2.0),
    # third in line, queue of 4 jobs of 10 steps on average: 20 held + 2 x 10 ahead = 40 steps
    (3, ModelLoad(4, 40, 20, (100.0,)), 4.0),
    # two copies, 100 ms and 50 ms: 30 steps a second
    (2, ModelLoad(2, 60, 30, (100.0, 50.0)), 2.0),
    # a copy not measured yet counts as the mean of those measured
    (1, ModelLoad(1, 10, 40, (100.0, None)), 2.0),
    # no copy measured, or no copy at all: no estimate
    (1, ModelLoad(1, 10, 40, (None,)), None),
    (1, ModelLoad(1, 10, 0, ()), None),
    # not queued
    (None, ModelLoad(1, 10, 0, (100.0,)), None),
])
def test_the_estimate_is_the_work_ahead_over_the_copies_speed(position, load, expected):
    assert eta_seconds(position=position, load=load) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(("position", "load", "expected"), [
    # another model's queue of 4 jobs (40 steps) on the same worker, this model's queue of 2: a job
    # second in line has half of it ahead too: 1 x 10 of its own + 20 of theirs = 30 steps
    (2, ModelLoad(2, 20, 0, (100.0,), shared_queued_jobs=4, shared_queued_steps=40), 3.0),
    # first in line: none of theirs comes before it
    (1, ModelLoad(2, 20, 0, (100.0,), shared_queued_jobs=4, shared_queued_steps=40), 0.0),
    # each job ahead (one held, one queued) also takes 0.5 s beyond its steps: 20 steps + 2 x 0.5 s
    (2, ModelLoad(2, 20, 10, (100.0,), held_jobs=1, job_overhead_seconds=0.5), 3.0),
    # two copies share the jobs' time beyond their steps: 20 steps at 20 a second + 2 x 0.5 s / 2
    (2, ModelLoad(2, 20, 10, (100.0, 100.0), held_jobs=1, job_overhead_seconds=0.5), 1.5),
])
def test_the_work_ahead_counts_other_models_on_its_workers_and_each_jobs_time_beyond_its_steps(
        position, load, expected):
    assert eta_seconds(position=position, load=load) == pytest.approx(expected)


@pytest.mark.parametrize(("runs", "step_ms", "expected"), [
    ([(1.5, 10)], 100.0, 0.5),  # 1.5 s for 10 steps of 100 ms: 0.5 s beyond them
    ([(1.5, 10), (0.9, 4), (3.0, 20)], 100.0, 0.5),  # the median of 0.5, 0.5, 1.0
    ([(1.5, 10), (2.0, 10)], 100.0, 0.75),  # an even count: the mean of the middle two
    ([(0.5, 10)], 100.0, 0.0),  # faster than its steps (a step time measured cold): never below 0
    ([], 100.0, 0.0),  # no runs yet
    ([(1.5, 10)], None, 0.0),  # no step time measured
])
def test_a_jobs_time_beyond_its_steps_is_the_median_over_recent_runs(runs, step_ms, expected):
    assert job_overhead_seconds(runs, step_ms=step_ms) == pytest.approx(expected)


@pytest.mark.parametrize(("copies", "expected"), [
    ((100.0,), 10.0), ((100.0, 100.0), 20.0), ((250.0, None, 0.0), 12.0), ((None,), None), ((), None)])
def test_the_copies_speed_counts_each_copy(copies, expected):
    assert steps_per_second(copies) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(("eta", "actual", "expected"), [
    (10.0, 10.0, 0.0), (5.0, 10.0, 0.5), (20.0, 10.0, 1.0), (0.0, 4.0, 1.0), (3.0, 0.0, None)])
def test_the_error_ratio_is_relative_to_the_actual_wait(eta, actual, expected):
    assert error_ratio(eta=eta, actual=actual) == expected


step_ms = st.one_of(st.none(), st.floats(min_value=1.0, max_value=10_000.0))
loads = st.builds(ModelLoad, queued_jobs=st.integers(0, 500), queued_steps=st.integers(0, 50_000),
                  held_steps_left=st.integers(0, 5_000), copies_step_ms=st.lists(step_ms, max_size=6).map(tuple))


@given(loads, st.integers(1, 500))
def test_an_estimate_is_never_negative_and_exists_only_with_a_measured_copy(load, position):
    eta = eta_seconds(position=position, load=load)
    measured = any(ms is not None and ms > 0 for ms in load.copies_step_ms)
    assert (eta is not None) == measured
    assert eta is None or eta >= 0


@given(loads, st.integers(1, 500))
def test_a_later_place_never_waits_less(load, position):
    here, behind = eta_seconds(position=position, load=load), eta_seconds(position=position + 1, load=load)
    assert here is None or behind >= here


@given(loads, st.integers(1, 500), st.one_of(st.none(), st.floats(min_value=1.0, max_value=10_000.0)))
def test_another_copy_never_makes_the_wait_longer(load, position, extra_ms):
    """(A copy not yet measured counts as the mean of those measured: adding a slow measured copy
    beside one unmeasured may lower that mean, so the property holds when all are measured.)"""
    if extra_ms is not None:
        load = ModelLoad(load.queued_jobs, load.queued_steps, load.held_steps_left,
                         tuple(ms for ms in load.copies_step_ms if ms is not None))
    elif not any(ms is not None for ms in load.copies_step_ms):
        return  # an unmeasured copy alone gives no estimate
    more = ModelLoad(load.queued_jobs, load.queued_steps, load.held_steps_left, (*load.copies_step_ms, extra_ms))
    before, after = eta_seconds(position=position, load=load), eta_seconds(position=position, load=more)
    assert after is not None and (before is None or after <= before * (1 + 1e-9))


def test_the_first_estimate_of_a_job_is_kept_until_it_starts():
    etas = FirstEtas(kept=2)
    etas.offer("a", eta=10.0, at_us=0)
    etas.offer("a", eta=99.0, at_us=5_000_000)  # a later estimate does not replace the first
    assert etas.started("a", at_us=20_000_000) == pytest.approx(0.5)
    assert etas.started("a", at_us=30_000_000) is None  # measured once
    for job_id in ("b", "c", "d"):
        etas.offer(job_id, eta=1.0, at_us=0)
    assert len(etas) == 2 and etas.started("b", at_us=1_000_000) is None  # the oldest was forgotten
    etas.forget("c")
    assert etas.started("c", at_us=1_000_000) is None


# --- eta_seconds through REST, and its error measured ---------------------------------------------


@pytest.fixture
def token(db) -> str:
    from workers.services import worker_token_create

    register_model("tiny-a")
    return worker_token_create(name="hosts")


@database_sync_to_async
def submit_rest(account, steps: int) -> dict:
    body = {"model_id": "tiny-a", "params": {"prompt": "x", "steps": steps}}
    response = api_client(account).post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


@database_sync_to_async
def rest_get(account, job_id: str) -> dict:
    return api_client(account).get(f"/api/v1/jobs/{job_id}/").json()


@database_sync_to_async
def rest_list(account) -> dict[str, float | None]:
    return {job["id"]: job["eta_seconds"] for job in api_client(account).get("/api/v1/jobs/").json()["results"]}


def eta_errors_measured() -> float:
    return REGISTRY.get_sample_value("potocolom_eta_error_ratio_count") or 0.0


@pytest.mark.django_db(transaction=True)
async def test_a_queued_job_shows_its_estimated_wait_and_its_error_is_measured_when_it_starts(alice, token, workers):
    lonely = await submit_rest(alice, 10)
    assert lonely["state"] == "queued" and lonely["eta_seconds"] is None  # no worker has measured a step
    await database_sync_to_async(lambda: api_client(alice).post(f"/api/v1/jobs/{lonely['id']}/cancel/"))()
    worker = workers()
    await worker.connect()
    await worker.send(hello("host-a:0", ["tiny-a"], step_ms=100.0))  # 10 steps a second
    assert (await worker.receive())["type"] == "welcome"
    held = [await submit_rest(alice, 10) for _ in range(2)]  # JOB_DISPATCH_DEPTH 2: both go to the worker

    async def both_dispatched() -> bool:  # at once in memory; through Redis, just after the submission
        return [(await rest_get(alice, job["id"]))["state"] for job in held] == ["dispatched", "dispatched"]

    await eventually(both_dispatched)
    assert [(await rest_get(alice, job["id"]))["eta_seconds"] for job in held] == [None, None]  # only queued
    first, second = await submit_rest(alice, 10), await submit_rest(alice, 30)
    # 20 held steps left, then 10 a second: first 2 s; second waits for first too (the queue's mean, 20 steps)
    assert first["eta_seconds"] == pytest.approx(2.0) and second["eta_seconds"] == pytest.approx(4.0)
    assert (await rest_get(alice, second["id"]))["eta_seconds"] == pytest.approx(4.0)
    listed = await rest_list(alice)
    assert listed[first["id"]] == pytest.approx(2.0) and listed[held[0]["id"]] is None
    for job in held:
        assert (await worker.receive())["job_id"] == job["id"]
    measured = eta_errors_measured()
    await worker.result(held[0]["id"], [base64.b64encode(tiny_png()).decode()])
    assert (await worker.receive())["job_id"] == first["id"]
    await worker.started(first["id"])

    async def running() -> bool:
        return (await rest_get(alice, first["id"]))["state"] == "running"

    await eventually(running)
    assert eta_errors_measured() == measured + 1


# --- what the estimates keep of the fleet -------------------------------------------------------


def test_the_fleet_is_read_again_after_a_second_or_at_once_when_a_worker_here_changed():
    from datetime import UTC, datetime, timedelta

    from scheduling.selectors import EtaReads

    reads = []

    def read():
        reads.append(1)
        return {"tiny-a": {"host-a:0": 100.0 + len(reads)}}

    kept, at = EtaReads(), datetime(2026, 1, 1, tzinfo=UTC)
    assert kept.copies(now=at, version=0, read=read) == {"tiny-a": {"host-a:0": 101.0}}
    assert kept.copies(now=at + timedelta(milliseconds=900), version=0, read=read)["tiny-a"]["host-a:0"] == 101.0
    assert kept.copies(now=at + timedelta(milliseconds=950), version=1, read=read)["tiny-a"]["host-a:0"] == 102.0
    assert kept.copies(now=at + timedelta(seconds=2), version=1, read=read)["tiny-a"]["host-a:0"] == 103.0
    assert kept.copies(now=at, version=1, read=read)["tiny-a"]["host-a:0"] == 104.0  # a clock that went back
    assert len(reads) == 4


def test_a_models_time_beyond_its_steps_is_kept_ten_seconds_per_step_time():
    from datetime import UTC, datetime, timedelta

    from scheduling.selectors import EtaReads

    runs = [[(1.5, 10)]]
    kept, at = EtaReads(), datetime(2026, 1, 1, tzinfo=UTC)

    def overhead(after: timedelta, step_ms: float = 100.0) -> float:
        return kept.overhead("tiny-a", step_ms=step_ms, now=at + after, read=lambda: runs[0])

    assert overhead(timedelta(0)) == pytest.approx(0.5)
    runs[0] = [(3.0, 10)]
    assert overhead(timedelta(seconds=9)) == pytest.approx(0.5)
    assert overhead(timedelta(seconds=9), step_ms=50.0) == pytest.approx(2.5)  # another step time: read again
    assert overhead(timedelta(seconds=20), step_ms=50.0) == pytest.approx(2.5)
    assert overhead(timedelta(seconds=20)) == pytest.approx(2.0)
