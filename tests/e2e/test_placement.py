"""End to end: placement through real Daphne and two real `runworker_gpu --device cpu` processes,
each with a `--vram-mib` budget that holds only one of two tiny models (8 MiB of weights, 553 MiB
needed on rung full at the largest size they allow: 556 MiB holds one). Both start with tiny-a;
demand moves to tiny-b and back: the API unloads an idle copy and loads what is wanted, and every
job succeeds and every session goes live."""
from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.e2e.test_job_path import Client
from tests.e2e.test_sessions import canvas_png
from tests.support.stack import Stack, next_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

BUDGET_MIB = "556"
PARAMS = {"prompt": "a small red circle", "width": 64, "height": 64, "steps": 4, "seed": 5}
SETTINGS = {"PLACEMENT_SECONDS": "1", "PLACEMENT_MIN_RESIDENCY_SECONDS": "1", "PLACEMENT_IDLE_SECONDS": "1",
            "PLACEMENT_TARGET_WAIT_SECONDS": "1", "FRAME_BUDGET_MS": "60000", "SESSION_IDLE_SECONDS": "30"}


def install_two(stack: Stack) -> Path:
    """tiny-a and tiny-b: the same tiny pipeline under two model ids, both registered."""
    models_dir = stack.workdir / "models"
    stack.manage("make_tiny_model", str(models_dir / "tiny-a"))
    shutil.copytree(models_dir / "tiny-a", models_dir / "tiny-b")
    for model_id in ("tiny-a", "tiny-b"):
        path = models_dir / model_id / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["model_id"] = model_id
        path.write_text(json.dumps(manifest))
        assert stack.manage("load_manifests", str(path)) == "loaded 1"
    return models_dir


async def one_session(stack: Stack, token: str, model_id: str) -> dict[str, Any]:
    """A browser session on `model_id`: live, then one frame painted; the live state's message."""
    url = f"{stack.ws_url}/ws/session/?model_id={model_id}&token={token}"
    async with websockets.connect(url, max_size=None) as ws:
        live = await next_of(ws, {"type": "state", "state": "live"}, timeout=180)
        await ws.send(json.dumps({"type": "frame", "seq": 1, "image": canvas_png((200, 30, 30)),
                                  "params": {"prompt": "a red square", "strength": 0.6}}))
        await next_of(ws, {"type": "frame", "seq": 1}, timeout=120)
        return live


def settled(staff: Client, timeout: float = 120.0) -> dict[str, Any]:
    """/api/v1/queues/ once no placement action is waiting for its worker's answer."""
    deadline = time.monotonic() + timeout
    while True:
        seen: dict[str, Any] = staff.http.get("/api/v1/queues/").json()
        waiting = [p for p in seen["placement"] if p["outcome"] == "waiting"]
        if not waiting:
            return seen
        assert time.monotonic() < deadline, f"placement actions still waiting after {timeout}s: {waiting}"
        time.sleep(0.1)


def demand(stack: Stack, client: Client, token: str, model_id: str, jobs: int) -> list[dict[str, Any]]:
    """`jobs` jobs and one session for `model_id` at once; the jobs as they ended."""
    ids = [client.submit(model_id=model_id, params={**PARAMS, "seed": n})["id"] for n in range(jobs)]
    live = asyncio.run(one_session(stack, token, model_id))
    assert live["model_id"] == model_id
    return [client.wait(job_id, "succeeded", timeout=240) for job_id in ids]


def test_models_follow_the_demand_across_two_workers_that_each_hold_one(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path, **SETTINGS) as stack:
        account_token, worker_token = stack.prepare()
        staff = Client(stack, stack.manage("create_account", "ops", "--staff"))
        models_dir = install_two(stack)
        stack.start_api()
        for worker_id in ("host-1:0", "host-2:0"):
            stack.start_worker(worker_token, models_dir, "--worker-id", worker_id, "--vram-mib", BUDGET_MIB,
                               "--preload", "tiny-a", "--threads", "1", "--frame-budget-ms", "60000",
                               log_name=f"worker-{worker_id}.log")
        alice = Client(stack, account_token)

        ended = [*demand(stack, alice, account_token, "tiny-a", 3),
                 *demand(stack, alice, account_token, "tiny-b", 3),
                 *demand(stack, alice, account_token, "tiny-a", 3)]

        assert [job["state"] for job in ended] == ["succeeded"] * 9, [j.get("error") for j in ended]
        # A copy asked for late may still be loading (a model a worker loads for the first time has
        # its realtime slots measured): every action ends, none fails or goes missing.
        seen = settled(staff)
        log = [(p["action"], p["model_id"], p["outcome"]) for p in reversed(seen["placement"])]
        assert ("unload", "tiny-a", "unloaded") in log and ("load", "tiny-b", "loaded") in log, log
        assert all(outcome in ("loaded", "unloaded", "kept") for _, _, outcome in log), log
        for worker in seen["workers"]:
            assert {m["model_id"] for m in worker["installed"]} == {"tiny-a", "tiny-b"}
            assert len(worker["models"]) <= 1  # the budget holds one
            assert worker["gpu"]["total_mib"] == int(BUDGET_MIB)
