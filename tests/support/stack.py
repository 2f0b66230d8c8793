"""A local stack of real processes, for end-to-end tests and benchmarks: a fresh database, Daphne
with the contract's command line, `manage.py` commands and `runworker_gpu`.

Only the standard library and the project's own commands: each process runs in its own process
group and is stopped by its PID.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DAPHNE_OPTIONS = ("--websocket-max-message-size", "16777216", "--websocket-max-frame-size", "16777216")
CONTRACT_SETTINGS = ("DATABASE_URL", "REDIS_URL", "JOB_DISPATCH_DEPTH", "ACCOUNT_SESSION_LIMIT",
                     "SESSION_IDLE_SECONDS", "SESSION_SWEEP_SECONDS", "FRAME_BUDGET_MS",
                     "WORKER_HEARTBEAT_SECONDS", "MEMORY_MODE", "DJANGO_SETTINGS_MODULE")
# What the test process sets for itself (tests/environment.py) and a served process must not inherit.
TEST_PROCESS_SETTINGS = ("QUEUE_REBUILD_AT_START", "DEAD_WORKER_SWEEP")


def serve_http(handler: type) -> http.server.ThreadingHTTPServer:
    """A threaded HTTP server on a free loopback port, serving `handler` from a daemon thread
    (benches' webhook receivers); `server.server_address[1]` is its port, `shutdown()` stops it."""
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Process:
    """A subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> Process:
        with open(self.log_path, "ab") as log:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
                return

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Stack:
    """One API on a fresh database (SQLite by default; a new PostgreSQL database when DATABASE_URL
    points at PostgreSQL), with REDIS_URL passed on when set."""

    def __init__(self, workdir: Path | None = None, *, api_processes: int | None = None, **settings: str) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="potocolom-stack-"))
        self.port = free_port()
        self.processes: list[Process] = []
        self.apis: dict[int, Process] = {}  # port -> its Daphne
        self.database_url, self._drop = self._fresh_database()
        env = {k: v for k, v in os.environ.items() if k not in CONTRACT_SETTINGS + TEST_PROCESS_SETTINGS}
        env.update({"PYTHONUNBUFFERED": "1", "DATABASE_URL": self.database_url,
                    "MEDIA_ROOT": str(self.workdir / "media"), **settings})
        if os.environ.get("REDIS_URL"):
            env["REDIS_URL"] = os.environ["REDIS_URL"]
        self.env = env
        # Two API processes (STACK_API_PROCESSES=2, CI's second pass): `start_api()` starts both, REST
        # clients and browsers use the first, `start_worker` connects workers to the second, so
        # every end-to-end test crosses processes. Only with PostgreSQL and Redis to share.
        wanted = api_processes or int(os.environ.get("STACK_API_PROCESSES") or 1)
        shared = bool(os.environ.get("REDIS_URL")) and self._drop is not None
        self.api_processes = 2 if wanted >= 2 and shared else 1

    def _fresh_database(self) -> tuple[str, str | None]:
        base = os.environ.get("DATABASE_URL", "")
        if base.startswith(("postgres://", "postgresql://")):
            name = f"stack_{uuid.uuid4().hex[:12]}"
            admin = urllib.parse.urlsplit(base)._replace(path="/postgres").geturl()
            _pg_execute(admin, f'CREATE DATABASE "{name}"')
            return urllib.parse.urlsplit(base)._replace(path=f"/{name}").geturl(), name
        return f"sqlite:///{self.workdir / 'db.sqlite3'}", None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def worker_ws_url(self) -> str:
        """Where `start_worker` connects: the second API process when there are two."""
        return f"ws://127.0.0.1:{self.scale_port}" if self.api_processes == 2 else self.ws_url

    @property
    def scale_port(self) -> int:
        """The port of a second API process (started with `start_api(port=stack.scale_port)`)."""
        if not hasattr(self, "_scale_port"):
            self._scale_port = free_port()
        return self._scale_port

    def manage(self, *args: str, timeout: float = 300) -> str:
        """Run a management command; its last printed line."""
        result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                                text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def prepare(self) -> tuple[str, str]:
        """Migrate and make an account and a worker token; (account token, worker token)."""
        self.manage("migrate", "--noinput")
        return self.manage("create_account", "alice"), self.manage("create_worker_token", "stack")

    def register(self, *manifests: dict[str, object]) -> None:
        """Write manifests to a file and load them with `load_manifests`."""
        path = self.workdir / f"manifests-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(list(manifests)))
        self.manage("load_manifests", str(path))

    def start_api(self, timeout: float = 90, *, port: int | None = None) -> Process:
        """Daphne on this stack's port, or on `port` (another API process on the same database and
        Redis: see `scale_port`); with two API processes, the second too. One that runs already on
        that port is left as it is."""
        both = port is None and self.api_processes == 2
        port = port or self.port
        if port in self.apis and self.apis[port].running:
            api = self.apis[port]
        else:
            api = self._start_daphne(port, timeout)
        if both:
            self.start_api(timeout, port=self.scale_port)
        return api

    def _start_daphne(self, port: int, timeout: float) -> Process:
        argv = [str(Path(sys.executable).parent / "daphne"), "-b", "127.0.0.1", "-p", str(port),
                *DAPHNE_OPTIONS, "potocolom.asgi:application"]
        log_name = "daphne.log" if port == self.port else f"daphne-{port}.log"
        api = self.launch(Process("daphne", argv, self.env, self.workdir / log_name))
        self.apis[port] = api
        deadline = time.monotonic() + timeout
        while not _answers_http(port):
            if not api.running or time.monotonic() > deadline:
                raise RuntimeError(f"Daphne did not start:\n{api.log()[-3000:]}")
            time.sleep(0.05)
        return api

    def kill(self, process: Process) -> None:
        """Kill a process as a crash would (SIGKILL, no shutdown) and forget it."""
        if process.proc is not None and process.running:
            os.killpg(process.proc.pid, signal.SIGKILL)
            process.proc.wait(10)
        self.processes.remove(process)

    def start_worker(self, token: str, models_dir: Path, *options: str, log_name: str = "worker.log") -> Process:
        """`runworker_gpu` on the CPU, or on STACK_WORKER_DEVICE (`cuda` runs the end-to-end tests'
        workers on a GPU host); its output in `log_name` under the work dir."""
        device = os.environ.get("STACK_WORKER_DEVICE") or "cpu"
        argv = [sys.executable, "manage.py", "runworker_gpu", "--api", self.worker_ws_url, "--token", token,
                "--device", device, "--models-dir", str(models_dir), *options]
        return self.launch(Process("runworker_gpu", argv, self.env, self.workdir / log_name))

    def launch(self, process: Process) -> Process:
        self.processes.append(process.start())
        return process

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self._drop:
            admin = urllib.parse.urlsplit(self.database_url)._replace(path="/postgres").geturl()
            with contextlib.suppress(Exception):
                _pg_execute(admin, f'DROP DATABASE IF EXISTS "{self._drop}" WITH (FORCE)')

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fake_manifest(model_id: str, capabilities: tuple[str, ...] = ("txt2img",)) -> dict[str, object]:
    """A manifest that needs no weights (for fake workers): only a prompt is required."""
    return {"model_id": model_id, "tier": "draft", "cost": 1.0, "capabilities": list(capabilities),
            "pipeline": "StableDiffusionPipeline", "source": "bench/none",
            "params_schema": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}


# A 1x1 PNG, base64: what fake workers send back as an image.
TINY_PNG_B64 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVQI12P4z8AAAAMBAQAYeP0KAAAAAElFTkSuQmCC")


class BenchWorker:
    """The worker side of the socket for benches: serves `model` (live with `slots` > 0), finishes
    each job at once, accepts every session and answers each frame at once; heartbeats as told."""

    def __init__(self, url: str, name: str, model: str, *, slots: int = 0) -> None:
        self.url, self.name, self.model, self.slots = url, name, model, slots
        self.finished = 0
        self.ready = asyncio.Event()

    async def run(self) -> None:
        import websockets

        async with websockets.connect(self.url, max_size=None, compression=None) as ws:
            await ws.send(json.dumps({"type": "hello", "worker_id": self.name, "gpu": None, "models": [
                {"model_id": self.model, "rung": "full", "realtime": self.slots > 0,
                 "frame_ms_p95": 10.0 if self.slots else None, "realtime_slots": self.slots}]}))
            beat: asyncio.Task | None = None
            try:
                async for raw in ws:
                    message = json.loads(raw)
                    kind = message["type"]
                    if kind == "welcome":
                        beat = asyncio.create_task(self._heartbeat(ws, float(message["heartbeat_seconds"])))
                        self.ready.set()
                    elif kind == "job":
                        await ws.send(json.dumps({"type": "job_result", "job_id": message["job_id"],
                                                  "images": [TINY_PNG_B64], "gpu_ms": 0.0, "rung": "full"}))
                        self.finished += 1
                    elif kind == "session_start":
                        await ws.send(json.dumps({"type": "session_accepted", "session_id": message["session_id"]}))
                    elif kind == "frame":
                        await ws.send(json.dumps({"type": "frame_result", "session_id": message["session_id"],
                                                  "seq": message["seq"], "image": TINY_PNG_B64, "gpu_ms": 0.0,
                                                  "batch_size": 1}))
            finally:
                if beat is not None:
                    beat.cancel()

    @staticmethod
    async def _heartbeat(ws: Any, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await ws.send(json.dumps({"type": "heartbeat"}))


async def next_of(ws: Any, wanted: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """The next JSON message on a websocket with these fields (others are skipped)."""
    async def read() -> dict[str, Any]:
        while True:
            message = json.loads(await ws.recv())
            if all(message.get(k) == v for k, v in wanted.items()):
                return message

    return await asyncio.wait_for(read(), timeout)


def _answers_http(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/api/v1/")
        conn.getresponse().read()
        conn.close()
        return True
    except (OSError, http.client.HTTPException):
        return False


def _pg_execute(url: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement.encode())
