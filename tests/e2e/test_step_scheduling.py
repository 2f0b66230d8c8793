"""End to end, step-boundary scheduling: a job paused and resumed over REST, a job whose worker is
killed resuming from its periodic checkpoint on another worker, and an account's urgent job
overtaking its long one (on the worker, and by the API's preemption when the worker is full) while
another account's never does; each long job ends with the same PNG bytes as an uninterrupted run of
the same seed. Real Daphne, real runworker_gpu processes on the tiny model."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_job_path import Client
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

WORKER_OPTIONS = ("--threads", "1", "--no-realtime")
LONG = {"prompt": "a long job", "width": 64, "height": 64, "steps": 50}
URGENT = {"prompt": "an urgent job", "width": 64, "height": 64, "steps": 3, "seed": 5}
STEP_DEADLINE_S = 180.0


def serve(stack: Stack, *accounts: str) -> tuple[list[Client], str, Path]:
    """Migrate, make the tiny model, start the API; a REST client per account (alice first), the
    worker token and the models dir. No worker yet."""
    account_token, worker_token = stack.prepare()
    tokens = [account_token, *(stack.manage("create_account", name) for name in accounts)]
    models_dir = stack.workdir / "models"
    manifest = Path(stack.manage("make_tiny_model", str(models_dir / "tiny")))
    assert stack.manage("load_manifests", str(manifest)) == "loaded 1"
    stack.start_api()
    return [Client(stack, token) for token in tokens], worker_token, models_dir


def wait_until(client: Client, job_id: str, done: Any, what: str, timeout: float = STEP_DEADLINE_S) -> dict[str, Any]:
    """Poll the job until `done(job)` holds (bounded); the job as it was then."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.job(job_id)
        if done(job):
            return job
        assert job["state"] not in ("succeeded", "failed", "cancelled"), f"job ended before {what}: {job}"
        assert time.monotonic() < deadline, f"job {job_id} not {what} within {timeout}s: {job}"
        time.sleep(0.05)


def running_past_step_one(client: Client, job_id: str) -> dict[str, Any]:
    return wait_until(client, job_id, lambda job: (job.get("progress") or {}).get("step"), "past its first step")


def moment(stamp: str) -> datetime:
    """A REST time (ISO 8601; DRF leaves out a zero fraction, so strings do not compare)."""
    return datetime.fromisoformat(stamp)


def png_of(client: Client, job: dict[str, Any]) -> bytes:
    assert job["state"] == "succeeded", job
    png = client.http.get(job["images"][0])
    assert png.status_code == 200, png.text
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n"
    return png.content


def uninterrupted_png(client: Client, params: dict[str, Any]) -> bytes:
    """The image of the same params run again whole (nothing else is queued or held by then)."""
    again = client.wait(client.submit(model_id="tiny-sd", params=params)["id"], "succeeded")
    assert (again["attempts"], again["preemptions"], again["checkpoint_step"]) == (1, 0, None), again
    return png_of(client, again)


def test_a_running_job_paused_over_rest_resumes_from_its_checkpoint_to_the_same_png(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path) as stack:
        (alice,), worker_token, models_dir = serve(stack)
        worker = stack.start_worker(worker_token, models_dir, "--worker-id", "pause-a", *WORKER_OPTIONS)
        params = {**LONG, "seed": 41}
        job = alice.submit(model_id="tiny-sd", params=params)
        running_past_step_one(alice, job["id"])

        not_paused = alice.http.post(f"/api/v1/jobs/{job['id']}/resume/")
        assert not_paused.status_code == 409 and not_paused.json()["error"] == "job_not_paused", not_paused.text

        # With two API processes the pause reaches the one the worker is not connected to
        pausing = alice.http.post(f"/api/v1/jobs/{job['id']}/pause/")
        assert pausing.status_code == 200, pausing.text
        assert pausing.json()["state"] in ("dispatched", "running", "paused"), pausing.json()
        paused = alice.wait(job["id"], "paused")
        assert paused["state"] == "paused", paused
        assert paused["checkpoint_step"] and 0 < paused["checkpoint_step"] < params["steps"], paused
        assert (paused["preemptions"], paused["attempts"], paused["position"], paused["worker_id"]) == (
            1, 1, None, None), paused
        still = alice.job(job["id"])  # a paused job stays paused: nothing dispatches it again
        assert still["state"] == "paused", still
        offset = len(worker.log())

        resumed = alice.http.post(f"/api/v1/jobs/{job['id']}/resume/")
        assert resumed.status_code == 200, resumed.text
        # queued again, and (like a submission) it may be dispatched by the time the answer is written
        assert resumed.json()["state"] in ("queued", "dispatched"), resumed.json()
        assert resumed.json()["checkpoint_step"] == paused["checkpoint_step"], resumed.json()
        done = alice.wait(job["id"], "succeeded")
        assert (done["state"], done["attempts"], done["preemptions"]) == ("succeeded", 1, 1), done
        assert re.search(rf"job {job['id']} .*, from step {paused['checkpoint_step']}\b", worker.log()[offset:]), \
            "the worker did not resume it from its checkpoint"
        assert png_of(alice, done) == uninterrupted_png(alice, params)


def test_a_job_whose_worker_is_killed_resumes_from_its_periodic_checkpoint_on_another_worker(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path, JOB_CHECKPOINT_SECONDS="1") as stack:
        (alice,), worker_token, models_dir = serve(stack)
        first = stack.start_worker(worker_token, models_dir, "--worker-id", "kill-a", *WORKER_OPTIONS)
        params = {**LONG, "seed": 43}
        job = alice.submit(model_id="tiny-sd", params=params)
        checkpointed = wait_until(alice, job["id"], lambda job: job["checkpoint_step"], "checkpointed")
        assert checkpointed["state"] == "running" and checkpointed["preemptions"] == 0, checkpointed

        stack.kill(first)  # SIGKILL: no drain, no goodbye; the API sees the socket close
        offset = len(first.log())
        second = stack.start_worker(worker_token, models_dir, "--worker-id", "kill-b", *WORKER_OPTIONS)

        done = alice.wait(job["id"], "succeeded")
        assert (done["state"], done["attempts"], done["preemptions"]) == ("succeeded", 2, 0), done
        assert done["worker_id"] == "kill-b", done
        assert re.search(rf"job {job['id']} \(tiny-sd, attempt 2, .*, from step [1-9]", second.log()[offset:]), \
            "B did not resume it from a checkpoint"
        assert png_of(alice, done) == uninterrupted_png(alice, params)


@dataclass
class Overtaken:
    """An account's long job overtaken by its urgent one, both ended."""

    client: Client
    worker: Any  # the worker's Process
    params: dict[str, Any]
    long: dict[str, Any]  # the long job at its end
    urgent: dict[str, Any]  # the urgent job at its end


def urgent_overtakes_long(stack: Stack, worker_id: str, seed: int) -> Overtaken:
    """One worker; an account's long priority-0 job runs, then the account submits a priority-9 job,
    which must end first; both jobs as they ended."""
    (alice,), worker_token, models_dir = serve(stack)
    worker = stack.start_worker(worker_token, models_dir, "--worker-id", worker_id, *WORKER_OPTIONS)
    params = {**LONG, "seed": seed}
    long = alice.submit(model_id="tiny-sd", params=params, priority=0)
    running_past_step_one(alice, long["id"])

    urgent = alice.submit(model_id="tiny-sd", params=URGENT, priority=9)
    urgent_done = alice.wait(urgent["id"], "succeeded")
    assert urgent_done["state"] == "succeeded", urgent_done
    long_then = alice.job(long["id"])
    assert long_then["state"] != "succeeded", f"the long job ended first: {long_then}"
    long_done = alice.wait(long["id"], "succeeded")
    assert long_done["state"] == "succeeded" and long_done["attempts"] == 1, long_done
    assert moment(urgent_done["finished_at"]) < moment(long_done["finished_at"]), (urgent_done, long_done)
    return Overtaken(alice, worker, params, long_done, urgent_done)


def test_an_urgent_job_overtakes_its_accounts_long_job_on_a_worker_with_room(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path) as stack:  # JOB_DISPATCH_DEPTH 2: the worker holds both
        run = urgent_overtakes_long(stack, "turns-a", 47)

        assert run.long["preemptions"] == 0, run.long
        assert re.search(rf"job {run.long['id']} set aside after step [1-9]\d* of {run.params['steps']} for a job "
                         "of higher priority", run.worker.log()), "the worker did not set the long job aside"
        assert png_of(run.client, run.long) == uninterrupted_png(run.client, run.params)


def test_an_urgent_job_preempts_its_accounts_long_job_on_a_full_worker(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path, JOB_DISPATCH_DEPTH="1") as stack:  # the urgent job can only start by a preemption
        run = urgent_overtakes_long(stack, "full-a", 53)

        assert run.long["preemptions"] >= 1, run.long
        assert re.search(rf"job {run.long['id']} \(tiny-sd, attempt 1, .*, from step [1-9]", run.worker.log()), \
            "the long job did not resume from the step where it was preempted"
        assert png_of(run.client, run.long) == uninterrupted_png(run.client, run.params)


def test_another_accounts_urgent_job_waits_for_a_full_worker_and_preempts_nothing(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path, JOB_DISPATCH_DEPTH="1") as stack:
        (alice, bob), worker_token, models_dir = serve(stack, "bob")
        stack.start_worker(worker_token, models_dir, "--worker-id", "fair-a", *WORKER_OPTIONS)
        params = {**LONG, "seed": 59}
        long = alice.submit(model_id="tiny-sd", params=params, priority=0)
        running_past_step_one(alice, long["id"])

        urgent = bob.submit(model_id="tiny-sd", params=URGENT, priority=9)
        at_submit, deadline = alice.job(long["id"])["progress"]["step"], time.monotonic() + STEP_DEADLINE_S
        while (alice.job(long["id"])["progress"] or {}).get("step", 0) < min(at_submit + 5, params["steps"]):
            waiting = bob.job(urgent["id"])  # a preemption would have dispatched it by now
            assert (waiting["state"], waiting["position"]) == ("queued", 1), waiting
            assert time.monotonic() < deadline, alice.job(long["id"])
            time.sleep(0.05)

        long_done = alice.wait(long["id"], "succeeded")
        urgent_done = bob.wait(urgent["id"], "succeeded")
        assert urgent_done["state"] == "succeeded", urgent_done
        assert (long_done["state"], long_done["attempts"], long_done["preemptions"]) == ("succeeded", 1, 0), long_done
        assert moment(urgent_done["started_at"]) >= moment(long_done["finished_at"]), (long_done, urgent_done)
        assert png_of(alice, long_done) == uninterrupted_png(alice, params)
