"""End to end: a live drawing session on real Daphne and a real `runworker_gpu` on the tiny model.

The session's socket is a plain websocket client (as the drawing page's is): it goes live, draws,
gets repainted frames back, goes idle after SESSION_IDLE_SECONDS without a frame, and comes back
live with its next frame. Budgets are generous so that a busy CI machine still gets a slot.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.support.stack import Stack, next_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
WAIT_S = 120.0  # a frame on a loaded 2-core machine can take seconds


def canvas_png(rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    settings = {"SESSION_IDLE_SECONDS": "2", "SESSION_SWEEP_SECONDS": "1", "FRAME_BUDGET_MS": "60000"}
    with Stack(workdir=tmp_path, **settings) as stack:
        account_token, worker_token = stack.prepare()
        models_dir = stack.workdir / "models"
        manifest = stack.manage("make_tiny_model", str(models_dir / "tiny"))
        stack.manage("load_manifests", manifest)
        stack.start_api()
        stack.start_worker(worker_token, models_dir, "--threads", "1", "--frame-budget-ms", "60000")
        yield stack, account_token


def test_a_session_draws_goes_idle_and_comes_back(served: tuple[Stack, str]) -> None:
    from PIL import Image

    stack, token = served

    async def scenario() -> None:
        url = f"{stack.ws_url}/ws/session/?model_id=tiny-sd&token={token}"
        async with websockets.connect(url, max_size=None) as ws:
            live = await next_of(ws, {"type": "state", "state": "live"})
            assert live["model_id"] == "tiny-sd" and live["worker_id"]

            await ws.send(json.dumps({"type": "frame", "seq": 1, "image": canvas_png((200, 30, 30)),
                                      "params": {"prompt": "a red square", "strength": 0.6}}))
            painted = await next_of(ws, {"type": "frame", "seq": 1})
            assert painted["image"].startswith("data:image/") and painted["ms"] > 0
            image = Image.open(io.BytesIO(base64.b64decode(painted["image"].partition(",")[2])))
            assert image.size == (64, 64)

            await next_of(ws, {"type": "state", "state": "idle"})
            await ws.send(json.dumps({"type": "frame", "seq": 2, "image": canvas_png((30, 30, 200)),
                                      "params": {"prompt": "a blue square"}}))
            await next_of(ws, {"type": "state", "state": "live"})
            await next_of(ws, {"type": "frame", "seq": 2})

    asyncio.run(scenario())
    usage = httpx.get(f"{stack.http_url}/api/v1/usage/", headers={"Authorization": f"Token {token}"}).json()
    assert usage["total_seconds"] > 0 and [m["model_id"] for m in usage["models"]] == ["tiny-sd"]
