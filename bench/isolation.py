"""Isolation: no account's request waits on another's (issue 26, "How it is checked"; docs/protocol.md v3).

Two parts, chosen by name (both by default), each against its own baseline from the same run.

  floods  bob (one account) measures his requests, one at a time on one keep-alive connection:
          POST /api/v1/jobs/ (submit), GET /api/v1/jobs/{id}/ (one of his queued jobs), GET
          /api/v1/jobs/ (a page of his list, 50 rows) and GET /api/v1/models/; p50/p99 alone, then
          under each of alice's floods (another account; each flood runs in a process of its own,
          so that its client work is not bob's client's):
            big images    alice's 60 queued jobs, each with a 7 MiB PNG init_image (a valid one:
                          random pixels, stored deflate); and, separately, alice uploading such
                          jobs back to back (2 at a time) while bob measures
            slow lookups  12 submissions at a time whose webhook_url host takes 2 s to resolve
                          and then does not (bench/isolation_settings.py's resolver; the API
                          answers 400, or 429 past WEBHOOK_LOOKUPS_PER_ACCOUNT), each resent as
                          soon as it is answered (0.2 s after a 429)
            slow receivers  a fake worker finishes alice's jobs at once; each job's end is POSTed
                          to her webhook receiver on 127.0.0.1, which answers after 6 s
                          (WEBHOOK_ALLOW_PRIVATE=1); deliveries stay under way while bob measures
            300 sockets   alice opens 300 /ws/jobs/ sockets (ACCOUNT_SOCKET_LIMIT raised to 400
                          for the run, so that they open), then submits and cancels a job every
                          0.5 s, so that each event goes out to all 300
            a locked row  (PostgreSQL) another connection holds SELECT ... FOR UPDATE on one of
                          alice's queued job rows in an open transaction, and alice keeps N
                          POST /api/v1/jobs/{id}/cancel/ of that job waiting on it (each answers
                          503 after DATABASE_TIMEOUT_SECONDS and is sent again); N from
                          --lock-waiters, one row per N. On SQLite: skipped, with the reason.
          bob measures alone again after each flood, and each flood is compared with his samples
          alone just before and just after it (together): on a shared machine the load drifts over
          a run by more than some floods cost. Goal: under every flood, the p50 and p99 of each of
          bob's requests at most 2x alone.

  curve   the cost curve: 0, 1,000, 10,000 and 50,000 queued jobs (--sizes) of other accounts (200
          each, ACCOUNT_JOB_LIMIT's default, on bob's model, inserted as rows as job_submit writes
          them, then ANALYZE); at each size the API is restarted, so that it rebuilds its queue
          from the database, and timed: spawn -> answering HTTP, -> its first answered submission
          (which waits for the rebuilt queue), and the rebuild's own time from its log. Then bob's
          submit, GET of a job, page of his list and GET /api/v1/models/ p50/p99; then the smallest
          size again (the jobs above it deleted), for the drift. Goals: each p50 at 50,000 within
          1.2x of the figure at 0 (its samples first and again, together), and the API's start
          (spawn -> first answered submission) with 50,000 queued under 10 s.

PostgreSQL and Redis by default (DATABASE_URL, REDIS_URL, or the local servers, Redis db 11); a
fresh database for each part (tests/support/stack.py).

    .venv/bin/python bench/isolation.py [floods] [curve] [--samples 200] [--lock-waiters 1,12]
                                        [--sizes 0,1000,10000,50000]
    .venv/bin/python bench/isolation.py --sqlite [--no-redis]     # SQLite: no locked-row flood
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.server
import json
import multiprocessing
import os
import re
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/11")

from bench.dispatch import KeepAliveClient, percentile  # noqa: E402
from tests.support.stack import BenchWorker, Process, Stack, fake_manifest, serve_http  # noqa: E402

ALICE_MODEL = "iso-alice"  # alice's floods; served by a fake worker only in the slow-receivers flood
BOB_MODEL = "iso-bob"  # bob's submissions (and the curve's queued jobs): no worker, they stay queued
OPS = ("submit", "GET job", "GET list", "GET models")
OK = {"submit": 201, "GET job": 200, "GET list": 200, "GET models": 200}
IMAGE_BYTES = 7 * 1024 * 1024
BIG_JOBS = 60
LOOKUP_CLIENTS = 12
RECEIVER_SECONDS = 6.0
RECEIVER_EVENTS = 20
SOCKETS = 300
SOCKET_EVENT_SECONDS = 0.5
GOAL_FLOOD = 2.0
GOAL_CURVE = 1.2
GOAL_START_S = 10.0
REQUEST_TIMEOUT_S = 30.0  # one of bob's requests that takes longer counts as this and its connection is dropped
WARMUP_TIMEOUT_S = 15.0  # the warm-up rounds end by then
PHASE_TIMEOUT_S = 120.0  # bob's measurement under one flood ends by then, however many samples it has
FLOOD_MAX_S = 900.0  # a flood process ends itself by then, whatever the parent does
SETTINGS = {
    "DJANGO_SETTINGS_MODULE": "bench.isolation_settings",  # the slow resolver
    "JOB_SUBMIT_RATE": "1000000/minute",  # bob's samples and alice's floods are not throttled
    "ACCOUNT_JOB_LIMIT": "100000",
    "ACCOUNT_SOCKET_LIMIT": "400",  # so that the 300 sockets open (the default is 20)
    "WEBHOOK_ALLOW_PRIVATE": "1",  # the slow receiver is on 127.0.0.1
}


def big_png(size: int) -> bytes:
    """A valid PNG of about `size` bytes (at most): RGB random pixels, 1600 wide, in stored (level 0)
    deflate blocks, so the file is as big as its pixels; its declared size within MAX_IMAGE_PIXELS."""
    width = 1600
    row = 1 + 3 * width
    height = max(1, (size - 2048) * 65535 // 65540 // row)
    raw = b"".join(b"\x00" + os.urandom(3 * width) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b""))


def pg_url(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


class Client:
    """KeepAliveClient (bench/dispatch.py) with a time limit: a request past it gives ("timeout",
    None) and the next one opens a new connection."""

    def __init__(self, port: int, token: str) -> None:
        self.port, self.token = port, token
        self.http = KeepAliveClient("127.0.0.1", port, token)

    async def call(self, method: str, path: str, data: bytes = b"",
                   timeout: float = REQUEST_TIMEOUT_S) -> tuple[int | str, Any]:
        try:
            return await asyncio.wait_for(self.http.request(method, path, data), timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            with contextlib.suppress(Exception):
                await self.http.close()
            self.http = KeepAliveClient("127.0.0.1", self.port, self.token)
            return ("timeout" if isinstance(exc, TimeoutError) else type(exc).__name__), None

    async def submit(self, model: str, prompt: str, **extra: Any) -> tuple[int | str, Any]:
        body = {"model_id": model, "params": {"prompt": prompt}, **extra}
        return await self.call("POST", "/api/v1/jobs/", json.dumps(body).encode())

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.http.close()


# --- bob's side -----------------------------------------------------------------------------------


class Figures:
    """Bob's latencies (ms) and failed answers per request, under one condition."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {op: [] for op in OPS}
        self.failed: dict[str, Counter[str]] = {op: Counter() for op in OPS}

    @classmethod
    def union(cls, *parts: Figures) -> Figures:
        """The samples of several measurements together."""
        merged = cls()
        for part in parts:
            for op in OPS:
                merged.ms[op] += part.ms[op]
                merged.failed[op].update(part.failed[op])
        return merged

    def p(self, op: str, q: float) -> float:
        values = self.ms[op]
        return statistics.median(values) if q == 50 else percentile(values, q)


async def measure(port: int, token: str, job_id: str, *, samples: int, warmup: int) -> tuple[Figures, list[str]]:
    """Bob's requests in rounds (submit, GET job, GET list, GET models), one at a time; the ids of
    the jobs he submitted (to cancel afterwards)."""
    client = Client(port, token)
    figures = Figures()
    submitted: list[str] = []
    requests: dict[str, Callable[[int], Awaitable[tuple[int | str, Any]]]] = {
        "submit": lambda n: client.submit(BOB_MODEL, f"bob {n}"),
        "GET job": lambda n: client.call("GET", f"/api/v1/jobs/{job_id}/"),
        "GET list": lambda n: client.call("GET", "/api/v1/jobs/"),
        "GET models": lambda n: client.call("GET", "/api/v1/models/"),
    }
    warming = warmup > 0
    deadline = time.monotonic() + (WARMUP_TIMEOUT_S if warming else PHASE_TIMEOUT_S)
    n = counted = 0
    while counted < samples:
        if warming and (n >= warmup or time.monotonic() > deadline):  # warm-up over: the samples' own time
            warming, deadline = False, time.monotonic() + PHASE_TIMEOUT_S
        elif not warming and time.monotonic() > deadline:
            print(f"    (bob's measurement stopped after {counted} rounds: {PHASE_TIMEOUT_S:.0f} s)")
            break
        for op in OPS:
            started = time.perf_counter()
            status, body = await requests[op](n)
            elapsed = (time.perf_counter() - started) * 1000
            if op == "submit" and status == 201:
                submitted.append(str(body["id"]))
            if not warming:
                figures.ms[op].append(elapsed)
                if status != OK[op]:
                    figures.failed[op][str(status)] += 1
        n += 1
        counted += 0 if warming else 1
    await client.close()
    return figures, submitted


async def cancel_jobs(port: int, token: str, ids: list[str], concurrency: int = 4) -> Counter[str]:
    """Cancel these jobs (their statuses counted)."""
    clients = [Client(port, token) for _ in range(concurrency)]
    statuses: Counter[str] = Counter()
    todo = iter(ids)

    async def canceller(client: Client) -> None:
        for job_id in todo:
            status, _ = await client.call("POST", f"/api/v1/jobs/{job_id}/cancel/", timeout=60)
            statuses[str(status)] += 1

    await asyncio.gather(*(canceller(client) for client in clients))
    for client in clients:
        await client.close()
    return statuses


async def submit_many(port: int, token: str, model: str, count: int, prompt: str) -> list[str]:
    client = Client(port, token)
    ids = []
    for n in range(count):
        status, body = await client.submit(model, f"{prompt} {n}")
        if status != 201:
            raise RuntimeError(f"submission answered {status}: {body}")
        ids.append(str(body["id"]))
    await client.close()
    return ids


def describe(figures: Figures, alone: Figures | None) -> list[str]:
    lines = []
    for op in OPS:
        if not figures.ms[op]:
            lines.append(f"    {op:<11} no sample")
            continue
        p50, p99 = figures.p(op, 50), figures.p(op, 99)
        line = f"    {op:<11} p50 {p50:8.2f} ms"
        if alone is not None:
            line += f" ({p50 / alone.p(op, 50):5.2f}x)"
        line += f"   p99 {p99:8.2f} ms"
        if alone is not None:
            line += f" ({p99 / alone.p(op, 99):5.2f}x)"
        line += f"   max {max(figures.ms[op]):8.2f} ms   n {len(figures.ms[op])}"
        if figures.failed[op]:
            line += "   not answered as expected: " + ", ".join(f"{k} x{v}" for k, v in figures.failed[op].items())
        lines.append(line)
    return lines


# --- alice's floods (each in a process of its own) -------------------------------------------------


Ready = Callable[[str], None]
Stopped = Callable[[], bool]


async def until(stopped: Stopped, deadline: float, step: float = 0.05) -> None:
    while not stopped() and time.monotonic() < deadline:
        await asyncio.sleep(step)


async def flood_big_queued(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """Alice queues 60 jobs with a 7 MiB init_image each (4 uploads at a time), then waits."""
    body = big_body(cfg["image_bytes"])
    clients = [Client(cfg["port"], cfg["alice"]) for _ in range(4)]
    statuses: Counter[str] = Counter()
    ids: list[str] = []
    todo = iter(range(BIG_JOBS))
    started = time.monotonic()

    async def uploader(client: Client) -> None:
        for _ in todo:
            status, answer = await client.call("POST", "/api/v1/jobs/", body, timeout=120)
            statuses[str(status)] += 1
            if status == 201:
                ids.append(str(answer["id"]))

    await asyncio.gather(*(uploader(client) for client in clients))
    took = time.monotonic() - started
    ready(f"alice's {len(ids)} jobs queued, each with a {cfg['image_bytes'] / 2**20:.0f} MiB init_image "
          f"(a {len(body) / 2**20:.2f} MiB request): {dict(statuses)} in {took:.1f} s")
    await until(stopped, cfg["deadline"])
    await cancel_with(clients[0], ids)
    for client in clients:
        await client.close()
    return ""


async def flood_big_uploading(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """Alice uploads 7 MiB-image jobs back to back, 2 at a time, until stopped."""
    body = big_body(cfg["image_bytes"])
    clients = [Client(cfg["port"], cfg["alice"]) for _ in range(2)]
    statuses: Counter[str] = Counter()
    ids: list[str] = []
    first = asyncio.Event()
    measured = {"from": 0.0, "count": 0}

    async def uploader(client: Client) -> None:
        for _ in range(300):  # at most 600 uploads (5.5 GiB of files, removed with the run's folder)
            if stopped() or time.monotonic() > cfg["deadline"]:
                return
            status, answer = await client.call("POST", "/api/v1/jobs/", body, timeout=120)
            statuses[str(status)] += 1
            if status == 201:
                ids.append(str(answer["id"]))
            if first.is_set():
                measured["count"] += 1
            first.set()

    tasks = [asyncio.create_task(uploader(client)) for client in clients]
    await asyncio.wait_for(first.wait(), 120)
    measured["from"] = time.monotonic()
    ready("alice uploads jobs with a 7 MiB init_image back to back, 2 at a time")
    await asyncio.gather(*tasks)
    rate = measured["count"] / max(1e-6, time.monotonic() - measured["from"])
    await cancel_with(clients[0], ids)
    for client in clients:
        await client.close()
    return f"alice's uploads: {dict(statuses)}; {rate:.1f} uploads/s ({rate * len(body) / 2**20:.0f} MiB/s) while on"


def big_body(image_bytes: int) -> bytes:
    image = base64.b64encode(big_png(image_bytes)).decode()
    return json.dumps({"model_id": ALICE_MODEL, "params": {"prompt": "big", "init_image": image}}).encode()


async def cancel_with(client: Client, ids: list[str]) -> None:
    for job_id in ids:
        await client.call("POST", f"/api/v1/jobs/{job_id}/cancel/", timeout=60)


async def flood_slow_lookups(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """12 of alice's submissions at a time whose webhook host takes 2 s and does not resolve; each
    sent again once answered (0.2 s after a 429 or 503)."""
    clients = [Client(cfg["port"], cfg["alice"]) for _ in range(LOOKUP_CLIENTS)]
    statuses: Counter[str] = Counter()
    slow_answers: list[float] = []
    ids: list[str] = []

    async def submitter(k: int, client: Client) -> None:
        for n in range(10_000):
            if stopped() or time.monotonic() > cfg["deadline"]:
                return
            started = time.monotonic()
            status, answer = await client.submit(ALICE_MODEL, "lookup", webhook_url=f"http://h{k}-{n}.slow.invalid/hook")
            statuses[str(status)] += 1
            if status == 201:  # never expected: the host does not resolve
                ids.append(str(answer["id"]))
            if status == 400:
                slow_answers.append(time.monotonic() - started)
            if status in (429, 503):
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(submitter(k, client)) for k, client in enumerate(clients)]
    await asyncio.sleep(0.5)  # the first lookups under way
    ready(f"{LOOKUP_CLIENTS} of alice's submissions at a time, each webhook host 2 s to (not) resolve")
    await asyncio.gather(*tasks)
    await cancel_with(clients[0], ids)
    for client in clients:
        await client.close()
    typical = f", those refused after {statistics.median(slow_answers):.2f} s (median)" if slow_answers else ""
    return f"alice's submissions: {dict(statuses)}{typical}"


class SlowReceiver:
    """A webhook receiver on 127.0.0.1 answering each POST 200 after `delay` s (at once once released)."""

    def __init__(self, delay: float) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.received = self.answered = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.received += 1
                receiver.release.wait(delay)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                with receiver.lock:
                    receiver.answered += 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = serve_http(Handler)
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


async def flood_slow_receivers(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """A fake worker ends alice's jobs at once; their events go to a receiver that answers after 6 s."""
    receiver = SlowReceiver(RECEIVER_SECONDS)
    worker = BenchWorker(f"ws://127.0.0.1:{cfg['port']}/ws/worker/?token={cfg['worker']}", "iso-alice:0", ALICE_MODEL)
    running = asyncio.create_task(worker.run())
    client = Client(cfg["port"], cfg["alice"])
    try:
        await asyncio.wait_for(worker.ready.wait(), 60)
        hook = f"http://127.0.0.1:{receiver.port}/hook"
        for n in range(RECEIVER_EVENTS):
            status, answer = await client.submit(ALICE_MODEL, f"hooked {n}", webhook_url=hook)
            if status != 201:
                raise RuntimeError(f"alice's hooked submission answered {status}: {answer}")
        deadline = time.monotonic() + 60
        while receiver.received < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ready(f"{worker.finished} of alice's jobs ended, {RECEIVER_EVENTS} events for a receiver that answers "
              f"after {RECEIVER_SECONDS:.0f} s; deliveries under way")
        before = receiver.answered, receiver.received
        await until(stopped, cfg["deadline"])
        during = receiver.answered - before[0], receiver.received - before[1]
        in_flight = before[1] - before[0]
        receiver.release.set()  # the rest at once, so that no delivery is left for the next flood
        deadline = time.monotonic() + 90
        while receiver.answered < RECEIVER_EVENTS and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return (f"{in_flight} deliveries in flight as bob began; while he measured {during[1]} more arrived, "
                f"{during[0]} were answered; "
                f"{receiver.answered} of {RECEIVER_EVENTS} answered in all")
    finally:
        running.cancel()
        with contextlib.suppress(BaseException):
            await running
        await client.close()
        receiver.close()


async def flood_sockets(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """Alice opens 300 /ws/jobs/ sockets (50 handshakes at a time), then makes a job event every 0.5 s
    (a submission and its cancel, in turn), each sent to all 300."""
    import websockets

    url = f"ws://127.0.0.1:{cfg['port']}/ws/jobs/"
    headers = {"Authorization": f"Token {cfg['alice']}"}
    sockets: list[Any] = []
    heard = Counter[str]()
    closes = Counter[str]()

    async def listen(ws: Any) -> None:
        try:
            async for _ in ws:
                heard["messages"] += 1
        except websockets.ConnectionClosed:
            pass
        closes[str(ws.close_code)] += 1

    readers = []
    started = time.monotonic()
    for start in range(0, SOCKETS, 50):
        opened = await asyncio.gather(*(websockets.connect(url, additional_headers=headers, compression=None,
                                                           open_timeout=60, max_queue=None)
                                        for _ in range(start, min(SOCKETS, start + 50))), return_exceptions=True)
        for ws in opened:
            if isinstance(ws, BaseException):
                closes[type(ws).__name__] += 1
            else:
                sockets.append(ws)
                readers.append(asyncio.create_task(listen(ws)))
    took = time.monotonic() - started
    await asyncio.sleep(1.0)  # a socket over the limit is closed (4003) just after its handshake
    open_now = sum(1 for ws in sockets if ws.close_code is None)
    client = Client(cfg["port"], cfg["alice"])
    ready(f"{open_now} of alice's /ws/jobs/ sockets open (opened in {took:.1f} s), a job event every "
          f"{SOCKET_EVENT_SECONDS} s to each")
    before = heard["messages"]
    events = 0
    job: str | None = None
    on_since = time.monotonic()
    while not stopped() and time.monotonic() < cfg["deadline"]:
        if job is None:
            status, answer = await client.submit(ALICE_MODEL, "socket flood")
            job = str(answer["id"]) if status == 201 else None
        else:
            await client.call("POST", f"/api/v1/jobs/{job}/cancel/")
            job = None
        events += 1
        await asyncio.sleep(SOCKET_EVENT_SECONDS)
    on_for = time.monotonic() - on_since
    if job is not None:
        await client.call("POST", f"/api/v1/jobs/{job}/cancel/")
    messages = heard["messages"] - before
    await client.close()
    for start in range(0, len(sockets), 50):
        await asyncio.gather(*(ws.close() for ws in sockets[start:start + 50]), return_exceptions=True)
    for reader in readers:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    refused = {code: n for code, n in closes.items() if code not in ("1000", "None")}
    return (f"{events} job events while on ({on_for:.1f} s); the sockets heard {messages} messages "
            f"({messages / max(on_for, 1e-6):.0f}/s){'; refused or closed early: ' + str(refused) if refused else ''}")


async def flood_locked_row(cfg: dict[str, Any], ready: Ready, stopped: Stopped) -> str:
    """Another connection holds SELECT ... FOR UPDATE on one of alice's queued jobs; alice keeps
    `waiters` cancels of that job waiting on it."""
    import psycopg

    client = Client(cfg["port"], cfg["alice"])
    status, answer = await client.submit(ALICE_MODEL, "locked")
    if status != 201:
        raise RuntimeError(f"alice's submission answered {status}: {answer}")
    job_id = str(answer["id"])
    conn = psycopg.connect(pg_url(cfg["database_url"]))
    statuses: Counter[str] = Counter()
    waits: list[float] = []
    try:
        conn.execute("SELECT id FROM scheduling_job WHERE id = %s FOR UPDATE", [job_id])  # the transaction stays open
        waiters = [Client(cfg["port"], cfg["alice"]) for _ in range(cfg["waiters"])]

        async def waiter(waiting: Client) -> None:
            for _ in range(1000):
                if stopped() or time.monotonic() > cfg["deadline"]:
                    return
                started = time.monotonic()
                status, _ = await waiting.call("POST", f"/api/v1/jobs/{job_id}/cancel/", timeout=60)
                statuses[str(status)] += 1
                waits.append(time.monotonic() - started)
                if status not in (503, "timeout"):
                    await asyncio.sleep(0.2)

        tasks = [asyncio.create_task(waiter(waiting)) for waiting in waiters]
        await asyncio.sleep(0.5)  # the cancels are waiting on the lock
        ready(f"one of alice's job rows locked by another connection, {cfg['waiters']} of her cancels of it "
              "kept waiting on it")
        await asyncio.gather(*tasks)
    finally:
        conn.rollback()
        conn.close()
    await cancel_with(client, [job_id])
    await client.close()
    for waiting in waiters:
        await waiting.close()
    typical = f", each after {statistics.median(waits):.2f} s (median)" if waits else ""
    return f"alice's cancels of the locked job answered {dict(statuses)}{typical}"


FLOODS: dict[str, Callable[[dict[str, Any], Ready, Stopped], Awaitable[str]]] = {
    "big images: 60 queued": flood_big_queued,
    "big images: uploading": flood_big_uploading,
    "slow lookups": flood_slow_lookups,
    "slow receivers": flood_slow_receivers,
    "300 sockets": flood_sockets,
    "a locked row": flood_locked_row,
}


def flood_process(name: str, cfg: dict[str, Any], ready: Any, stop: Any, notes: Any) -> None:
    """A flood's process: runs it until `stop` is set (or FLOOD_MAX_S), telling the parent what it
    set up (when ready) and what it did (at the end) through `notes`."""
    cfg = {**cfg, "deadline": time.monotonic() + FLOOD_MAX_S}

    def on(note: str) -> None:
        notes.put(("ready", note))
        ready.set()

    try:
        notes.put(("done", asyncio.run(FLOODS[name](cfg, on, stop.is_set))))
    except BaseException as exc:
        notes.put(("failed", f"{type(exc).__name__}: {exc}"))
        ready.set()
        raise


def run_flood(name: str, cfg: dict[str, Any], measure_bob: Callable[[], Figures]) -> tuple[Figures | None, list[str]]:
    """Start the flood in its own process, measure bob while it is on, stop it; its notes."""
    context = multiprocessing.get_context("spawn")
    ready, stop, notes = context.Event(), context.Event(), context.Queue()
    process = context.Process(target=flood_process, args=(name, cfg, ready, stop, notes), daemon=True)
    process.start()
    said: list[str] = []
    figures: Figures | None = None
    try:
        if not ready.wait(600):
            said.append("the flood was not on within 600 s")
            return None, said
        kind, note = notes.get(timeout=10)
        said.append(note)
        if kind == "failed":
            return None, said
        figures = measure_bob()
    finally:
        stop.set()
        process.join(180)
        if process.is_alive():
            said.append("the flood did not end within 180 s: terminated")
            process.terminate()
            process.join(10)
        with contextlib.suppress(Exception):
            while True:
                kind, note = notes.get(timeout=1)
                if note:
                    said.append(note if kind != "failed" else f"failed: {note}")
    return figures, said


def floods(args: argparse.Namespace, postgres: bool) -> None:
    print(f"floods: bob's requests alone, then under each of alice's floods; {args.samples} rounds each "
          f"(+{args.warmup} warm-up); ACCOUNT_SOCKET_LIMIT raised to {SETTINGS['ACCOUNT_SOCKET_LIMIT']} for the "
          f"300 sockets, JOB_SUBMIT_RATE and ACCOUNT_JOB_LIMIT lifted, WEBHOOK_ALLOW_PRIVATE=1", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-isolation-"))
    ok = False
    try:
        with Stack(workdir, api_processes=1, **SETTINGS) as stack:
            alice, worker_token = stack.prepare()
            bob = stack.manage("create_account", "bob")
            stack.register(fake_manifest(ALICE_MODEL), fake_manifest(BOB_MODEL))
            stack.start_api()
            # bob's jobs: one to GET, and enough for a full page of his list
            bob_jobs = asyncio.run(submit_many(stack.port, bob, BOB_MODEL, 60, "bob's own"))
            cfg = {"port": stack.port, "alice": alice, "worker": worker_token, "database_url": stack.database_url,
                   "image_bytes": args.image_mib * 2**20}

            def bob_measures() -> Figures:
                figures, submitted = asyncio.run(measure(stack.port, bob, bob_jobs[0], samples=args.samples,
                                                         warmup=args.warmup))
                asyncio.run(cancel_jobs(stack.port, bob, submitted))
                return figures

            conditions: list[tuple[str, str]] = [("big images: 60 queued", "big images: 60 queued"),
                                                 ("big images: uploading", "big images: uploading"),
                                                 ("slow lookups", "slow lookups"),
                                                 ("slow receivers", "slow receivers"),
                                                 ("300 sockets", "300 sockets")]
            conditions += [(f"a locked row, {n} waiting", "a locked row") for n in args.lock_waiters]
            # Each flood against bob's figures alone just before and just after it (their samples
            # together): the machine's load drifts over a run, and a flood is compared with its own time.
            print("\nalone", flush=True)
            alones = [bob_measures()]
            print("\n".join(describe(alones[-1], None)), flush=True)
            results: list[tuple[str, Figures | None, Figures | None]] = []  # (label, under the flood, alone around)
            for label, name in conditions:
                print(f"\n{label}", flush=True)
                if name == "a locked row" and not postgres:
                    print("    skipped: SQLite has no row locks (no SELECT ... FOR UPDATE; a writer locks the whole "
                          "database); run on PostgreSQL", flush=True)
                    results.append((label, None, None))
                    continue
                waiters = int(label.split(", ")[1].split()[0]) if name == "a locked row" else 0
                figures, notes = run_flood(name, {**cfg, "waiters": waiters}, bob_measures)
                for note in notes:
                    print(f"    {note}", flush=True)
                if figures is None or not any(figures.ms.values()):
                    print("    no figures: the flood failed (see above)", flush=True)
                else:
                    print("\n".join(describe(figures, alones[-1])), flush=True)
                print("  alone again", flush=True)
                alones.append(bob_measures())
                print("\n".join(describe(alones[-1], None)), flush=True)
                around = Figures.union(alones[-2], alones[-1])
                results.append((label, figures if figures is not None and any(figures.ms.values()) else None, around))
        print(f"\nsummary: bob's p50 and p99 under each flood against alone (the samples just before and just "
              f"after it);\ngoal: every request's p50 and p99 at most {GOAL_FLOOD:g}x alone")
        header = "  ".join(f"{op:>19}" for op in OPS)
        print(f"    {'flood':<26} {header}   goal")
        print(f"    {'':<26} " + "  ".join(f"{'p50x':>9} {'p99x':>9}" for _ in OPS))
        for label, figures, around in results:
            if around is None:
                print(f"    {label:<26} {'skipped (SQLite)':>19}")
                continue
            if figures is None:
                print(f"    {label:<26} {'no figures':>19}   NOT met (the flood failed)")
                continue
            ratios = [(figures.p(op, 50) / around.p(op, 50), figures.p(op, 99) / around.p(op, 99)) for op in OPS]
            met = all(r <= GOAL_FLOOD for pair in ratios for r in pair)
            cells = "  ".join(f"{p50:8.2f}x {p99:8.2f}x" for p50, p99 in ratios)
            print(f"    {label:<26} {cells}   {'met' if met else 'NOT met'}")
        print(f"    {'alone: last vs first':<26} " + "  ".join(
            f"{alones[-1].p(op, 50) / alones[0].p(op, 50):8.2f}x {alones[-1].p(op, 99) / alones[0].p(op, 99):8.2f}x"
            for op in OPS) + "   (the machine's drift over the run)", flush=True)
        ok = True
    finally:
        cleanup(workdir, ok)


# --- the cost curve ------------------------------------------------------------------------------------

INSERT_SCRIPT = """
import datetime
from django.contrib.auth import get_user_model
from django.db import connection
from scheduling.models import Job

User = get_user_model()
TARGET, PER_ACCOUNT, MODEL = {target}, {per_account}, {model!r}
have = Job.objects.filter(account__username__startswith="crowd-", state="queued").count()
accounts = -(-TARGET // PER_ACCOUNT)
User.objects.bulk_create([User(username=f"crowd-{{n:05d}}", password="!") for n in range(accounts)],
                         ignore_conflicts=True)
ids = dict(User.objects.filter(username__startswith="crowd-").values_list("username", "id"))
base_us = int(datetime.datetime.now(datetime.UTC).timestamp() * 1e6) - 3_600_000_000
rows = []
for n in range(have, TARGET):
    us = base_us + n * 10
    rows.append(Job(account_id=ids[f"crowd-{{n // PER_ACCOUNT:05d}}"], model_id=MODEL,
                    params={{"prompt": f"crowd {{n}}"}}, state="queued", submitted_us=us,
                    created_at=datetime.datetime.fromtimestamp(us / 1e6, tz=datetime.UTC)))
    if len(rows) == 2000:
        Job.objects.bulk_create(rows)
        rows = []
if rows:
    Job.objects.bulk_create(rows)
# back down to TARGET (the curve's first size, again): the newest crowd jobs go
extra = list(Job.objects.filter(account__username__startswith="crowd-", state="queued")
             .order_by("submitted_us", "id").values_list("id", flat=True)[TARGET:])
for start in range(0, len(extra), 2000):
    Job.objects.filter(id__in=extra[start:start + 2000]).delete()
with connection.cursor() as cursor:
    cursor.execute("ANALYZE")
print(Job.objects.filter(state="queued").count())
"""


def restart_api(stack: Stack) -> tuple[Process, int]:
    """Stop the API and start it again (its queue rebuilt from the database); the rebuild lines its
    log held before."""
    old = stack.apis.pop(stack.port)
    old.stop()
    stack.processes.remove(old)
    before = old.log().count("rebuilt the job queue from the database")
    return stack.start_api(timeout=300), before


REBUILT = re.compile(r"rebuilt the job queue from the database: (\d+) queued, \d+ held, in (\d+) ms")


def curve(args: argparse.Namespace, postgres: bool) -> None:
    sizes = sorted(int(size) for size in args.sizes.split(","))
    print(f"cost curve: bob's requests with {', '.join(f'{s:,}' for s in sizes)} queued jobs of other accounts "
          f"(200 each) on his model; {args.samples} rounds each (+{args.warmup} warm-up)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-isolation-curve-"))
    ok = False
    try:
        with Stack(workdir, api_processes=1, **SETTINGS) as stack:
            stack.prepare()
            bob = stack.manage("create_account", "bob")
            stack.register(fake_manifest(ALICE_MODEL), fake_manifest(BOB_MODEL))
            stack.start_api()
            bob_jobs = asyncio.run(submit_many(stack.port, bob, BOB_MODEL, 60, "bob's own"))
            rows: list[tuple[int, float, float, float | None, int | None, Figures]] = []
            # the smallest size once more at the end: the machine's drift over the curve
            for point, size in enumerate([*sizes, sizes[0]]):
                again = point == len(sizes)
                started = time.monotonic()
                queued = int(stack.manage("shell", "-c", INSERT_SCRIPT.format(target=size, per_account=200,
                                                                              model=BOB_MODEL), timeout=900))
                inserted_s = time.monotonic() - started
                api, before = restart_api(stack)
                http_s = time.monotonic() - api.started_at
                status, _ = asyncio.run(first_submit(stack.port, bob))
                submit_s = time.monotonic() - api.started_at
                rebuild_ms: float | None = None
                rebuilt: int | None = None
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    found = REBUILT.findall(api.log())
                    if len(found) > before:
                        rebuilt, rebuild_ms = int(found[-1][0]), float(found[-1][1])
                        break
                    time.sleep(0.05)
                figures, submitted = asyncio.run(measure(stack.port, bob, bob_jobs[0], samples=args.samples,
                                                         warmup=args.warmup))
                asyncio.run(cancel_jobs(stack.port, bob, submitted))
                rows.append((size, http_s, submit_s, rebuild_ms, rebuilt, figures))
                print(f"\n{size:,} queued{', again' if again else ''} ({queued:,} queued rows in all, bob's "
                      f"included; {'deleted down' if again else 'inserted'} in {inserted_s:.1f} s)", flush=True)
                print(f"    API start: spawn -> answering HTTP {http_s:6.2f} s, -> first submission answered "
                      f"{submit_s:6.2f} s ({status}); queue rebuild {rebuild_ms if rebuild_ms is not None else '?'} ms "
                      f"({rebuilt if rebuilt is not None else '?'} jobs, from its log)", flush=True)
                print("\n".join(describe(figures, None)), flush=True)
        print("\ncost curve summary (p50 ms; start: spawn -> first submission answered):")
        print(f"    {'queued':>14}  " + "  ".join(f"{op:>11}" for op in OPS) + "   start (s)")
        for point, (size, _, submit_s, _, _, figures) in enumerate(rows):
            label = f"{size:,}" + (" again" if point == len(rows) - 1 else "")
            print(f"    {label:>14}  " + "  ".join(f"{figures.p(op, 50):11.2f}" for op in OPS) + f"   {submit_s:9.2f}")
        largest = rows[-2]
        smallest = Figures.union(rows[0][5], rows[-1][5])  # before and after: the drift between them halved
        print(f"goal: the {largest[0]:,} figure within {GOAL_CURVE:g}x of the {sizes[0]:,} figure (the p50 of its "
              f"samples first and again), and the API's start with {largest[0]:,} queued under {GOAL_START_S:g} s")
        for op in OPS:
            ratio50 = largest[5].p(op, 50) / smallest.p(op, 50)
            ratio99 = largest[5].p(op, 99) / smallest.p(op, 99)
            print(f"    {op:<11} {largest[0]:,} vs {sizes[0]:,}: p50 {ratio50:5.2f}x (p99 {ratio99:5.2f}x; p50 vs the "
                  f"first {sizes[0]:,} only {largest[5].p(op, 50) / rows[0][5].p(op, 50):5.2f}x)   "
                  f"goal p50 <= {GOAL_CURVE:g}x: {'met' if ratio50 <= GOAL_CURVE else 'NOT met'}")
        print(f"    API start with {largest[0]:,} queued (spawn -> first submission answered): {largest[2]:.2f} s   "
              f"goal < {GOAL_START_S:g} s: {'met' if largest[2] < GOAL_START_S else 'NOT met'}", flush=True)
        ok = True
    finally:
        cleanup(workdir, ok)


async def first_submit(port: int, token: str) -> tuple[int | str, Any]:
    client = Client(port, token)
    try:
        return await client.submit(BOB_MODEL, "first after the start")
    finally:
        await client.close()


def cleanup(workdir: Path, ok: bool) -> None:
    """Remove the run's files; after a failure keep its logs (not the images) and say where."""
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        shutil.rmtree(workdir / "media", ignore_errors=True)
        print(f"(logs kept in {workdir})", flush=True)


PARTS: dict[str, Callable[[argparse.Namespace, bool], None]] = {"floods": floods, "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=list(PARTS), help=f"which parts: {', '.join(PARTS)} (all)")
    parser.add_argument("--samples", type=int, default=200, help="rounds of bob's requests under each condition")
    parser.add_argument("--warmup", type=int, default=10, help="rounds before those, not counted")
    parser.add_argument("--lock-waiters", default="1,12",
                        help="alice's cancels waiting on the locked row; one flood per number, comma-separated")
    parser.add_argument("--image-mib", type=int, default=7, help="size of each big init_image (MiB)")
    parser.add_argument("--sizes", default="0,1000,10000,50000", help="curve: queued jobs, comma-separated")
    parser.add_argument("--sqlite", action="store_true", help="SQLite instead of PostgreSQL (no locked-row flood)")
    parser.add_argument("--no-redis", action="store_true", help="no Redis: the in-process queue and channel layer")
    args = parser.parse_args()
    args.lock_waiters = [int(n) for n in args.lock_waiters.split(",") if n.strip()]
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.sqlite:
        os.environ["DATABASE_URL"] = "sqlite://"  # Stack makes a fresh SQLite file for each part
    if args.no_redis:
        os.environ.pop("REDIS_URL", None)
    postgres = os.environ["DATABASE_URL"].startswith(("postgres://", "postgresql://"))
    print(f"database: {'PostgreSQL ' + os.environ['DATABASE_URL'].split('@')[-1] if postgres else 'SQLite'}, "
          f"Redis: {os.environ.get('REDIS_URL') or 'none (in-process queue and channel layer)'}, "
          f"{os.cpu_count()} CPUs\n", flush=True)
    for part in args.parts:
        PARTS[part](args, postgres)
        print(flush=True)


if __name__ == "__main__":
    main()
