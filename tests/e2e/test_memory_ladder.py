"""End to end: the memory ladder through real Daphne and a real `runworker_gpu --device cpu`.

CUDA cannot run out of memory here, so the worker is started with the test-only variable
POTOCOLOM_TEST_OOM=MODEL_ID:COUNT: the next COUNT job calls of that model raise
torch.OutOfMemoryError at the one seam where a job calls its pipeline (docs/operations.md).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_job_path import Client
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

PARAMS = {"prompt": "a small red circle", "width": 64, "height": 64, "steps": 2, "seed": 5}
WAIT_S = 120.0


def serve_tiny(stack: Stack) -> tuple[Client, Client]:
    """The API and one CPU worker on the tiny model; (alice's client, a staff client)."""
    account_token, worker_token = stack.prepare()
    staff_token = stack.manage("create_account", "ops", "--staff")
    manifest = stack.manage("make_tiny_model", str(stack.workdir / "models" / "tiny"))
    assert stack.manage("load_manifests", manifest) == "loaded 1"
    stack.start_api()
    stack.start_worker(worker_token, stack.workdir / "models", "--threads", "1", "--no-realtime")
    return Client(stack, account_token), Client(stack, staff_token)


def until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.1)
    return value


def worker_log(stack: Stack) -> str:
    return next(p for p in stack.processes if p.name == "runworker_gpu").log()


def worker_rungs(staff: Client) -> dict[str, str]:
    response = staff.http.get("/api/v1/queues/")
    assert response.status_code == 200, response.text
    return {m["model_id"]: m["rung"] for w in response.json()["workers"] for m in w["models"]}


def test_out_of_memory_moves_the_model_down_and_retries_once_and_a_second_one_fails_the_job(tmp_path: Path) -> None:
    # Three injected errors: job 1 runs out on full and again on model_offload (failed); job 2 runs
    # out on model_offload and succeeds on group_offload.
    with Stack(workdir=tmp_path, POTOCOLOM_TEST_OOM="tiny-sd:3") as stack:
        alice, staff = serve_tiny(stack)
        until(lambda: worker_rungs(staff) == {"tiny-sd": "full"}, "served on full")

        first = alice.wait(alice.submit(model_id="tiny-sd", params=PARAMS)["id"], "succeeded")
        assert first["state"] == "failed", first
        assert first["error"].startswith("out of memory again on rung model_offload after moving down from full")
        assert worker_rungs(staff) == {"tiny-sd": "model_offload"}  # rung_changed came before job_failed

        second = alice.wait(alice.submit(model_id="tiny-sd", params=PARAMS)["id"], "succeeded")
        assert second["state"] == "succeeded" and second["rung"] == "group_offload", second
        assert second["attempts"] == 1 and len(second["images"]) == 1
        assert worker_rungs(staff) == {"tiny-sd": "group_offload"}

        # The worker logs a job's summary once its result is sent: the API may have it first.
        line = f"job {second['id']} (tiny-sd) succeeded on rung group_offload, gpu"
        until(lambda: line in worker_log(stack), "the job's log line")
        log = worker_log(stack)
        device = os.environ.get("STACK_WORKER_DEVICE") or "cpu"
        assert f"model tiny-sd on {device}: rung full: " in log
        assert device != "cpu" or "model tiny-sd on cpu: rung full: no VRAM figure" in log
        assert "moved down from rung full to model_offload" in log
        assert "moved down from rung model_offload to group_offload" in log


def test_a_pinned_rung_fails_the_job_on_out_of_memory_and_never_moves(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path, POTOCOLOM_TEST_OOM="tiny-sd:1", MEMORY_MODE="model_offload") as stack:
        alice, staff = serve_tiny(stack)

        failed = alice.wait(alice.submit(model_id="tiny-sd", params=PARAMS)["id"], "succeeded")
        after = alice.wait(alice.submit(model_id="tiny-sd", params=PARAMS)["id"], "succeeded")

        assert failed["state"] == "failed", failed
        assert failed["error"].startswith("out of memory on rung model_offload, pinned by MEMORY_MODE=model_offload")
        assert after["state"] == "succeeded" and after["rung"] == "model_offload", after
        assert worker_rungs(staff) == {"tiny-sd": "model_offload"}
        assert "moved down" not in worker_log(stack)
