"""End to end: real Daphne, a real `runworker_gpu --device cpu` on the tiny model, REST from outside.

Runs on SQLite by default; on PostgreSQL and Redis when DATABASE_URL/REDIS_URL are set (CI's second
pass), each test on a fresh database of its own.
"""
from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

JOB_DEADLINE_S = 180.0


class Client:
    """REST as one account, with bounded waits."""

    def __init__(self, stack: Stack, token: str) -> None:
        self.http = httpx.Client(base_url=stack.http_url, headers={"Authorization": f"Token {token}"}, timeout=30,
                                 trust_env=False)

    def submit(self, **body: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/jobs/", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/jobs/{job_id}/")
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, job_id: str, *states: str, timeout: float = JOB_DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                job = self.job(job_id)
            except httpx.TransportError:  # the API is restarting
                job = {"state": None}
            if job["state"] in states or job["state"] in ("failed", "cancelled"):
                return job
            assert time.monotonic() < deadline, f"job {job_id} not {states} within {timeout}s: {job}"
            time.sleep(0.1)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(workdir=tmp_path) as running:
        yield running


@pytest.fixture
def served(stack: Stack) -> tuple[Stack, Client, Path]:
    """The API and one CPU worker serving the tiny model."""
    account_token, worker_token = stack.prepare()
    models_dir = stack.workdir / "models"
    manifest = Path(stack.manage("make_tiny_model", str(models_dir / "tiny")))
    assert manifest.is_absolute() and manifest.is_file()
    assert stack.manage("load_manifests", str(manifest)) == "loaded 1"
    stack.start_api()
    stack.start_worker(worker_token, models_dir, "--threads", "1")
    return stack, Client(stack, account_token), manifest.parent


def direct_pixels(model_dir: Path, params: dict[str, Any]) -> bytes:
    """The image of calling the diffusers pipeline directly with the job's seed."""
    import torch
    from diffusers import StableDiffusionPipeline

    torch.set_num_threads(1)
    pipe = StableDiffusionPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    image = pipe(prompt=params["prompt"], negative_prompt=None, height=params["height"], width=params["width"],
                 num_inference_steps=params["steps"], guidance_scale=7.5,
                 generator=torch.Generator("cpu").manual_seed(params["seed"])).images[0]
    return image.convert("RGB").tobytes()


def test_it_routes_a_job_to_the_tiny_model_and_serves_the_seeded_png(served: tuple[Stack, Client, Path]) -> None:
    from PIL import Image

    stack, client, model_dir = served
    params = {"prompt": "a small red circle", "width": 64, "height": 64, "steps": 2, "seed": 1234}
    job = client.submit(tier="draft", capabilities=["txt2img"], params=params)
    assert job["model_id"] == "tiny-sd" and job["state"] in ("queued", "dispatched")

    done = client.wait(job["id"], "succeeded")
    assert done["state"] == "succeeded", done
    assert done["attempts"] == 1 and done["worker_id"] and done["started_at"] and done["finished_at"]
    assert done["progress"] == {"step": 2, "steps": 2}

    png = client.http.get(done["images"][0])
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    image = Image.open(io.BytesIO(png.content))
    assert image.format == "PNG" and image.size == (64, 64)
    if (os.environ.get("STACK_WORKER_DEVICE") or "cpu") == "cpu":
        assert image.convert("RGB").tobytes() == direct_pixels(model_dir, params)
    else:  # a GPU's arithmetic is not the CPU's: the same seed must still give the same image
        again = client.wait(client.submit(model_id="tiny-sd", params=params)["id"], "succeeded")
        assert client.http.get(again["images"][0]).content == png.content


def test_it_loses_no_job_when_the_api_is_killed_and_restarted(served: tuple[Stack, Client, Path]) -> None:
    stack, client, _ = served
    params = {"prompt": "a long job", "width": 64, "height": 64, "steps": 40, "seed": 7}
    running = client.submit(model_id="tiny-sd", params=params)
    queued = [client.submit(model_id="tiny-sd", params={**params, "steps": 2, "seed": n}) for n in range(3)]
    assert client.wait(running["id"], "running")["state"] == "running"

    stack.kill(stack.processes[0])
    stack.start_api()  # same port and database; the worker reconnects by itself

    for job in [running, *queued]:
        done = client.wait(job["id"], "succeeded")
        assert done["state"] == "succeeded", done
        assert done["attempts"] == 1, f"dispatched twice: {done}"
