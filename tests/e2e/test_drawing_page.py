"""The drawing page in a real headless Chromium (Debian's `chromium`, driven by Playwright from PyPI)
against real Daphne, with a fake worker socket that answers every frame.

Skipped where Playwright or /usr/bin/chromium is missing. Never runs `playwright install`: the
browser is the system's.
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

from tests.support.stack import Stack
from tests.support.worker_thread import WorkerThread

CHROMIUM = Path("/usr/bin/chromium")
playwright_sync = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed",
                                      exc_type=ImportError)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}")]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOT = Path("/tmp/drawing.png")
WAIT_MS = 15_000
LIVE = "Live: tiny-sd repaints your drawing as you draw."
LIMITED = re.compile(r"^You already have 2 drawing sessions open .*starts by itself when one of them closes\.$")
ALICE_PASSWORD = "harbour-lights-at-dusk"  # passes Django's password validators (create_account applies them)
MANIFESTS = [
    {"model_id": "tiny-sd", "tier": "draft", "cost": 1.0, "capabilities": ["txt2img", "img2img"]},
    {"model_id": "big-sd", "tier": "premium", "cost": 5.0, "capabilities": ["txt2img", "img2img"]},
    {"model_id": "text-only", "tier": "draft", "cost": 0.5, "capabilities": ["txt2img"]},
]


def inverted(png_b64: str) -> str:
    """The worker's 'output': the browser's canvas with its colours inverted, as bare base64 PNG."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB")
    out = io.BytesIO()
    ImageOps.invert(image).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


class FrameWorker(WorkerThread):
    """A worker on /ws/worker/ (the `websockets` package, in its own thread and event loop) that
    accepts every session_start and answers every frame with a frame_result."""

    def __init__(self, ws_url: str, token: str, *, worker_id: str = "fake-gpu:0", slots: int = 1) -> None:
        super().__init__(ws_url, token, name="frame-worker")
        self.worker_id, self.slots = worker_id, slots
        self.stopping: asyncio.Event | None = None
        self.connections = 0  # hellos answered with welcome

    def frames(self) -> list[dict[str, Any]]:
        return [m for m in list(self.received) if m.get("type") == "frame"]

    async def serve(self) -> None:
        """Connect, say hello and answer; connect again whenever the API drops the socket."""
        import websockets

        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        while not self.stopping.is_set():
            try:
                await self.serve_once()
            except (OSError, websockets.ConnectionClosed):
                if self.connections == 0:
                    raise
                await asyncio.sleep(0.2)  # the API is restarting: try again

    async def serve_once(self) -> None:
        import websockets

        assert self.stopping is not None
        async with websockets.connect(self.url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "hello", "worker_id": self.worker_id, "gpu": None, "models": [
                {"model_id": m["model_id"], "rung": "full", "realtime": True, "frame_ms_p95": 40.0,
                 "realtime_slots": self.slots} for m in MANIFESTS]}))
            welcome = json.loads(await ws.recv())
            assert welcome["type"] == "welcome", welcome
            self.connections += 1
            self.welcomed.set()
            tasks = [asyncio.create_task(self.beat(ws, welcome["heartbeat_seconds"])),
                     asyncio.create_task(self.answer(ws))]
            stopping = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([stopping, tasks[1]], return_when=asyncio.FIRST_COMPLETED)
            for task in [*tasks, stopping]:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, (OSError, websockets.ConnectionClosed)):
                    raise result

    async def beat(self, ws: Any, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await ws.send(json.dumps({"type": "heartbeat"}))

    async def answer(self, ws: Any) -> None:
        async for raw in ws:
            message = json.loads(raw)
            self.received.append(message)
            if message["type"] == "session_start":
                await ws.send(json.dumps({"type": "session_accepted", "session_id": message["session_id"]}))
            elif message["type"] == "frame":
                await ws.send(json.dumps({"type": "frame_result", "session_id": message["session_id"],
                                          "seq": message["seq"], "image": inverted(message["image"]),
                                          "gpu_ms": 5.0, "batch_size": 1}))

    def stop(self) -> None:
        if self.loop is not None and self.stopping is not None and self.is_alive():
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Stack, FrameWorker]]:
    """Daphne on a fresh database with alice (password ALICE_PASSWORD), three models, and a fake worker
    holding one realtime slot per model."""
    with Stack(workdir=tmp_path) as stack:
        stack.manage("migrate", "--noinput")
        stack.manage("create_account", "alice", "--password", ALICE_PASSWORD)
        worker_token = stack.manage("create_worker_token", "browser-test")
        manifests = tmp_path / "manifests.json"
        manifests.write_text(json.dumps([
            {**m, "pipeline": "StableDiffusionPipeline", "source": f"models/{m['model_id']}",
             "params_schema": {"type": "object", "properties": {"prompt": {"type": "string"}}}}
            for m in MANIFESTS]))
        assert stack.manage("load_manifests", str(manifests)) == "loaded 3"
        stack.start_api()
        with FrameWorker(stack.ws_url, worker_token) as worker:
            yield stack, worker


def test_it_draws_shows_and_saves_the_output_and_recovers_from_the_session_limit(
        served: tuple[Stack, FrameWorker]) -> None:
    from playwright.sync_api import expect, sync_playwright

    stack, worker = served
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = chromium.new_context(viewport={"width": 1000, "height": 720})
            page = context.new_page()

            # 1. The page asks for a login, and the login form leads back to it.
            page.goto(f"{stack.http_url}/")
            expect(page).to_have_url(f"{stack.http_url}/accounts/login/?next=/")
            page.fill("#id_username", "alice")
            page.fill("#id_password", ALICE_PASSWORD)
            page.click("button[type=submit]")
            expect(page).to_have_url(f"{stack.http_url}/")

            # 2. The img2img models are offered, the cheapest picked; the session goes live.
            options = page.locator("#model option")
            expect(options).to_have_count(2)
            assert page.locator("#model").input_value() == "tiny-sd"
            expect(page.locator("#status")).to_have_text(LIVE, timeout=WAIT_MS)
            assert worker.frames() == [], "a frame was sent before anything was drawn"

            # 3. A stroke goes out as a frame; the worker's answer shows as the output image.
            page.fill("#prompt", "a blue wave")
            box = page.locator("#canvas").bounding_box()
            assert box is not None
            page.mouse.move(box["x"] + 60, box["y"] + 80)
            page.mouse.down()
            for step in range(1, 21):
                page.mouse.move(box["x"] + 60 + step * 12, box["y"] + 80 + (step % 5) * 20)
            page.mouse.up()
            expect(page.locator("#output")).to_have_attribute("src", re.compile(r"^data:image/png;base64,"),
                                                              timeout=WAIT_MS)
            frames = worker.frames()
            assert frames and frames[-1]["params"] == {"prompt": "a blue wave", "strength": 0.6}
            assert [f["seq"] for f in frames] == sorted({f["seq"] for f in frames}), "seqs must grow"
            page.wait_for_function(
                "() => !document.getElementById('output').src.endsWith('base64,') && "
                "document.getElementById('output').naturalWidth === 256")
            page.screenshot(path=str(SCREENSHOT), full_page=True)

            # Nothing changes on the page: no more frames go out (a fixed wait only to prove an absence).
            page.wait_for_timeout(1500)
            settled = len(worker.frames())
            page.wait_for_timeout(1000)
            assert len(worker.frames()) == settled, "frames were sent although nothing changed"

            # The output can be saved, and the page shows the frames' latency and rate.
            expect(page.locator("#meter")).to_have_text(re.compile(r"^\d+ ms a frame · \d+\.\d frames/s$"))
            with page.expect_download() as download:
                page.click("#save")
            saved = Path(download.value.path()).read_bytes()
            assert saved[:8] == b"\x89PNG\r\n\x1a\n" and download.value.suggested_filename.endswith(".png")
            assert saved == base64.b64decode((page.locator("#output").get_attribute("src") or ",").split(",", 1)[1])

            # 4. A second page of the same account waits for the one slot; a third is at the account's
            # limit (4003) and says so in words.
            second = context.new_page()
            second.goto(f"{stack.http_url}/")
            expect(second.locator("#status")).to_have_text("Waiting for a free GPU: you are number 1 in line.",
                                                           timeout=WAIT_MS)
            third = context.new_page()
            third.goto(f"{stack.http_url}/")
            expect(third.locator("#status")).to_have_text(LIMITED, timeout=WAIT_MS)

            # 5. The first page closes: the second goes live on the freed slot, and the third, told by
            # the closing tab, joins the queue by itself.
            page.close()
            expect(second.locator("#status")).to_have_text(LIVE, timeout=WAIT_MS)
            expect(third.locator("#status")).to_have_text("Waiting for a free GPU: you are number 1 in line.",
                                                          timeout=WAIT_MS)
        finally:
            chromium.close()


def log_in(page: Any, stack: Stack) -> None:
    from playwright.sync_api import expect

    page.goto(f"{stack.http_url}/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", ALICE_PASSWORD)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{stack.http_url}/")


def stroke(page: Any, dx: int, dy: int) -> None:
    box = page.locator("#canvas").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + dx, box["y"] + dy)
    page.mouse.down()
    for step in range(1, 11):
        page.mouse.move(box["x"] + dx + step * 10, box["y"] + dy + (step % 3) * 15)
    page.mouse.up()


def wait_for(predicate: Any, what: str, timeout: float = WAIT_MS / 1000) -> None:
    """Poll a condition the page cannot report (what the fake worker received) until a deadline."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_it_reconnects_after_the_api_restarts_and_sends_the_canvas_again(
        served: tuple[Stack, FrameWorker]) -> None:
    from playwright.sync_api import expect, sync_playwright

    stack, worker = served
    api = next(p for p in stack.processes if p.name == "daphne")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = chromium.new_context(viewport={"width": 1000, "height": 720}).new_page()
            log_in(page, stack)
            expect(page.locator("#status")).to_have_text(LIVE, timeout=WAIT_MS)
            stroke(page, 60, 80)
            expect(page.locator("#output")).to_have_attribute("src", re.compile(r"^data:image/png;base64,.+"),
                                                              timeout=WAIT_MS)
            first_output = page.locator("#output").get_attribute("src")
            page.evaluate(RECORD_STATUSES)

            # The API dies; the page says so and keeps trying.
            stack.kill(api)
            expect(page.locator("#status")).to_contain_text("Reconnecting in", timeout=WAIT_MS)
            before = worker.frames()[-1]
            canvas = page.evaluate("() => document.getElementById('canvas').toDataURL('image/png')")

            # The API comes back on the same address: the page (and the worker) reconnect by themselves,
            # the new session goes live, and the canvas drawn so far is sent to it without a new stroke.
            api = stack.start_api()  # the page's API process, on the stack's port
            expect(page.locator("#status")).to_have_text(LIVE, timeout=2 * WAIT_MS)
            assert worker.connections == 2
            wait_for(lambda: any(f["seq"] > before["seq"] for f in worker.frames()),
                     "the canvas to be sent to the new session")
            resent = next(f for f in worker.frames() if f["seq"] > before["seq"])
            assert resent["session_id"] != before["session_id"], "a restarted API starts a new session"
            assert resent["image"] == canvas.split(",", 1)[1], "the new session gets the canvas as drawn"

            # Drawing goes on: a new stroke gives a new output.
            stroke(page, 300, 200)
            expect(page.locator("#output")).not_to_have_attribute("src", first_output or "", timeout=WAIT_MS)
            seqs = [f["seq"] for f in worker.frames()]
            assert seqs == sorted(set(seqs)), "frame numbers keep growing across the reconnect"

            # Each try waited a random time up to its doubling cap (full jitter); and, the session live
            # again, the next drop starts the backoff afresh (its first wait under the first cap).
            waits = reconnect_waits(page)
            assert len(waits) >= 2 and all(w <= min(15.0, 0.5 * 2**n) for n, w in enumerate(waits)), waits
            page.evaluate(RECORD_STATUSES)
            stack.kill(api)  # the first listed daphne is the one killed before, with two API processes
            expect(page.locator("#status")).to_contain_text("Reconnecting in", timeout=WAIT_MS)
            assert reconnect_waits(page)[0] <= 0.5
        finally:
            chromium.close()


# Keeps every text the status line shows (the page replaces it between tries).
RECORD_STATUSES = """() => {
  const status = document.getElementById('status');
  window.statuses = [];
  new MutationObserver(() => window.statuses.push(status.textContent))
    .observe(status, {childList: true, characterData: true, subtree: true});
}"""


def reconnect_waits(page: Any) -> list[float]:
    """The waits the status line announced ("Reconnecting in X s…") since RECORD_STATUSES, in order."""
    texts = page.evaluate("() => window.statuses")
    return [float(m.group(1)) for text in texts if (m := re.search(r"Reconnecting in (\d+\.\d) s", text))]
