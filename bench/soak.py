"""Soak with faults (issue 26, point 7): a bounded run of the whole thing, with crashes.

Two API processes (Daphne) on a PostgreSQL and a Redis of this bench's own, two real CPU workers
(`runworker_gpu` on the tiny model), live drawing sessions and a job stream from several accounts
(pauses, resumes, cancels, webhooks to a receiver in this process), while a chaos loop, seeded,
SIGKILLs one of: an API process, a worker, Redis, PostgreSQL, and restarts it. Then it stops the
stream, lets everything end (bounded) and checks, against the database, the workers' logs, the
webhook receiver and what the clients saw:

  jobs_ended_once        every job ended (succeeded, failed or cancelled) and ended once: no job
                         answered 201 is missing, none is left unfinished, none has two end events
                         (two webhook events, /ws/jobs/ showing two different ends, a webhook or the
                         REST list disagreeing with the row, a cancel answered 200 and then a success)
  no_double_success      no job ran to success twice: one `succeeded` result per job in the workers'
                         logs, no stray result file beside its images (a second stored success)
  webhooks_signed        every ended job with a webhook_url was delivered to the receiver with a
                         valid Standard Webhooks signature (at least once: duplicates with the same
                         webhook-id are allowed and counted distinct), and no delivery failed to verify
  sessions_live_or_closed  every browser that lost its session (a close, a `queued` or `idle` state,
                         or no frame back for --stall-seconds while told live) got it live again (told
                         `live` and a frame back) within --session-timeout (else it gives up and closes
                         it itself: a violation), the server never closed one for good, each browser is
                         live at the end, and once the browsers close, every session row is closed and
                         no slot is metered
  memory_flat            per API and worker process life: the mean RSS of its last 10% of samples is
                         at most --memory-ratio x that of its first 10%. A restarted process starts a
                         new series; a series is sampled from the moment its process serves (the API
                         answers, the worker is welcomed), and is judged only if it lived at least
                         --memory-min-seconds (default: a quarter of the run, at least 60 s); the
                         shorter ones are printed, not judged
  requests_answered      every REST request that started and ended between faults (outside each
                         [kill, back + --settle] window) was answered below 500
  no_crashes             no API process or worker exited without being killed (a watchdog restarts
                         one that did, and counts it)

Before them it prints the faults, the jobs, webhooks, sessions, memory series and, per account, the
p50/p99 of its requests between faults (and how many fell in fault windows). Its last lines are the
invariants, each `ok` or the count of violations. Everything runs on 127.0.0.1; the PostgreSQL and
Redis are started here on free ports (initdb in a temporary folder, as the `postgres` user when run
as root), so the machine's own servers are never touched. Everything stops by itself: the stream
runs --minutes, then the drain is bounded by --drain-seconds; processes and folders are removed on
exit, Ctrl-C included (--keep leaves the folder with every log).

    .venv/bin/python bench/soak.py [--minutes 10] [--seed 1] [--accounts 3] [--browsers 2]
                                   [--job-interval 3] [--fault-gap 20,40] [--down 1,5] [--keep]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.server
import io
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402
import websockets  # noqa: E402
from standardwebhooks.webhooks import Webhook  # noqa: E402

from tests.support.stack import Process, Stack, free_port, serve_http  # noqa: E402

MODEL = "tiny-sd"
TERMINAL = ("succeeded", "failed", "cancelled")
PG_BIN = Path("/usr/lib/postgresql/15/bin")
FINAL_CLOSES = (1000, 4000, 4001, 4004)  # the drawing page stays closed after these (drawing.js)


def now() -> float:
    return time.monotonic()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def pair(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


# --- PostgreSQL and Redis of our own ------------------------------------------------------------


class PrivatePostgres:
    """A PostgreSQL server on a data folder and port of its own. `kill()` is a crash: SIGKILL to the
    postmaster and every backend; `start()` again is a restart with crash recovery. As root it runs as
    the `postgres` user (set by Popen itself: a `runuser` in between would be the process we kill)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.data = base / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = pwd.getpwnam("postgres").pw_name if os.geteuid() == 0 else None
        if self.user is not None:
            shutil.chown(self.base, self.user, self.user)

    def _as(self) -> dict[str, Any]:
        return {} if self.user is None else {"user": self.user, "group": self.user, "extra_groups": []}

    def init(self) -> None:
        result = subprocess.run([str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                 "--no-sync", "-E", "UTF8", "--locale=C"], cwd=self.base, capture_output=True,
                                text=True, timeout=180, **self._as())
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")

    def start(self, timeout: float = 90) -> None:
        with open(self.base / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(PG_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.base),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=300"],
                cwd=self.base, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, **self._as())
        deadline = now() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if now() > deadline:
                    raise RuntimeError(f"postgres did not accept connections:\n{self.log()[-3000:]}") from None
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log(self) -> str:
        try:
            return (self.base / "postgres.log").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # a fast shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()  # and any backend left behind


class PrivateRedis:
    """redis-server on a free port, nothing persisted: a kill loses everything in it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> None:
        with open(self.base / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--protected-mode", "no", "--dir", str(self.base)],
                cwd=self.base, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = now() + timeout
        while not self.answers():
            if self.proc.poll() is not None or now() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()


# --- the webhook receiver -----------------------------------------------------------------------


@dataclass
class Delivery:
    account: str
    webhook_id: str
    job_id: str | None
    state: str | None
    valid: bool
    status: int
    at: float


class Receiver:
    """POST /hook/ACCOUNT: verified with that account's secret (standardwebhooks), recorded, answered
    200; the first arrival of one event in ten answers 500 (the API retries it)."""

    def __init__(self) -> None:
        self.secrets: dict[str, str] = {}
        self.deliveries: list[Delivery] = []
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.got(self.path.rstrip("/").rpartition("/")[2], dict(self.headers.items()), body, self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = serve_http(Handler)
        self.port = self.server.server_address[1]

    def got(self, account: str, headers: dict[str, str], body: bytes, handler: Any) -> None:
        lowered = {k.lower(): v for k, v in headers.items()}
        webhook_id = lowered.get("webhook-id", "")
        valid = False
        payload: dict[str, Any] = {}
        secret = self.secrets.get(account)
        if secret is not None:
            try:
                payload = Webhook(secret).verify(body, lowered)
                valid = True
            except Exception:  # any failure to verify is what is counted
                valid = False
        if not valid:
            with contextlib.suppress(ValueError):
                payload = json.loads(body)
        with self.lock:
            first = webhook_id not in self.seen
            self.seen.add(webhook_id)
            status = 500 if first and zlib.crc32(webhook_id.encode()) % 10 == 0 else 200
            self.deliveries.append(Delivery(account, webhook_id, payload.get("id"), payload.get("state"), valid,
                                            status, now()))
        handler.send_response(status)
        handler.send_header("Content-Length", "2")
        handler.end_headers()
        handler.wfile.write(b"ok")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- what the clients saw -----------------------------------------------------------------------


@dataclass
class Request:
    account: str
    kind: str
    started: float
    ended: float
    status: int | None  # None: no answer
    error: str = ""


@dataclass
class SubmittedJob:
    account: str
    prompt: str
    webhook: bool
    submitted: float
    cancel_answered: bool = False  # a cancel answered 200: it must end cancelled
    pauses: int = 0
    resumes: int = 0


@dataclass
class Fault:
    kind: str
    victim: str
    killed: float
    back: float = 0.0  # the restarted thing answers again
    error: str = ""


class Soak:
    def __init__(self, args: argparse.Namespace, stack: Stack, pg: PrivatePostgres, redis: PrivateRedis,
                 receiver: Receiver, tokens: dict[str, str], worker_token: str, models_dir: Path) -> None:
        self.args, self.stack, self.pg, self.redis, self.receiver = args, stack, pg, redis, receiver
        self.tokens, self.worker_token, self.models_dir = tokens, worker_token, models_dir
        self.ports = [stack.port, stack.scale_port]
        self.requests: list[Request] = []
        self.jobs: dict[str, SubmittedJob] = {}
        self.unanswered: list[tuple[str, str, str]] = []  # (account, prompt, what happened) of submissions
        self.faults: list[Fault] = []
        self.feed: dict[str, list[tuple[str, str | None]]] = defaultdict(list)  # job -> (state, finished_at)
        self.workers: dict[int, Process] = {}
        self.ready_pids: dict[int, str] = {}  # pid -> series name, once it serves
        self.memory: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.started = now()
        self.stop_stream = asyncio.Event()
        self.stop_chaos = asyncio.Event()
        self.browsers: list[Browser] = []
        self.final_live: dict[str, bool] = {}
        self.lock = asyncio.Lock()  # one fault, or one watchdog restart, at a time
        self.setup_seconds = 0.0
        self.tasks: list[asyncio.Task] = []

    def t(self, moment: float) -> float:
        return moment - self.started

    # --- processes ---------------------------------------------------------------------------

    def worker_log(self, n: int) -> Path:
        return self.stack.workdir / f"worker-{n}.log"

    def start_worker(self, n: int, timeout: float = 240) -> Process:
        """Worker n joins API process n % 2; returns once it is welcomed."""
        port = self.ports[n % len(self.ports)]
        log = self.worker_log(n)
        before = log.read_text(errors="replace").count("welcomed by") if log.exists() else 0
        argv = [sys.executable, "manage.py", "runworker_gpu", "--api", f"ws://127.0.0.1:{port}", "--token",
                self.worker_token, "--device", "cpu", "--models-dir", str(self.models_dir), "--threads", "1",
                "--worker-id", f"soak-{n}:cpu", "--frame-budget-ms", str(self.args.frame_budget_ms)]
        process = self.stack.launch(Process(f"worker-{n}", argv, self.stack.env, log))
        self.workers[n] = process
        deadline = now() + timeout
        while log.read_text(errors="replace").count("welcomed by") <= before:
            if not process.running or now() > deadline:
                raise RuntimeError(f"worker {n} was not welcomed:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        assert process.proc is not None
        self.ready_pids[process.proc.pid] = f"worker-{n} pid {process.proc.pid}"
        return process

    def start_api(self, index: int) -> Process:
        port = self.ports[index]
        process = self.stack.start_api(port=port)
        assert process.proc is not None
        self.ready_pids[process.proc.pid] = f"api-{index} pid {process.proc.pid}"
        return process

    def served_processes(self) -> list[tuple[str, int]]:
        found = []
        for process in [*self.stack.apis.values(), *self.workers.values()]:
            if process.proc is not None and process.running and process.proc.pid in self.ready_pids:
                found.append((self.ready_pids[process.proc.pid], process.proc.pid))
        return found

    # --- chaos ---------------------------------------------------------------------------------

    async def chaos(self) -> None:
        rng = random.Random(self.args.seed)
        gap_low, gap_high = pair(self.args.fault_gap)
        down_low, down_high = pair(self.args.down)
        end = self.started + self.args.minutes * 60
        last_back = now() + self.args.warmup - gap_low
        while not self.stop_chaos.is_set():
            at = last_back + rng.uniform(gap_low, gap_high)
            kind = rng.choice(["api", "worker", "redis", "postgres"])
            index = rng.randrange(2)
            down = rng.uniform(down_low, down_high)
            # a fault must be over, and settled, before the stream stops
            if at + down + 60 + self.args.settle > end:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_chaos.wait(), max(0.0, at - now()))
                return
            async with self.lock:
                fault = await asyncio.to_thread(self.fault, kind, index, down)
            self.faults.append(fault)
            print(f"  [{self.t(fault.killed):6.1f} s] killed {fault.victim}, back after "
                  f"{fault.back - fault.killed:.1f} s{'  ' + fault.error if fault.error else ''}", flush=True)
            last_back = fault.back

    def fault(self, kind: str, index: int, down: float) -> Fault:
        if kind == "api":
            victim = f"api-{index} (port {self.ports[index]})"
            fault = Fault(kind, victim, now())
            self.stack.kill(self.stack.apis[self.ports[index]])
            time.sleep(down)
            self._again(fault, lambda: self.start_api(index))
        elif kind == "worker":
            fault = Fault(kind, f"worker-{index}", now())
            self.stack.kill(self.workers[index])
            time.sleep(down)
            self._again(fault, lambda: self.start_worker(index))
        elif kind == "redis":
            fault = Fault(kind, "redis", now())
            self.redis.kill()
            time.sleep(down)
            self._again(fault, self.redis.start)
        else:
            fault = Fault(kind, "postgres", now())
            self.pg.kill()
            time.sleep(down)
            self._again(fault, self.pg.start)
        fault.back = now()
        return fault

    @staticmethod
    def _again(fault: Fault, start: Any) -> None:
        for attempt in range(3):
            try:
                start()
                return
            except Exception as exc:  # a restart that fails is a finding: try again, say so
                fault.error = f"restart attempt {attempt + 1} failed: {str(exc)[:300]}"
                time.sleep(5)
        raise RuntimeError(f"{fault.victim} could not be restarted: {fault.error}")

    async def watchdog(self) -> None:
        """A process that died without being killed is a crash: recorded (as a fault, with its log's
        tail) and restarted."""
        while True:
            await asyncio.sleep(3)
            async with self.lock:
                dead = [(f"api-{n} (port {port})", self.stack.apis[port], lambda n=n: self.start_api(n))
                        for n, port in enumerate(self.ports) if not self.stack.apis[port].running]
                dead += [(f"worker-{n}", process, lambda n=n: self.start_worker(n))
                         for n, process in self.workers.items() if not process.running]
                for victim, process, start in dead:
                    code = process.proc.returncode if process.proc is not None else None
                    fault = Fault("crash", victim, now(), error=f"exited {code}: {process.log()[-1500:]!r}")
                    print(f"  [{self.t(fault.killed):6.1f} s] CRASH: {victim} exited {code} on its own", flush=True)
                    with contextlib.suppress(ValueError):
                        self.stack.processes.remove(process)
                    await asyncio.to_thread(self._again, fault, start)
                    fault.back = now()
                    self.faults.append(fault)

    def in_fault(self, started: float, ended: float) -> bool:
        for fault in self.faults:
            window_end = (fault.back or now()) + self.args.settle
            if started <= window_end and ended >= fault.killed:
                return True
        return False

    # --- memory ----------------------------------------------------------------------------------

    async def sample_memory(self) -> None:
        while True:
            moment = now()
            for name, pid in self.served_processes():
                with contextlib.suppress(psutil.Error):
                    self.memory[name].append((moment, psutil.Process(pid).memory_info().rss))
            await asyncio.sleep(self.args.memory_every)


class Account:
    """One account's REST client: requests go to the API processes in turn (as behind a balancer); a
    connection refused is tried once on the other process."""

    def __init__(self, soak: Soak, name: str, token: str) -> None:
        self.soak, self.name, self.token = soak, name, token
        self.rng = random.Random(f"{soak.args.seed}-{name}")
        self.client = httpx.AsyncClient(headers={"Authorization": f"Token {token}"}, trust_env=False,
                                        timeout=httpx.Timeout(30.0, connect=5.0))
        self.turn = self.rng.randrange(2)
        self.follow_ups: set[asyncio.Task] = set()

    async def request(self, method: str, path: str, kind: str, body: dict | None = None,
                      ) -> tuple[int | None, Any]:
        for attempt in range(2):
            self.turn += 1
            port = self.soak.ports[self.turn % len(self.soak.ports)]
            started = now()
            try:
                response = await self.client.request(method, f"http://127.0.0.1:{port}{path}", json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing was sent: the other process
                self.soak.requests.append(Request(self.name, kind, started, now(), None, type(exc).__name__))
                if attempt == 0:
                    continue
                return None, "not_sent"
            except httpx.HTTPError as exc:
                self.soak.requests.append(Request(self.name, kind, started, now(), None, type(exc).__name__))
                return None, type(exc).__name__
            self.soak.requests.append(Request(self.name, kind, started, now(), response.status_code))
            try:
                return response.status_code, response.json()
            except ValueError:
                return response.status_code, response.text[:200]
        return None, "not_sent"

    async def stream(self) -> None:
        """Submit jobs until told to stop; some with a webhook, some paused and resumed, some
        cancelled; and read them back now and then."""
        n = 0
        hook = f"http://127.0.0.1:{self.soak.receiver.port}/hook/{self.name}"
        while not self.soak.stop_stream.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.soak.stop_stream.wait(),
                                       self.rng.expovariate(1 / self.soak.args.job_interval))
                break
            n += 1
            prompt = f"soak {self.name} {n}"
            long = self.rng.random() < 0.2  # a longer job: more likely to be running when a worker dies
            params = {"prompt": prompt, "width": 64, "height": 64, "seed": n,
                      "steps": self.rng.randint(20, 50) if long else self.rng.randint(2, 4)}
            body: dict[str, Any] = {"model_id": MODEL, "params": params, "priority": self.rng.randint(0, 3)}
            webhook = self.rng.random() < 0.5
            if webhook:
                body["webhook_url"] = hook
            status, answer = await self.request("POST", "/api/v1/jobs/", "submit", body)
            if status == 201 and isinstance(answer, dict):
                job_id = answer["id"]
                self.soak.jobs[job_id] = SubmittedJob(self.name, prompt, webhook, now())
                roll = self.rng.random()
                if roll < 0.1:
                    self._follow(self.cancel_later(job_id))
                elif roll < 0.2:
                    self._follow(self.pause_and_resume(job_id))
            elif status is None or status >= 500:
                self.soak.unanswered.append((self.name, prompt, str(status or answer)))
            # reads: a job of ours, and the first page of the list
            if self.soak.jobs and self.rng.random() < 0.5:
                mine = [j for j, rec in self.soak.jobs.items() if rec.account == self.name]
                if mine:
                    await self.request("GET", f"/api/v1/jobs/{self.rng.choice(mine[-20:])}/", "get")
            if self.rng.random() < 0.2:
                await self.request("GET", "/api/v1/jobs/", "list")

    def _follow(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.follow_ups.add(task)
        task.add_done_callback(self.follow_ups.discard)

    async def cancel_later(self, job_id: str) -> None:
        await asyncio.sleep(self.rng.uniform(0, 3))
        status, answer = await self.request("POST", f"/api/v1/jobs/{job_id}/cancel/", "cancel")
        if status == 200 and isinstance(answer, dict) and answer.get("state") == "cancelled":
            self.soak.jobs[job_id].cancel_answered = True

    async def pause_and_resume(self, job_id: str) -> None:
        await asyncio.sleep(self.rng.uniform(0, 2))
        status, _ = await self.request("POST", f"/api/v1/jobs/{job_id}/pause/", "pause")
        if status != 200:
            return
        self.soak.jobs[job_id].pauses += 1
        await asyncio.sleep(self.rng.uniform(2, 8))
        await self.resume(job_id)

    async def resume(self, job_id: str, tries: int = 30) -> None:
        """Resume until it takes (a held job's pause lands when its worker answers: 409 job_not_paused
        until then), or the job ended."""
        for _ in range(tries):
            status, answer = await self.request("POST", f"/api/v1/jobs/{job_id}/resume/", "resume")
            if status == 200:
                if job_id in self.soak.jobs:
                    self.soak.jobs[job_id].resumes += 1
                return
            if status == 409 and isinstance(answer, dict) and answer.get("error") == "job_already_ended":
                return
            await asyncio.sleep(1)

    async def job_feed(self) -> None:
        """/ws/jobs/: every state the account's jobs are reported in (reconnects after a drop)."""
        attempt = 0
        while True:
            port = self.soak.ports[attempt % len(self.soak.ports)]
            try:
                async with websockets.connect(f"ws://127.0.0.1:{port}/ws/jobs/?token={self.token}", max_size=None,
                                              open_timeout=10, compression=None) as ws:
                    async for raw in ws:
                        message = json.loads(raw)
                        if message.get("type") == "job":
                            job = message["job"]
                            self.soak.feed[job["id"]].append((job["state"], job.get("finished_at")))
            except (OSError, TimeoutError, websockets.WebSocketException):
                pass
            attempt += 1
            await asyncio.sleep(self.rng.uniform(0, 2))

    async def all_jobs(self) -> dict[str, dict]:
        """Every job of the account, by the REST list's pages."""
        found: dict[str, dict] = {}
        page = 1
        while True:
            status, answer = await self.request("GET", f"/api/v1/jobs/?page={page}", "final-list")
            if status != 200 or not isinstance(answer, dict):
                raise RuntimeError(f"listing {self.name}'s jobs answered {status}: {answer}")
            for job in answer["results"]:
                found[job["id"]] = job
            if not answer.get("next"):
                return found
            page += 1


def canvases() -> list[str]:
    from PIL import Image, ImageDraw

    made = []
    for n in range(8):
        image = Image.new("RGB", (64, 64), (255, 255, 255))
        ImageDraw.Draw(image).ellipse((4 * n, 4 * n, 30 + 4 * n, 30 + 4 * n),
                                      fill=(40 * n % 256, 200 - 20 * n, 30 * n % 256))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        made.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())
    return made


@dataclass
class Episode:
    """A time a browser wanted its session live and it was not: from the drop (or the start, or
    leaving on its own) to live again, or to giving up."""
    began: float
    cause: str
    ended: float | None = None
    gave_up: bool = False


@dataclass
class Browser:
    """A drawing page: one session on /ws/session/, frames at a few per second with one in flight;
    after a drop it reconnects as reconnect.js does (full jitter over min(15 s, 0.5 s x 2^n), started
    afresh once live), every 5 s at the account's limit (4003), and stays closed after 1000, 4000, 4001
    or 4004 (counted: then it reloads after 10 s, as a person would). Now and then it leaves on its
    own (closes with 1000) and comes back. Not live again within --session-timeout: it gives up, closes
    the socket itself and starts afresh (counted)."""

    soak: Soak
    name: str
    account: str
    token: str
    home: int
    rng: random.Random
    images: list[str]
    live: bool = False
    last_result: float = 0.0
    episodes: list[Episode] = field(default_factory=list)
    server_final_closes: list[int] = field(default_factory=list)
    closes: Counter = field(default_factory=Counter)
    left: int = 0
    sent: int = 0
    results: int = 0
    frame_ms: list[tuple[float, float]] = field(default_factory=list)  # (sent, back)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ws: Any = None
    went_live: bool = False  # told `live` on the current connection
    live_since: float = 0.0
    trail: list[tuple[float, str]] = field(default_factory=list)  # what it saw, the latest 300

    def note(self, text: str) -> None:
        self.trail.append((now(), text))
        del self.trail[:-300]

    def open_episode(self) -> Episode | None:
        return self.episodes[-1] if self.episodes and self.episodes[-1].ended is None else None

    def lose(self, cause: str) -> None:
        self.live = False
        if self.open_episode() is None:
            self.episodes.append(Episode(now(), cause))
            self.note(f"not live: {cause}")

    def drawing(self) -> None:
        """A frame came back on a session told live: live again (the episode, if any, ends)."""
        if not self.went_live:
            return
        self.live = True
        episode = self.open_episode()
        if episode is not None:
            episode.ended = now()
            self.note(f"live again after {episode.ended - episode.began:.1f} s")

    def overdue(self) -> bool:
        """Not live again for too long: the episode ends, given up."""
        episode = self.open_episode()
        if episode is None or now() - episode.began <= self.soak.args.session_timeout:
            return False
        episode.gave_up = True
        episode.ended = now()
        self.note("gave up")
        return True

    async def run(self) -> None:
        attempt = 0
        port = self.home
        self.lose("start")
        while not self.stop.is_set():
            url = (f"ws://127.0.0.1:{port}/ws/session/?model_id={MODEL}&width=64&height=64&steps=2"
                   f"&token={self.token}")
            code: int | None
            self.went_live = False
            self.note(f"connect to :{port}")
            try:
                async with websockets.connect(url, max_size=None, open_timeout=10, compression=None) as ws:
                    self.ws = ws
                    code = await self.session(ws)
            except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidMessage) as exc:
                self.closes[type(exc).__name__] += 1
                code = -1
            except websockets.ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else 1006
            self.ws = None
            if self.stop.is_set():
                return
            if self.went_live:
                attempt = 0  # the backoff starts afresh only once the session was live
            if code is None:  # this browser closed it: it left, or gave up
                self.lose("left on its own or gave up")
                await asyncio.sleep(2)
                port = self.home
                continue
            self.closes[code] += 1
            self.note(f"closed {code}")
            self.lose(f"close {code}")
            if self.overdue():
                self.lose("after giving up")
            if code in FINAL_CLOSES:
                self.server_final_closes.append(code)
                await asyncio.sleep(10)
                attempt = 0
            elif code == 4003:
                await asyncio.sleep(5)
            else:
                await asyncio.sleep(self.rng.uniform(0, min(15.0, 0.5 * 2 ** min(attempt, 30))))
                attempt += 1
            port = self.rng.choice(self.soak.ports)  # a balancer may send it to either process

    async def session(self, ws: Any) -> int | None:
        """Draw until the socket closes (its code), or this browser closes it (None)."""
        in_flight: dict[int, float] = {}
        seq = 0
        leave_at = now() + self.rng.expovariate(1 / self.soak.args.leave_every)

        async def read() -> None:
            async for raw in ws:
                message = json.loads(raw)
                if message.get("type") == "state":
                    where = message.get("worker_id") or message.get("position") or ""
                    self.note(f"state {message.get('state')} {where}")
                    if message.get("state") == "live":
                        self.went_live = True
                        self.live_since = now()
                    else:
                        self.went_live = False
                        self.lose(f"state {message.get('state')}")
                elif message.get("type") == "frame":
                    self.results += 1
                    self.last_result = now()
                    self.drawing()
                    sent_at = in_flight.pop(int(message["seq"]), None)
                    if sent_at is not None:
                        self.frame_ms.append((sent_at, now()))
                    for old in [s for s in in_flight if s < int(message["seq"])]:
                        in_flight.pop(old)

        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                if self.stop.is_set():
                    await ws.close(1000)
                    return None
                if self.overdue():  # stuck: the browser closes it itself, and starts afresh
                    await ws.close(1000)
                    return None
                if self.live and now() > leave_at:
                    self.left += 1
                    self.note("leaves")
                    self.live = False
                    await ws.close(1000)
                    return None
                # told live, but no frame back for long: not live (a stuck session)
                if self.live and now() - max(self.live_since, self.last_result) > self.soak.args.stall_seconds:
                    self.lose("frames stalled")
                # one frame in flight; the next goes on its result, or after 3 s without one
                if not in_flight or now() - max(in_flight.values()) > 3.0:
                    seq += 1
                    in_flight.clear()
                    in_flight[seq] = now()
                    self.sent += 1
                    await ws.send(json.dumps({"type": "frame", "seq": seq, "image": self.images[seq % len(self.images)],
                                              "params": {"prompt": f"{self.name} drawing", "strength": 0.6}}))
                await asyncio.sleep(1 / self.soak.args.fps)
            await reader  # raises ConnectionClosed with the server's code, unless it closed cleanly
            return ws.close_code if ws.close_code is not None else 1006
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else 1006
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader


# --- the run ------------------------------------------------------------------------------------


async def traffic(soak: Soak, accounts: list[Account]) -> None:
    args = soak.args
    images = canvases()
    names = list(soak.tokens)
    for n in range(args.browsers):
        account = names[n % len(names)]
        soak.browsers.append(Browser(soak, f"browser-{n}", account, soak.tokens[account], soak.ports[n % 2],
                                     random.Random(f"{args.seed}-browser-{n}"), images))
    tasks = [asyncio.create_task(b.run()) for b in soak.browsers]
    tasks += [asyncio.create_task(a.job_feed()) for a in accounts]
    tasks.append(asyncio.create_task(soak.sample_memory()))
    tasks.append(asyncio.create_task(soak.watchdog()))
    soak.started = now()
    streams = [asyncio.create_task(a.stream()) for a in accounts]
    chaos = asyncio.create_task(soak.chaos())
    progress = asyncio.create_task(report_progress(soak))
    try:
        await asyncio.sleep(args.minutes * 60)
        soak.stop_chaos.set()
        soak.stop_stream.set()
        await chaos  # a fault under way finishes its restart
        await asyncio.gather(*streams)
        follow_ups = [t for a in accounts for t in a.follow_ups]
        if follow_ups:
            await asyncio.wait(follow_ups, timeout=120)
        print(f"  [{soak.t(now()):6.1f} s] stream stopped: {len(soak.jobs)} jobs answered 201; draining", flush=True)
        await drain(soak, accounts)
    finally:
        progress.cancel()
        chaos.cancel()
        for task in streams:
            task.cancel()
        for browser in soak.browsers:
            browser.stop.set()
        await asyncio.wait(tasks[:len(soak.browsers)], timeout=15)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *streams, chaos, return_exceptions=True)


async def report_progress(soak: Soak) -> None:
    while True:
        await asyncio.sleep(60)
        live = sum(b.live for b in soak.browsers)
        print(f"  [{soak.t(now()):6.1f} s] {len(soak.jobs)} jobs submitted, {len(soak.faults)} faults, "
              f"{live}/{len(soak.browsers)} sessions live, {len(soak.receiver.deliveries)} webhook posts", flush=True)


def unfinished(soak: Soak) -> list[tuple[str, str, str, bool]]:
    with psycopg.connect(soak.stack.database_url, autocommit=True, connect_timeout=5) as conn:
        return [(str(r[0]), r[1], r[2], bool(r[3])) for r in conn.execute(
            "SELECT j.id, u.username, j.state, j.pause_requested FROM scheduling_job j "
            "JOIN auth_user u ON u.id = j.account_id WHERE j.state NOT IN ('succeeded', 'failed', 'cancelled')")]


async def drain(soak: Soak, accounts: list[Account]) -> None:
    """Resume what is paused, wait (bounded) for every job to end, for every browser to be live and
    for the webhooks of the ended jobs; then the browsers close their sessions."""
    by_name = {a.name: a for a in accounts}
    deadline = now() + soak.args.drain_seconds
    left: list[tuple[str, str, str, bool]] = []
    while now() < deadline:
        left = await asyncio.to_thread(unfinished, soak)
        if not left:
            break
        paused = [(job_id, account) for job_id, account, state, _ in left if state == "paused"]
        await asyncio.gather(*(by_name[account].resume(job_id, tries=1) for job_id, account in paused
                               if account in by_name))
        await asyncio.sleep(2)
    print(f"  [{soak.t(now()):6.1f} s] jobs drained: {len(left)} not ended", flush=True)
    # every browser live again (bounded by its own give-up time)
    browser_deadline = now() + soak.args.session_timeout + 10
    while now() < browser_deadline and not all(b.live and now() - b.last_result < 15 for b in soak.browsers):
        await asyncio.sleep(1)
    soak.final_live = {b.name: b.live and now() - b.last_result < 15 for b in soak.browsers}
    # webhooks of ended jobs (the API retries with backoff; a delivery that failed for good counts)
    hook_deadline = now() + 150
    while now() < hook_deadline and missing_webhooks(soak):
        await asyncio.sleep(2)
    for browser in soak.browsers:
        browser.stop.set()
        if browser.ws is not None:
            with contextlib.suppress(Exception):
                await browser.ws.close(1000)
    await asyncio.sleep(1)


def missing_webhooks(soak: Soak) -> list[str]:
    """Ended jobs with a webhook_url whose event has not reached the receiver verified, and may still
    (a delivery that failed for good will not)."""
    with psycopg.connect(soak.stack.database_url, autocommit=True, connect_timeout=5) as conn:
        ended = [str(r[0]) for r in conn.execute(
            "SELECT id FROM scheduling_job j WHERE webhook_url <> '' AND state IN ('succeeded', 'failed', 'cancelled') "
            "AND NOT EXISTS (SELECT 1 FROM scheduling_webhookdelivery d WHERE d.job_id = j.id AND d.state = 'failed')")]
    with soak.receiver.lock:
        delivered = {d.job_id for d in soak.receiver.deliveries if d.valid and d.status < 300}
    return [job_id for job_id in ended if job_id not in delivered]


# --- the checks ---------------------------------------------------------------------------------


def check(soak: Soak, listed: dict[str, dict]) -> list[tuple[str, int]]:
    args = soak.args
    db = soak.stack.database_url
    with psycopg.connect(db, autocommit=True, connect_timeout=10) as conn:
        accounts = dict(conn.execute("SELECT id, username FROM auth_user WHERE username = ANY(%s)",
                                     [list(soak.tokens)]).fetchall())
        rows = conn.execute(
            "SELECT id, account_id, state, attempts, webhook_url, images, finished_at, params->>'prompt', "
            "preemptions, error FROM scheduling_job WHERE account_id = ANY(%s)", [list(accounts)]).fetchall()
        deliveries = conn.execute("SELECT job_id, id, state, jsonb_array_length(attempts) FROM "
                                  "scheduling_webhookdelivery").fetchall()
        sessions_open_wait = now() + 60
        while True:
            open_sessions = conn.execute(
                "SELECT id, account_id, state, worker_id FROM realtime_realtimesession WHERE state <> 'closed'"
            ).fetchall()
            metering = conn.execute("SELECT count(*) FROM realtime_usagerecord WHERE ended_at IS NULL").fetchone()[0]
            if (not open_sessions and not metering) or now() > sessions_open_wait:
                break
            time.sleep(2)
        session_total = conn.execute("SELECT count(*) FROM realtime_realtimesession").fetchone()[0]
    jobs = {str(r[0]): {"account": accounts[r[1]], "state": r[2], "attempts": r[3], "webhook_url": r[4],
                        "images": r[5] or [], "finished_at": r[6], "prompt": r[7], "preemptions": r[8],
                        "error": r[9]} for r in rows}
    rows_of: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for job_id, delivery_id, state, attempts in deliveries:
        rows_of[str(job_id)].append((str(delivery_id), state, attempts))

    # --- jobs
    print("jobs:")
    states = Counter(j["state"] for j in jobs.values())
    print(f"  in the database: {len(jobs)} ({', '.join(f'{k} {v}' for k, v in sorted(states.items()))})")
    answered = set(soak.jobs)
    found_by_prompt = {(j["account"], j["prompt"]): job_id for job_id, j in jobs.items()}
    no_answer_created = [p for p in soak.unanswered if (p[0], p[1]) in found_by_prompt]
    print(f"  submissions answered 201: {len(answered)}; unanswered or 5xx: {len(soak.unanswered)}, of which "
          f"{len(no_answer_created)} created the job anyway (found by prompt; they must end too)")
    extra = set(jobs) - answered - {found_by_prompt[(p[0], p[1])] for p in no_answer_created}
    if extra:
        print(f"  jobs in the database that no submission accounts for: {len(extra)}")
    listed_missing = set(jobs) - set(listed)
    print(f"  REST list at the end: {len(listed)} jobs; {len(listed_missing)} of the database's missing from it")
    retried = sum(1 for j in jobs.values() if j["attempts"] > 1)
    lost_workers = sum(1 for j in jobs.values() if j["error"] == "worker_lost")
    print(f"  retried after a worker death: {retried}; failed worker_lost: {lost_workers}; "
          f"preempted at least once: {sum(1 for j in jobs.values() if j['preemptions'])}; paused by us: "
          f"{sum(1 for s in soak.jobs.values() if s.pauses)}; cancels answered 200: "
          f"{sum(1 for s in soak.jobs.values() if s.cancel_answered)}")
    other_errors = Counter(j["error"] for j in jobs.values() if j["state"] == "failed" and j["error"] != "worker_lost")
    if other_errors:
        print(f"  other failures: {dict(other_errors.most_common(5))}")

    ended_once: list[str] = []
    for job_id in answered - set(jobs):
        ended_once.append(f"lost: {job_id} answered 201 and is not in the database")
    for job_id, job in jobs.items():
        if job["state"] not in TERMINAL:
            ended_once.append(f"not ended: {job_id} ({job['account']}) is {job['state']}")
        if len(rows_of.get(job_id, [])) > 1:
            ended_once.append(f"two end events: {job_id} has {len(rows_of[job_id])} webhook events")
        record = soak.jobs.get(job_id)
        if record is not None and record.cancel_answered and job["state"] != "cancelled":
            ended_once.append(f"cancelled then {job['state']}: {job_id}")
        seen = soak.feed.get(job_id, [])
        ends = {(state, finished) for state, finished in seen if state in TERMINAL}
        if len({state for state, _ in ends}) > 1 or len({finished for _, finished in ends}) > 1:
            ended_once.append(f"two ends on /ws/jobs/: {job_id}: {sorted(ends, key=str)}")
        if job["state"] in TERMINAL and listed.get(job_id, {}).get("state", job["state"]) != job["state"]:
            ended_once.append(f"REST and database disagree: {job_id}")
    with soak.receiver.lock:
        posted = list(soak.receiver.deliveries)
    events_of: dict[str, set[str]] = defaultdict(set)
    for delivery in posted:
        if delivery.job_id:
            events_of[delivery.job_id].add(delivery.webhook_id)
            if delivery.valid and delivery.job_id in jobs and delivery.state != jobs[delivery.job_id]["state"]:
                ended_once.append(f"webhook says {delivery.state}, database {jobs[delivery.job_id]['state']}: "
                                  f"{delivery.job_id}")
    for job_id, ids in events_of.items():
        if len(ids) > 1:
            ended_once.append(f"two webhook events delivered: {job_id}: {sorted(ids)}")

    # --- double success: the workers' own logs, and the result files
    runs: Counter = Counter()
    pattern = re.compile(r"job ([0-9a-f-]{36}) \(\S+\) succeeded on rung")
    for n in soak.workers:
        text = soak.worker_log(n).read_text(errors="replace") if soak.worker_log(n).exists() else ""
        runs.update(pattern.findall(text))
    double: list[str] = [f"ran to success {count} times on workers: {job_id} (now {jobs.get(job_id, {}).get('state')}, "
                         f"attempts {jobs.get(job_id, {}).get('attempts')})"
                         for job_id, count in runs.items() if count > 1]
    media = soak.stack.workdir / "media" / "jobs"
    result_name = re.compile(r"^\d+(_[A-Za-z0-9]+)?\.(png|jpg)$")
    for job_id, job in jobs.items():
        folder = media / job_id
        if folder.is_dir():
            files = [p.name for p in folder.iterdir() if result_name.match(p.name)]
            if len(files) > len(job["images"]):
                double.append(f"stray result files: {job_id}: {sorted(files)} beside images {job['images']}")
    succeeded_not_run = [j for j, job in jobs.items() if job["state"] == "succeeded" and runs[j] == 0]
    print(f"  worker runs to success: {sum(runs.values())} for {len(runs)} jobs; succeeded jobs no worker log "
          f"shows: {len(succeeded_not_run)}")

    # --- webhooks
    with_hook = [j for j, job in jobs.items() if job["webhook_url"] and job["state"] in TERMINAL]
    valid_of = {d.job_id for d in posted if d.valid and d.status < 300}
    invalid = [d for d in posted if not d.valid]
    ids = Counter(d.webhook_id for d in posted if d.status < 300)
    print("webhooks:")
    print(f"  ended jobs with a webhook_url: {len(with_hook)}; posts received {len(posted)} (answered 500 on "
          f"purpose: {sum(1 for d in posted if d.status == 500)}); distinct events delivered {len(ids)}; delivered "
          f"again with the same webhook-id: {sum(c - 1 for c in ids.values() if c > 1)}; invalid signatures "
          f"{len(invalid)}")
    delivery_states = Counter(state for rows in rows_of.values() for _, state, _ in rows)
    print(f"  delivery rows: {dict(delivery_states)}")
    webhook_problems = [f"not delivered: {j} (rows {rows_of.get(j)})" for j in with_hook if j not in valid_of]
    webhook_problems += [f"invalid signature: {d.webhook_id} for {d.job_id} ({d.account})" for d in invalid]

    # --- sessions
    print("sessions:")
    session_problems: list[str] = []
    for browser in soak.browsers:
        drops = [e for e in browser.episodes if e.cause not in ("start", "left on its own or gave up")]
        recovered = [e.ended - e.began for e in drops if e.ended is not None and not e.gave_up]
        causes = Counter(e.cause for e in drops)
        stuck = [e for e in browser.episodes if e.gave_up]
        between = [(back - sent) * 1000 for sent, back in browser.frame_ms if not soak.in_fault(sent, back)]
        figure = (f"frame ms between faults p50 {statistics.median(between):.0f} p99 {percentile(between, 99):.0f}"
                  if between else "no frames between faults")
        print(f"  {browser.name} ({browser.account}): frames sent {browser.sent}, back {browser.results}; {figure}; "
              f"lost live {len(drops)} times ({', '.join(f'{k} {v}' for k, v in causes.items()) or '-'}), live "
              f"again after p50 {statistics.median(recovered) if recovered else 0:.1f} s max "
              f"{max(recovered, default=0):.1f} s; gave up {len(stuck)}; left on its own {browser.left}")
        session_problems += [f"{browser.name}: not live again within {args.session_timeout:.0f} s after "
                             f"{e.cause} at {soak.t(e.began):.0f} s" for e in stuck]
        session_problems += [f"{browser.name}: the server closed it with {code}"
                             for code in browser.server_final_closes]
        if not soak.final_live.get(browser.name):
            session_problems.append(f"{browser.name}: not live at the end")
        slow = max(recovered, default=0) > 2 * args.settle
        if stuck or slow or browser.server_final_closes or not soak.final_live.get(browser.name):
            print(f"  {browser.name}'s trail (the latest 25):")
            for moment, text in browser.trail[-25:]:
                print(f"    {soak.t(moment):7.1f} s  {text}")
    print(f"  session rows: {session_total}; open after the browsers closed: {len(open_sessions)}; slots still "
          f"metered: {metering}")
    session_problems += [f"session row {r[0]} still {r[2]} (worker {r[3]})" for r in open_sessions]
    if metering:
        session_problems.append(f"{metering} usage records still open")

    # --- memory
    print(f"memory (RSS, mean of the last 10% of samples / the first 10%; judged for lives of at least "
          f"{args.memory_min_seconds:.0f} s, limit {args.memory_ratio}x):")
    memory_problems: list[str] = []
    for name, samples in sorted(soak.memory.items()):
        if len(samples) < 2:
            continue
        span = samples[-1][0] - samples[0][0]
        k = max(1, len(samples) // 10)
        first = statistics.fmean(rss for _, rss in samples[:k])
        last = statistics.fmean(rss for _, rss in samples[-k:])
        ratio = last / first
        judged = span >= args.memory_min_seconds and len(samples) >= 10
        verdict = ("ok" if ratio <= args.memory_ratio else "GREW") if judged else "not judged (short life)"
        print(f"  {name:<22} {span:6.0f} s {len(samples):4d} samples  {first / 2**20:7.1f} -> {last / 2**20:7.1f} MiB "
              f"({ratio:.2f}x) {verdict}")
        if judged and ratio > args.memory_ratio:
            memory_problems.append(f"{name}: {ratio:.2f}x")

    # --- requests per account
    print(f"requests per account (between faults: outside [kill, back + {args.settle:.0f} s]):")
    request_problems: list[str] = []
    for account in soak.tokens:
        mine = [r for r in soak.requests if r.account == account and r.kind != "final-list"]
        calm = [r for r in mine if not soak.in_fault(r.started, r.ended)]
        stormy = [r for r in mine if soak.in_fault(r.started, r.ended)]
        ok_ms = [(r.ended - r.started) * 1000 for r in calm if r.status is not None]
        failed = [r for r in calm if r.status is None or r.status >= 500]
        storm_failed = [r for r in stormy if r.status is None or r.status >= 500]
        figure = (f"p50 {statistics.median(ok_ms):6.1f} ms  p99 {percentile(ok_ms, 99):7.1f} ms  "
                  f"max {max(ok_ms):7.1f} ms" if ok_ms else "none")
        print(f"  {account:<8} between faults {len(calm):5d} requests  {figure}  unanswered or 5xx {len(failed)}; "
              f"in fault windows {len(stormy)} ({len(storm_failed)} unanswered or 5xx)")
        request_problems += [f"{account} {r.kind} at {soak.t(r.started):.1f} s: {r.status or r.error} after "
                             f"{(r.ended - r.started) * 1000:.0f} ms" for r in failed]

    crashes = [f"{f.victim} at {soak.t(f.killed):.0f} s: {f.error[-300:]}" for f in soak.faults if f.kind == "crash"]
    results = [("jobs_ended_once", ended_once), ("no_double_success", double), ("webhooks_signed", webhook_problems),
               ("sessions_live_or_closed", session_problems), ("memory_flat", memory_problems),
               ("requests_answered", request_problems), ("no_crashes", crashes)]
    for name, problems in results:
        for problem in problems[:10]:
            print(f"  {name}: {problem}")
        if len(problems) > 10:
            print(f"  {name}: ... and {len(problems) - 10} more")
    return [(name, len(problems)) for name, problems in results]


# --- setup and teardown -------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the stream and the chaos run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--accounts", type=int, default=3)
    parser.add_argument("--browsers", type=int, default=2)
    parser.add_argument("--job-interval", type=float, default=3.0, help="mean seconds between an account's jobs")
    parser.add_argument("--fault-gap", default="20,40", help="seconds from one fault's recovery to the next kill")
    parser.add_argument("--down", default="1,5", help="seconds a killed thing stays down")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of traffic before the first fault")
    parser.add_argument("--settle", type=float, default=None,
                        help="seconds after a restart still counted in its fault window (default 4 heartbeats)")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="WORKER_HEARTBEAT_SECONDS")
    parser.add_argument("--fps", type=float, default=3.0, help="frames a second a browser sends, at most")
    parser.add_argument("--frame-budget-ms", type=int, default=5000,
                        help="FRAME_BUDGET_MS: high, so that CPU workers offer realtime slots")
    parser.add_argument("--leave-every", type=float, default=240.0,
                        help="mean seconds a live browser stays before it leaves on its own and comes back")
    parser.add_argument("--stall-seconds", type=float, default=20.0,
                        help="a session told live that gets no frame back this long is not live")
    parser.add_argument("--session-timeout", type=float, default=120.0,
                        help="a browser not live again this long after losing it gives up (a violation)")
    parser.add_argument("--drain-seconds", type=float, default=300.0, help="bound on the wait for jobs to end")
    parser.add_argument("--memory-every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--memory-ratio", type=float, default=1.2)
    parser.add_argument("--memory-min-seconds", type=float, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print it")
    args = parser.parse_args()
    if args.settle is None:
        args.settle = 4 * args.heartbeat
    if args.memory_min_seconds is None:
        args.memory_min_seconds = max(60.0, args.minutes * 60 / 4)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    base = Path(tempfile.mkdtemp(prefix="potocolom-soak-"))
    base.chmod(0o711)  # the postgres user goes through it to its own folder
    (base / "pg").mkdir()
    (base / "redis").mkdir()
    (base / "stack").mkdir()
    pg = PrivatePostgres(base / "pg")
    redis = PrivateRedis(base / "redis")
    receiver = Receiver()
    stack: Stack | None = None
    results: list[tuple[str, int]] = []
    try:
        setup_started = now()
        pg.init()
        pg.start()
        redis.start()
        os.environ["DATABASE_URL"] = pg.url
        os.environ["REDIS_URL"] = redis.url
        os.environ.pop("STACK_API_PROCESSES", None)
        stack = Stack(base / "stack", api_processes=2, WEBHOOK_ALLOW_PRIVATE="true",
                      FRAME_BUDGET_MS=str(args.frame_budget_ms), WORKER_HEARTBEAT_SECONDS=str(args.heartbeat),
                      SESSION_SWEEP_SECONDS="5", SESSION_IDLE_SECONDS="120")
        if stack.api_processes != 2:
            raise RuntimeError("the stack did not get two API processes")
        first, worker_token = stack.prepare()
        names = ["alice", "bob", "carol", "dave", "erin", "frank"][:args.accounts]
        tokens = {"alice": first, **{name: stack.manage("create_account", name) for name in names[1:]}}
        models_dir = stack.workdir / "models"
        stack.manage("load_manifests", stack.manage("make_tiny_model", str(models_dir / "tiny")))
        print(f"soak: {args.minutes:g} min, seed {args.seed}; PostgreSQL :{pg.port}, Redis :{redis.port} (our own); "
              f"2 API processes, 2 CPU workers, {args.accounts} accounts, {args.browsers} browsers", flush=True)
        soak = Soak(args, stack, pg, redis, receiver, tokens, worker_token, models_dir)
        soak.start_api(0)
        soak.start_api(1)
        for n in range(2):
            soak.start_worker(n)
        for name, token in tokens.items():
            answer = httpx.get(f"{stack.http_url}/api/v1/account/webhook-secret/", trust_env=False, timeout=30,
                               headers={"Authorization": f"Token {token}"})
            answer.raise_for_status()
            receiver.secrets[name] = answer.json()["secret"]
        ops = stack.manage("create_account", "ops", "--staff")
        queues = httpx.get(f"{stack.http_url}/api/v1/queues/", trust_env=False, timeout=30,
                           headers={"Authorization": f"Token {ops}"}).json()
        print("workers: " + "; ".join(f"{w['worker_id']} slots {w['slots']}" for w in queues["workers"]), flush=True)
        print(f"chaos: a fault every {args.fault_gap} s after the last one's recovery, down {args.down} s, first "
              f"after {args.warmup:.0f} s", flush=True)
        soak.setup_seconds = now() - setup_started

        async def run() -> dict[str, dict]:
            accounts = [Account(soak, name, token) for name, token in tokens.items()]
            try:
                await traffic(soak, accounts)
                listed: dict[str, dict] = {}
                for account in accounts:
                    listed.update(await account.all_jobs())
                return listed
            finally:
                for account in accounts:
                    await account.client.aclose()

        listed = asyncio.run(run())
        kinds = Counter(f.kind for f in soak.faults)
        print(f"faults: {len(soak.faults)} ({', '.join(f'{k} {v}' for k, v in kinds.items())}); "
              f"setup took {soak.setup_seconds:.0f} s")
        for fault in soak.faults:
            print(f"  {soak.t(fault.killed):7.1f} s  {fault.victim:<22} back after {fault.back - fault.killed:5.1f} s"
                  f"{'  ' + fault.error if fault.error else ''}")
        results = check(soak, listed)
        if args.keep:
            print(f"work folder kept: {base}")
        for name, count in results:
            print(f"invariant {name}: {'ok' if count == 0 else f'{count} violations'}")
    finally:
        if stack is not None:
            with contextlib.suppress(Exception):
                if pg.proc is not None and pg.proc.poll() is not None:
                    pg.start()  # so that the stack can drop its database
            stack.close()
        receiver.close()
        redis.close()
        pg.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    sys.exit(1 if any(count for _, count in results) else 0)


if __name__ == "__main__":
    main()
