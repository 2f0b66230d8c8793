"""Live drawing sessions: relay overhead, frames/s with the real worker, freed slot -> next session
live, and the API's memory per idle session.

In one run, on loopback (SQLite, or PostgreSQL/Redis when DATABASE_URL/REDIS_URL are set):
  (a) relay overhead: browser -> API -> worker -> API -> browser with a fake worker in this process
      that answers each frame at once (worker time ~0), one frame at a time, p50/p95; beside a raw
      `websockets` echo server in this process and a Daphne round trip (an invalid browser message,
      answered at once with `{"type": "error"}`). Goal p50 < 3 ms and p95 < 8 ms (in-memory layer),
      p95 < 15 ms (Redis).
  (b) frames/s with the real worker (runworker_gpu, tiny model on CPU, 2 threads) at 1, 2, 4 and 8
      sessions, each sending its next frame as soon as its previous one comes back; batching on
      (runworker_gpu as is) and off (runworker_gpu --max-batch 1).
      Goal fps(4) >= 1.5x fps(1) with batching on.
  (c) freed slot -> next session live: a fake worker with 1 slot, A live, B queued, close A, time
      until B gets `live`, p95. Goal < 50 ms.
  (d) 500 idle (queued) sessions of one account held by one Daphne: its VmRSS growth per session.

    .venv/bin/python bench/realtime.py [--frames 500] [--seconds 10] [--repeats 30] [--idle 500]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets  # noqa: E402

from tests.support.stack import TINY_PNG_B64, BenchWorker, Process, Stack, fake_manifest, next_of  # noqa: E402

MODEL = "bench-live"
WAIT_S = 120.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def describe(name: str, latencies_ms: list[float]) -> str:
    return f"  {name:<44} p50 {statistics.median(latencies_ms):6.2f} ms   p95 {percentile(latencies_ms, 95):6.2f} ms"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


async def with_fake_worker(stack: Stack, worker_token: str, slots: int, name: str) -> tuple[BenchWorker, asyncio.Task]:
    worker = BenchWorker(f"{stack.ws_url}/ws/worker/?token={worker_token}", name, MODEL, slots=slots)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 30)
    return worker, task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def frame_message(seq: int, image: str) -> str:
    return json.dumps({"type": "frame", "seq": seq, "image": image, "params": {"prompt": "bench", "strength": 0.6}})


async def raw_echo(frames: int, payload: str) -> list[float]:
    async def echo(ws: Any) -> None:
        async for message in ws:
            await ws.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with websockets.connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            latencies = []
            for n in range(frames + 20):
                started = time.perf_counter()
                await ws.send(payload)
                await ws.recv()
                if n >= 20:
                    latencies.append((time.perf_counter() - started) * 1000)
    return latencies


async def part_a(stack: Stack, account_token: str, worker_token: str, frames: int) -> dict[str, list[float]]:
    _, worker = await with_fake_worker(stack, worker_token, 8, "bench-relay:0")
    url = f"{stack.ws_url}/ws/session/?model_id={MODEL}&token={account_token}"
    image = "data:image/png;base64," + TINY_PNG_B64
    results: dict[str, list[float]] = {}
    try:
        async with websockets.connect(url, max_size=None, compression=None) as ws:
            await next_of(ws, {"type": "state", "state": "live"})
            relay = []
            for seq in range(1, frames + 21):
                started = time.perf_counter()
                await ws.send(frame_message(seq, image))
                await next_of(ws, {"type": "frame", "seq": seq}, 30)
                if seq > 20:
                    relay.append((time.perf_counter() - started) * 1000)
            daphne = []
            for n in range(frames + 20):
                started = time.perf_counter()
                await ws.send(json.dumps({"type": "bogus", "n": n}))
                await next_of(ws, {"type": "error"}, 30)
                if n >= 20:
                    daphne.append((time.perf_counter() - started) * 1000)
        results["relay"] = relay
        results["daphne"] = daphne
    finally:
        await stop(worker)
    results["raw"] = await raw_echo(frames, frame_message(1, image))
    return results


async def part_c(stack: Stack, account_token: str, worker_token: str, repeats: int) -> list[float]:
    _, worker = await with_fake_worker(stack, worker_token, 1, "bench-handover:0")
    url = f"{stack.ws_url}/ws/session/?model_id={MODEL}&token={account_token}"
    handovers = []
    try:
        for _ in range(repeats):
            a = await websockets.connect(url, compression=None)
            await next_of(a, {"type": "state", "state": "live"})
            b = await websockets.connect(url, compression=None)
            await next_of(b, {"type": "state", "state": "queued"})
            b_live = asyncio.create_task(next_of(b, {"type": "state", "state": "live"}, 30))
            await asyncio.sleep(0.01)
            started = time.perf_counter()
            await a.close()
            await b_live
            handovers.append((time.perf_counter() - started) * 1000)
            await b.close()
            await asyncio.sleep(0.05)  # let the API free B's slot before the next A
    finally:
        await stop(worker)
    return handovers


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def part_d(stack: Stack, api: Process, account_token: str, count: int) -> tuple[int, int]:
    assert api.proc is not None
    url = f"{stack.ws_url}/ws/session/?model_id={MODEL}&token={account_token}"
    await asyncio.sleep(1)
    before = vm_rss_kib(api.proc.pid)
    sockets = []
    try:
        for _ in range(count):  # no worker is connected: every session waits in the queue
            ws = await websockets.connect(url, compression=None)
            await next_of(ws, {"type": "state", "state": "queued"}, 30)
            sockets.append(ws)
        await asyncio.sleep(1)
        after = vm_rss_kib(api.proc.pid)
    finally:
        for ws in reversed(sockets):  # the last first: nobody's position changes
            with contextlib.suppress(Exception):
                await ws.close()
    return before, after


def canvas_png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def drive(stack: Stack, account_token: str, sessions: int, seconds: float) -> float | str:
    """Frames/s served to `sessions` sessions, each sending its next frame when its last comes back."""
    url = f"{stack.ws_url}/ws/session/?model_id=tiny-sd&token={account_token}"
    image = canvas_png()
    sockets = [await websockets.connect(url, max_size=None, compression=None) for _ in range(sessions)]
    try:
        try:
            await asyncio.gather(*(next_of(ws, {"type": "state", "state": "live"}) for ws in sockets))
        except TimeoutError:
            return "not measured (not every session got a slot)"
        for ws in sockets:  # warm-up frame each
            await ws.send(frame_message(1, image))
        await asyncio.gather(*(next_of(ws, {"type": "frame", "seq": 1}) for ws in sockets))
        done = [0] * sessions
        deadline = time.perf_counter() + seconds
        started = time.perf_counter()

        async def loop(n: int, ws: Any) -> None:
            seq = 1
            while time.perf_counter() < deadline:
                seq += 1
                await ws.send(frame_message(seq, image))
                await next_of(ws, {"type": "frame", "seq": seq})
                done[n] += 1

        await asyncio.gather(*(loop(n, ws) for n, ws in enumerate(sockets)))
        return sum(done) / (time.perf_counter() - started)
    finally:
        for ws in reversed(sockets):
            with contextlib.suppress(Exception):
                await ws.close()
        await asyncio.sleep(0.5)  # the slots are freed before the next round


def part_b(counts: list[int], seconds: float) -> dict[str, dict[int, float | str]]:
    settings = {"FRAME_BUDGET_MS": "60000", "ACCOUNT_SESSION_LIMIT": "16", "SESSION_IDLE_SECONDS": "300"}
    results: dict[str, dict[int, float | str]] = {}
    with Stack(**settings) as stack:
        account_token, worker_token = stack.prepare()
        models_dir = stack.workdir / "models"
        manifest = stack.manage("make_tiny_model", str(models_dir / "tiny"))
        stack.manage("load_manifests", manifest)
        stack.start_api()
        worker_options = {"batching on": (), "batching off": ("--max-batch", "1")}
        for mode, extra in worker_options.items():
            worker = stack.start_worker(worker_token, models_dir, "--threads", "2", "--frame-budget-ms", "60000",
                                        *extra)
            try:
                results[mode] = {n: asyncio.run(drive(stack, account_token, n, seconds)) for n in counts}
            except Exception as exc:  # noqa: BLE001 - a failed mode is reported, the others still run
                results[mode] = {n: f"not measured ({type(exc).__name__}: {exc})" for n in counts}
            finally:
                worker.stop()
                time.sleep(1)  # the API notices the closed socket before the next worker says hello
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=500, help="frames for the relay round trip (a)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per session count (b)")
    parser.add_argument("--sessions", default="1,2,4,8", help="session counts for (b)")
    parser.add_argument("--repeats", type=int, default=30, help="handovers for (c)")
    parser.add_argument("--idle", type=int, default=500, help="idle sessions for (d)")
    args = parser.parse_args()
    redis = bool(os.environ.get("REDIS_URL"))
    print(f"database: {'PostgreSQL' if os.environ.get('DATABASE_URL', '').startswith('postgres') else 'SQLite'}, "
          f"channel layer: {'Redis' if redis else 'in-memory'}\n")

    with Stack(ACCOUNT_SESSION_LIMIT=str(max(args.idle, 2) + 10), SESSION_IDLE_SECONDS="300") as stack:
        account_token, worker_token = stack.prepare()
        stack.register(fake_manifest(MODEL, ("txt2img", "img2img")))
        api = stack.start_api()

        print(f"(a) relay overhead, one frame at a time, {args.frames} frames (fake worker answers at once)")
        try:
            a = asyncio.run(part_a(stack, account_token, worker_token, args.frames))
            print(describe("browser -> API -> worker -> API -> browser", a["relay"]))
            print(describe("Daphne round trip (invalid message -> error)", a["daphne"]))
            print(describe("raw websockets echo (same process)", a["raw"]))
            p50, p95 = statistics.median(a["relay"]), percentile(a["relay"], 95)
            if redis:
                print(f"  goal p95 < 15 ms (Redis): {verdict(p95 < 15)}")
            else:
                print(f"  goal p50 < 3 ms and p95 < 8 ms (in-memory): {verdict(p50 < 3 and p95 < 8)}")
        except Exception as exc:  # noqa: BLE001
            print(f"  not measured ({type(exc).__name__}: {exc})")

        print(f"\n(c) freed slot -> next session live, {args.repeats} handovers (fake worker, 1 slot)")
        try:
            c = asyncio.run(part_c(stack, account_token, worker_token, args.repeats))
            print(describe("close A -> B gets live", c))
            print(f"  goal p95 < 50 ms: {verdict(percentile(c, 95) < 50)}")
        except Exception as exc:  # noqa: BLE001
            print(f"  not measured ({type(exc).__name__}: {exc})")

        print(f"\n(d) {args.idle} idle (queued) sessions of one account, one Daphne process")
        try:
            before, after = asyncio.run(part_d(stack, api, account_token, args.idle))
            print(f"  Daphne VmRSS {before / 1024:.1f} MiB -> {after / 1024:.1f} MiB: "
                  f"{(after - before) / args.idle:.1f} KiB per session")
        except Exception as exc:  # noqa: BLE001
            print(f"  not measured ({type(exc).__name__}: {exc})")

    counts = [int(n) for n in args.sessions.split(",") if n]
    print(f"\n(b) frames/s with the real worker (tiny model on CPU, 2 threads), {args.seconds:g} s per count")
    b = part_b(counts, args.seconds)
    for mode, figures in b.items():
        line = "   ".join(f"{n}: {v:6.1f}" if isinstance(v, float) else f"{n}: {v}" for n, v in figures.items())
        print(f"  {mode:<13} sessions -> frames/s   {line}")
    on = b.get("batching on", {})
    if isinstance(on.get(1), float) and isinstance(on.get(4), float):
        ratio = on[4] / on[1]
        print(f"  fps(4)/fps(1) with batching on: {ratio:.2f}x   goal >= 1.5x: {verdict(ratio >= 1.5)}")
        off = b.get("batching off", {})
        if isinstance(off.get(1), float) and isinstance(off.get(4), float):
            print(f"  fps(4)/fps(1) with batching off: {off[4] / off[1]:.2f}x")
    else:
        print("  fps(4)/fps(1): not measured")


if __name__ == "__main__":
    main()
