"""End to end: /ws/jobs/ on real Daphne. With STACK_API_PROCESSES=2 (PostgreSQL and Redis), alice's
socket is on the first API process and the worker on the second, so the events of her job that
the second handles (running, progress with its preview, succeeded) cross processes to reach her;
bob's socket, naming her job, hears none of them."""
from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import TINY_PNG_B64, Stack, fake_manifest, next_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "fake-a"
PREVIEW = base64.b64encode(b"\xff\xd8\xff a preview").decode()
WAIT_S = 60.0


def submit(stack: Stack, token: str, prompt: str) -> str:
    response = httpx.post(f"{stack.http_url}/api/v1/jobs/", headers={"Authorization": f"Token {token}"},
                          json={"model_id": MODEL, "params": {"prompt": prompt}}, timeout=30, trust_env=False)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def events_until(ws: Any, job_id: str, state: str) -> list[dict[str, Any]]:
    """The messages of one job on a /ws/jobs/ socket, up to its `job` event in `state`."""
    seen: list[dict[str, Any]] = []

    async def read() -> None:
        while True:
            message = json.loads(await ws.recv())
            if message.get("job_id") == job_id or (message.get("job") or {}).get("id") == job_id:
                seen.append(message)
                if message["type"] == "job" and message["job"]["state"] == state:
                    return

    await asyncio.wait_for(read(), WAIT_S)
    return seen


async def scenario(stack: Stack, alice: str, bob: str, worker_token: str) -> None:
    import websockets

    async with websockets.connect(f"{stack.ws_url}/ws/jobs/?token={alice}") as alice_ws, \
            websockets.connect(f"{stack.worker_ws_url}/ws/worker/?token={worker_token}") as worker:
        await worker.send(json.dumps({"type": "hello", "worker_id": "host-e:0", "gpu": None, "protocol": 2,
                                      "jobs": [], "models": [{"model_id": MODEL, "rung": "full", "realtime": False,
                                                              "frame_ms_p95": None, "realtime_slots": 0}]}))
        await next_of(worker, {"type": "welcome"}, timeout=WAIT_S)
        job_id = await asyncio.to_thread(submit, stack, alice, "alice's")
        async with websockets.connect(f"{stack.ws_url}/ws/jobs/?token={bob}&job_id={job_id}") as bob_named, \
                websockets.connect(f"{stack.ws_url}/ws/jobs/?token={bob}") as bob_all:
            await next_of(worker, {"type": "job", "job_id": job_id}, timeout=WAIT_S)
            await worker.send(json.dumps({"type": "job_started", "job_id": job_id}))
            await worker.send(json.dumps({"type": "job_progress", "job_id": job_id, "step": 1, "steps": 2,
                                          "preview": PREVIEW}))
            await worker.send(json.dumps({"type": "job_result", "job_id": job_id, "images": [TINY_PNG_B64],
                                          "gpu_ms": 1.0, "rung": "full"}))
            seen = await events_until(alice_ws, job_id, "succeeded")
            kinds = [m["job"]["state"] if m["type"] == "job" else m["type"] for m in seen]
            assert kinds == ["queued", "dispatched", "running", "job_progress", "succeeded"], kinds
            assert seen[3]["preview"] == "data:image/jpeg;base64," + PREVIEW
            assert len(seen[-1]["job"]["images"]) == 1
            bob_job = await asyncio.to_thread(submit, stack, bob, "bob's")
            first = json.loads(await asyncio.wait_for(bob_all.recv(), WAIT_S))
            assert first["type"] == "job" and first["job"]["id"] == bob_job, first  # nothing of alice's before it
            await bob_named.close()
            assert not [m async for m in bob_named if job_id in str(m)]


def test_job_events_reach_their_owner_across_api_processes(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path) as stack:
        alice, worker_token = stack.prepare()
        bob = stack.manage("create_account", "bob")
        stack.register(fake_manifest(MODEL))
        stack.start_api()
        asyncio.run(scenario(stack, alice, bob, worker_token))
