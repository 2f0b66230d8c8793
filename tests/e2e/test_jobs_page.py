"""The jobs page in a real headless Chromium (Debian's `chromium`, driven by Playwright) against real
Daphne, with a scripted v2 worker socket: a job submitted from the form shows its progress, preview,
place, estimated wait and image live, and pauses, resumes and cancels from its row.

Skipped where Playwright or /usr/bin/chromium is missing (never runs `playwright install`).
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_drawing_page import ALICE_PASSWORD, CHROMIUM, CHROMIUM_ARGS, WAIT_MS, wait_for
from tests.support.stack import Stack
from tests.support.worker_thread import WorkerThread

playwright_sync = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed",
                                      exc_type=ImportError)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}")]

SCREENSHOT = Path("/tmp/jobs.png")
MANIFEST = {"model_id": "tiny-sd", "tier": "draft", "cost": 1.0, "capabilities": ["txt2img"],
            "pipeline": "StableDiffusionPipeline", "source": "models/tiny-sd",
            "params_schema": {"type": "object", "required": ["prompt"], "additionalProperties": False,
                              "properties": {"prompt": {"type": "string"}, "steps": {"type": "integer", "minimum": 1},
                                             "seed": {"type": "integer"}, "width": {"type": "integer"},
                                             "height": {"type": "integer"}}}}


def picture(colour: str, size: int, kind: str) -> str:
    """A plain picture as bare base64 (`kind` PNG or JPEG)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format=kind)
    return base64.b64encode(out.getvalue()).decode()


class JobWorker(WorkerThread):
    """A v2 worker on /ws/worker/ that starts every job it gets, reports step 1 of 2 with a preview,
    and finishes it only when the test calls `finish(job_id)`; a `preempt` is answered at step 1."""

    def __init__(self, ws_url: str, token: str) -> None:
        super().__init__(ws_url, token, name="job-worker")
        self.ws: Any = None

    def jobs(self) -> list[dict[str, Any]]:
        return [m for m in list(self.received) if m.get("type") == "job"]

    def got(self, kind: str, job_id: str) -> bool:
        return any(m.get("type") == kind and m.get("job_id") == job_id for m in list(self.received))

    async def serve(self) -> None:
        import websockets

        self.loop = asyncio.get_running_loop()
        async with websockets.connect(self.url, max_size=None) as ws:
            self.ws = ws
            await ws.send(json.dumps({"type": "hello", "worker_id": "fake-gpu:0", "gpu": None, "protocol": 2,
                                      "jobs": [], "models": [{"model_id": "tiny-sd", "rung": "full",
                                                              "realtime": False, "step_ms": 20.0}]}))
            welcome = json.loads(await ws.recv())
            assert welcome["type"] == "welcome", welcome
            self.welcomed.set()
            async for raw in ws:
                message = json.loads(raw)
                self.received.append(message)
                if message["type"] == "job":
                    job_id = message["job_id"]
                    await ws.send(json.dumps({"type": "job_started", "job_id": job_id}))
                    await ws.send(json.dumps({"type": "job_progress", "job_id": job_id, "step": 1, "steps": 2,
                                              "preview": picture("orange", 64, "JPEG")}))
                elif message["type"] == "preempt":
                    await ws.send(json.dumps({"type": "job_preempted", "job_id": message["job_id"], "step": 1,
                                              "steps": 2, "checkpoint": None}))

    def finish(self, job_id: str) -> None:
        """Send the job's last step and its image."""
        async def send() -> None:
            await self.ws.send(json.dumps({"type": "job_progress", "job_id": job_id, "step": 2, "steps": 2}))
            await self.ws.send(json.dumps({"type": "job_result", "job_id": job_id,
                                           "images": [picture("teal", 32, "PNG")]}))
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(send(), self.loop).result(10)

    def stop(self) -> None:
        if self.loop is not None and self.ws is not None and self.is_alive():
            asyncio.run_coroutine_threadsafe(self.ws.close(), self.loop).result(10)
        self.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Stack, JobWorker]]:
    """Daphne on a fresh database with alice, the tiny-sd manifest and the scripted worker."""
    with Stack(workdir=tmp_path) as stack:
        stack.manage("migrate", "--noinput")
        stack.manage("create_account", "alice", "--password", ALICE_PASSWORD)
        token = stack.manage("create_worker_token", "jobs-page-test")
        stack.register(MANIFEST)
        stack.start_api()
        with JobWorker(stack.ws_url, token) as worker:
            yield stack, worker


def test_a_job_from_the_form_shows_live_and_pauses_resumes_and_cancels(served: tuple[Stack, JobWorker]) -> None:
    from playwright.sync_api import expect, sync_playwright

    stack, worker = served
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = chromium.new_context(viewport={"width": 1200, "height": 800}).new_page()
            page.goto(f"{stack.http_url}/jobs/")
            expect(page).to_have_url(f"{stack.http_url}/accounts/login/?next=/jobs/")
            page.fill("#id_username", "alice")
            page.fill("#id_password", ALICE_PASSWORD)
            page.click("button[type=submit]")
            expect(page).to_have_url(f"{stack.http_url}/jobs/")
            expect(page.locator("#feed")).to_have_text("Following your jobs live.", timeout=WAIT_MS)
            expect(page.locator("#no-jobs")).to_be_visible()

            # 1. A prompt without one is refused on the page; a bad value is explained from the API's answer.
            page.click("#job-submit")
            expect(page.locator("#job-error")).to_have_text("Write a prompt first.")
            page.fill("#job-prompt", "a red kite over the dunes")
            page.fill("#job-steps", "0")
            page.click("#job-submit")
            expect(page.locator("#job-error")).to_contain_text("The job was not taken: ", timeout=WAIT_MS)
            expect(page.locator("#job-rows tr")).to_have_count(0)
            page.fill("#job-steps", "2")
            page.fill("#job-seed", "7")
            page.click("#job-submit")

            # 2. The worker gets the job as submitted; the row shows it running, its progress and preview.
            wait_for(lambda: len(worker.jobs()) == 1, "the job to reach the worker")
            job = worker.jobs()[0]
            job_id = job["job_id"]
            assert job["params"] == {"prompt": "a red kite over the dunes", "steps": 2, "seed": 7}
            row = page.locator(f"#job-{job_id}")
            expect(row.locator(".job-state")).to_have_text("Running", timeout=WAIT_MS)
            expect(row.locator(".job-progress")).to_contain_text("1/2", timeout=WAIT_MS)
            expect(row.locator("img.preview")).to_have_attribute("src", re.compile(r"^data:image/jpeg;base64,.+"),
                                                                 timeout=WAIT_MS)
            expect(row.locator(".job-model")).to_have_text("tiny-sd")

            # 3. A second job waits behind it in line (the worker holds two at most: a third queues).
            page.fill("#job-prompt", "second")
            page.click("#job-submit")
            wait_for(lambda: len(worker.jobs()) == 2, "the second job to reach the worker")
            page.fill("#job-prompt", "third")
            page.click("#job-submit")
            third = page.locator("#job-rows tr").first
            expect(third.locator(".job-prompt")).to_have_text("third", timeout=WAIT_MS)
            queued = re.compile(r"^Queued: number 1 in line, starts in about (under a second|\d+ s)$")
            expect(third.locator(".job-state")).to_have_text(queued, timeout=WAIT_MS)
            third_id = (third.get_attribute("id") or "").removeprefix("job-")
            third.locator("button.action-cancel").click()
            expect(third.locator(".job-state")).to_have_text("Cancelled", timeout=WAIT_MS)
            expect(third.locator("button")).to_have_count(0)

            # 4. Pause: the worker is told, answers at step 1, and the row says paused; resume queues it
            # and the worker gets it again.
            row.locator("button.action-pause").click()
            wait_for(lambda: worker.got("preempt", job_id), "the worker to be asked to stop the job")
            expect(row.locator(".job-state")).to_have_text("Paused", timeout=WAIT_MS)
            row.locator("button.action-resume").click()
            wait_for(lambda: len([j for j in worker.jobs() if j["job_id"] == job_id]) == 2,
                     "the resumed job to reach the worker again")
            expect(row.locator(".job-state")).to_have_text("Running", timeout=WAIT_MS)

            # 5. The worker finishes it: the row says done, with its image, and no more buttons.
            worker.finish(job_id)
            expect(row.locator(".job-state")).to_have_text("Done", timeout=WAIT_MS)
            expect(row.locator("img.thumb")).to_have_count(1)
            page.wait_for_function(f"() => document.querySelector('#job-{job_id} img.thumb').naturalWidth === 32")
            expect(row.locator("img.preview")).to_have_count(0)
            expect(row.locator("button")).to_have_count(0)
            page.screenshot(path=str(SCREENSHOT), full_page=True)

            # 6. A reload lists the same jobs from REST, newest first.
            page.reload()
            expect(page.locator("#job-rows tr")).to_have_count(3, timeout=WAIT_MS)
            expect(page.locator("#job-rows tr").first).to_have_id(f"job-{third_id}")
            expect(page.locator(f"#job-{job_id} .job-state")).to_have_text("Done")
        finally:
            chromium.close()
