"""Job dispatch: submit -> `job` message latency and sustained jobs/s, beside Celery + Redis.

In one run, on loopback:
  1. potocolom: Daphne on a fresh database (SQLite, or PostgreSQL/Redis when DATABASE_URL/REDIS_URL
     are set), fake workers that finish each job at once. Latency: POST /api/v1/jobs/ -> the worker
     receives `job`, one job at a time (no queueing), p50/p99. Throughput: N jobs submitted by 8
     concurrent clients, from the first POST to the last job_result.
  2. Celery 5 + Redis, a no-op task, one prefork worker with prefetch 1: `.delay()` -> task start,
     p50/p99, one at a time; then N tasks queued at once and drained.
  3. The real worker on the tiny model, back-to-back jobs: how long its denoising loop sat idle
     between jobs, from the worker's own timings (goal < 5%).

    .venv/bin/python bench/dispatch.py [--jobs 1000] [--real-jobs 8]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets  # noqa: E402

from tests.support.stack import ROOT, TINY_PNG_B64, Stack, fake_manifest  # noqa: E402

MODEL = "bench-model"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def describe(name: str, latencies_ms: list[float], per_second: float) -> str:
    return (f"{name:<34} p50 {statistics.median(latencies_ms):6.2f} ms   p99 {percentile(latencies_ms, 99):6.2f} ms"
            f"   {per_second:7.0f} jobs/s")


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive JSON client on asyncio streams: it costs ~0.1 ms a request, so
    the latency measured is the API's, not the client library's (httpx adds several ms here)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        return await self.request("POST", path, json.dumps(body).encode())

    async def get(self, path: str) -> tuple[int, dict]:
        return await self.request("GET", path, b"")

    async def request(self, method: str, path: str, data: bytes) -> tuple[int, dict]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Token {self.token}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return int(status_line.split()[1]), json.loads(payload)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class FakeWorker:
    """The worker side of the socket: records when each job arrives and finishes it at once."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.arrived: dict[str, float] = {}
        self.finished = 0
        self.ready = asyncio.Event()

    async def run(self) -> None:
        async with websockets.connect(self.url, max_size=None, compression=None) as ws:
            await ws.send(json.dumps({"type": "hello", "worker_id": self.name, "gpu": None, "models": [
                {"model_id": MODEL, "rung": "full", "realtime": False, "frame_ms_p95": None, "realtime_slots": 0}]}))
            async for raw in ws:
                message = json.loads(raw)
                if message["type"] == "welcome":
                    self.ready.set()
                elif message["type"] == "job":
                    self.arrived[message["job_id"]] = time.perf_counter()
                    await ws.send(json.dumps({"type": "job_started", "job_id": message["job_id"]}))
                    await ws.send(json.dumps({"type": "job_result", "job_id": message["job_id"],
                                              "images": [TINY_PNG_B64], "gpu_ms": 0.0, "rung": "full"}))
                    self.finished += 1


async def bench_potocolom(stack: Stack, account_token: str, worker_token: str, jobs: int) -> tuple[list[float], float]:
    workers = [FakeWorker(f"{stack.ws_url}/ws/worker/?token={worker_token}", f"bench-{n}:0") for n in range(2)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.gather(*(w.ready.wait() for w in workers))
    clients = [KeepAliveClient("127.0.0.1", stack.port, account_token) for _ in range(8)]
    free = list(clients)

    async def submit(n: int) -> str:
        client = free.pop()
        try:
            status, job = await client.post("/api/v1/jobs/", {"model_id": MODEL, "params": {"prompt": f"job {n}"}})
        finally:
            free.append(client)
        assert status == 201, job
        return str(job["id"])

    def arrived(job_id: str) -> float | None:
        return next((w.arrived[job_id] for w in workers if job_id in w.arrived), None)

    for n in range(20):  # warm-up: connections, caches
        await submit(n)
    latencies = []
    for n in range(jobs):
        started = time.perf_counter()
        job_id = await submit(n)
        while (at := arrived(job_id)) is None:
            await asyncio.sleep(0.0005)
        latencies.append((at - started) * 1000)
        # let the API store this job's result before the next submit, so each latency is alone
        while (await free[0].get(f"/api/v1/jobs/{job_id}/"))[1]["state"] != "succeeded":
            pass
    done_before = sum(w.finished for w in workers)
    started = time.perf_counter()
    counter = iter(range(jobs))

    async def submitter() -> None:
        for n in counter:
            await submit(n)

    await asyncio.gather(*(submitter() for _ in range(8)))
    while sum(w.finished for w in workers) < done_before + jobs:
        await asyncio.sleep(0.005)
    throughput = jobs / (time.perf_counter() - started)
    for client in clients:
        await client.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return latencies, throughput


def bench_celery(jobs: int) -> tuple[list[float], float] | str:
    try:
        import redis

        from bench import celery_app
    except ImportError as exc:
        return f"unavailable ({exc})"
    client = redis.Redis.from_url(celery_app.BROKER)
    try:
        client.flushdb()
    except redis.RedisError as exc:
        return f"unavailable (no Redis at {celery_app.BROKER}: {exc})"
    log = open(Path(tempfile.gettempdir()) / "bench-celery-worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--concurrency", "1",
                               "--prefetch-multiplier", "1", "--pool", "prefork", "--without-gossip",
                               "--without-mingle", "--without-heartbeat", "-l", "warning"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(20):  # warm-up, and wait for the worker to be up
            celery_app.noop.delay(time.time())
            client.blpop([celery_app.STARTS], timeout=60)
        latencies = []
        for _ in range(jobs):
            celery_app.noop.delay(time.time())
            _, value = client.blpop([celery_app.STARTS], timeout=30)
            latencies.append(float(value) * 1000)
        started = time.perf_counter()
        for _ in range(jobs):
            celery_app.noop.delay(time.time())
        for _ in range(jobs):
            client.blpop([celery_app.STARTS], timeout=30)
        return latencies, jobs / (time.perf_counter() - started)
    finally:
        worker.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(10)
        if worker.poll() is None:
            worker.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--real-jobs", type=int, default=8, help="back-to-back jobs for the real worker (0: skip)")
    args = parser.parse_args()
    print(f"database: {'PostgreSQL' if os.environ.get('DATABASE_URL', '').startswith('postgres') else 'SQLite'}, "
          f"channel layer: {'Redis' if os.environ.get('REDIS_URL') else 'in-memory'}, {args.jobs} jobs\n")
    # One account submits every job as fast as it can: lift its submission rate out of the way.
    with Stack(JOB_SUBMIT_RATE="1000000/minute", ACCOUNT_JOB_LIMIT="1000000") as stack:
        account_token, worker_token = stack.prepare()
        stack.register(fake_manifest(MODEL))
        stack.start_api()
        ours = asyncio.run(bench_potocolom(stack, account_token, worker_token, args.jobs))
    celery = bench_celery(args.jobs)
    print("submit -> job start, one at a time; jobs/s with a queue of N")
    print(describe("potocolom (REST -> worker socket)", *ours))
    if isinstance(celery, str):
        print(f"{'Celery + Redis baseline':<34} {celery}")
    else:
        print(describe("Celery + Redis (.delay -> start)", *celery))
        verdict = "met" if statistics.median(ours[0]) <= statistics.median(celery[0]) else "NOT met"
        print(f"goal p50 no worse than Celery's: {verdict}")
    if args.real_jobs:
        from bench.worker_idle import bench_worker_idle

        print()
        bench_worker_idle(args.real_jobs)


if __name__ == "__main__":
    main()
