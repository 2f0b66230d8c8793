"""Two API processes (two Daphnes on two ports) on one PostgreSQL database and one Redis: one job
queue for both. Runs where REDIS_URL is set (CI's second pass); the first pass has one process.

Workers here are `websockets` clients speaking the worker side of the contract; each finishes a job
as soon as it gets it (or holds it, for the kill test), and records every `job` message it got.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.stack import TINY_PNG_B64, Stack, fake_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="two API processes share their queue "
                                 "through Redis: set REDIS_URL (CI's second pass does)")]

MODEL = "scale-a"
WAIT_S = 60.0


class Worker:
    """A worker socket on one API process (reconnecting to `urls` in turn when its socket drops)."""

    def __init__(self, urls: list[str], worker_id: str, *, finish: bool = True) -> None:
        self.urls, self.worker_id, self.finish = urls, worker_id, finish
        self.jobs: list[dict[str, Any]] = []
        self.hellos = 0
        self.ws: Any = None

    def hello_models(self) -> list[dict[str, Any]]:
        return [{"model_id": MODEL, "rung": "full", "realtime": False, "frame_ms_p95": None, "realtime_slots": 0}]

    async def run(self) -> None:
        import websockets

        attempt = 0
        while True:
            url = self.urls[attempt % len(self.urls)]
            attempt += 1
            try:
                async with websockets.connect(url, max_size=None, open_timeout=5) as ws:
                    self.ws = ws
                    await ws.send(json.dumps({"type": "hello", "worker_id": self.worker_id, "gpu": None,
                                              "models": self.hello_models()}))
                    beat = None
                    try:
                        async for raw in ws:
                            message = json.loads(raw)
                            if message["type"] == "welcome":
                                self.hellos += 1
                                beat = asyncio.create_task(self.heartbeat(ws, message["heartbeat_seconds"]))
                            await self.on_message(ws, message)
                    finally:
                        if beat is not None:
                            beat.cancel()
            except (OSError, websockets.ConnectionClosed, TimeoutError):
                pass
            await asyncio.sleep(0.1)  # the next API process (or this one, restarted)

    async def on_message(self, ws: Any, message: dict[str, Any]) -> None:
        if message["type"] == "job":
            self.jobs.append(message)
            if self.finish:
                await self.complete(message["job_id"])

    async def complete(self, job_id: str) -> None:
        await self.ws.send(json.dumps({"type": "job_started", "job_id": job_id}))
        await self.ws.send(json.dumps({"type": "job_result", "job_id": job_id, "images": [TINY_PNG_B64],
                                       "gpu_ms": 1.0, "rung": "full"}))

    @staticmethod
    async def heartbeat(ws: Any, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await ws.send(json.dumps({"type": "heartbeat"}))


class Workers(threading.Thread):
    """Worker sockets on their own event loop in a thread, so the test can do blocking HTTP."""

    def __init__(self) -> None:
        super().__init__(name="workers", daemon=True)
        self.loop = asyncio.new_event_loop()

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def add(self, worker: Worker) -> Worker:
        asyncio.run_coroutine_threadsafe(worker.run(), self.loop)
        return worker

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def stop(self) -> None:
        async def cancel_all() -> None:
            running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.join(10)


@contextlib.contextmanager
def running_workers() -> Iterator[Workers]:
    workers = Workers()
    workers.start()
    try:
        yield workers
    finally:
        workers.stop()


def wait_until(predicate: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def scaled(tmp_path: Path) -> Iterator[tuple[Stack, str, str, Workers]]:
    """Two API processes on one database and Redis; (stack, account token, worker token, workers).
    One account submits up to 280 jobs here: its job limit is lifted."""
    with Stack(workdir=tmp_path, WORKER_HEARTBEAT_SECONDS="1", ACCOUNT_JOB_LIMIT="1000") as stack:
        account, worker_token = stack.prepare()
        stack.register(fake_manifest(MODEL))
        stack.start_api()
        stack.start_api(port=stack.scale_port)
        with running_workers() as workers:
            yield stack, account, worker_token, workers


def api(stack: Stack, port: int, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Token {token}"},
                        timeout=30, trust_env=False)


def submit(client: httpx.Client, priority: int = 0) -> str:
    response = client.post("/api/v1/jobs/", json={"model_id": MODEL, "params": {"prompt": "p"}, "priority": priority})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def states(client: httpx.Client, ids: list[str]) -> dict[str, dict[str, Any]]:
    return {job_id: client.get(f"/api/v1/jobs/{job_id}/").json() for job_id in ids}


def test_a_job_submitted_to_one_process_reaches_a_worker_connected_to_the_other(scaled) -> None:
    stack, account, worker_token, workers = scaled
    worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "one:0"))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")
    other = api(stack, stack.scale_port, account)

    job_id = submit(other)
    wait_until(lambda: other.get(f"/api/v1/jobs/{job_id}/").json()["state"] == "succeeded", "the job to succeed")
    assert [m["job_id"] for m in worker.jobs] == [job_id]
    assert other.get(f"/api/v1/jobs/{job_id}/").json()["worker_id"] == "one:0"


def test_a_lost_wake_up_costs_a_job_one_heartbeat_period_not_forever(tmp_path: Path) -> None:
    """The process that queued a job it could not place wakes the others with one PUBLISH on the
    process bus (the channel-layer group without it); a Redis that loses it (a restart, a
    connection being re-made) loses the wake-up. Each process looks at the shared queue again every
    heartbeat period. On a Redis of the test's own, PUBLISH is refused and the group deleted, so
    no wake-up arrives at all."""
    import redis

    with scaled_on_private_redis(tmp_path) as (redis_server, stack, account, worker_token, workers):
        worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "idle:0"))
        wait_until(lambda: worker.hellos == 1, "the worker's welcome")
        other = api(stack, stack.scale_port, account)  # a process without workers
        store = redis.Redis.from_url(redis_server.url)
        store.execute_command("ACL", "SETUSER", "default", "-publish")  # the bus's wake-up is lost
        store.delete("asgi:group:potocolom.workers")  # and so is the layer's: what a restart leaves

        job_id = submit(other)
        wait_until(lambda: len(worker.jobs) == 1, "the job, at the worker's next heartbeat period", timeout=10)
        assert worker.jobs[0]["job_id"] == job_id


def test_many_clients_and_workers_on_two_processes_dispatch_every_job_exactly_once_in_order(scaled) -> None:
    stack, account, worker_token, workers = scaled
    ports = [stack.port, stack.scale_port]
    clients = [api(stack, port, account) for port in ports]

    # 120 jobs wait before any worker connects, submitted to both processes; priorities mixed.
    waiting = [submit(clients[n % 2], priority=n % 3) for n in range(120)]
    expected = sorted(states(clients[0], waiting).values(), key=lambda j: (-j["priority"], j["created_at"], j["id"]))
    assert [j["position"] for j in expected if j["priority"] == 2][:3] == [1, 2, 3]

    # Four workers, two per process, pull them while four clients submit 160 more to both processes.
    pulled = [workers.add(Worker([f"ws://127.0.0.1:{ports[n % 2]}/ws/worker/?token={worker_token}"],
                                 f"host-{n}:0")) for n in range(4)]
    more: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        http = api(stack, ports[n % 2], account)
        for _ in range(40):
            job_id = submit(http)
            with lock:
                more.append(job_id)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    every = waiting + more
    assert len(set(every)) == 280

    wait_until(lambda: sum(len(w.jobs) for w in pulled) >= 280, "every job to be dispatched", timeout=120)
    final = states(clients[1], every)
    assert {j["state"] for j in final.values()} == {"succeeded"}, {j["state"] for j in final.values()}
    dispatched = [m["job_id"] for w in pulled for m in w.jobs]
    assert sorted(dispatched) == sorted(every), "every job dispatched exactly once"
    assert all(m["attempt"] == 1 for w in pulled for m in w.jobs)
    assert all(w.jobs for w in pulled), "every worker got work"

    # Each worker took the jobs that were waiting in queue order (priority, then submission).
    rank = {j["id"]: n for n, j in enumerate(expected)}
    for worker in pulled:
        taken = [rank[m["job_id"]] for m in worker.jobs if m["job_id"] in rank]
        assert taken == sorted(taken), f"{worker.worker_id} got waiting jobs out of order"


def test_killing_one_process_loses_no_job_its_worker_moves_to_the_other(scaled) -> None:
    stack, account, worker_token, workers = scaled
    first = next(p for p in stack.processes if p.name == "daphne" and str(stack.port) in p.argv)
    urls = [f"ws://127.0.0.1:{port}/ws/worker/?token={worker_token}" for port in (stack.port, stack.scale_port)]
    worker = workers.add(Worker(urls, "mover:0", finish=False))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")
    other = api(stack, stack.scale_port, account)
    ids = [submit(other) for _ in range(3)]
    wait_until(lambda: len(worker.jobs) == 2, "the worker to hold two jobs")

    stack.kill(first)  # kill -9: the worker's socket drops; it reconnects to the other process
    wait_until(lambda: worker.hellos == 2, "the worker to say hello to the other process")
    for job_id in [m["job_id"] for m in worker.jobs]:
        workers.call(worker.complete(job_id))
    wait_until(lambda: len(worker.jobs) == 3, "the third job, from the other process")
    workers.call(worker.complete(worker.jobs[2]["job_id"]))

    wait_until(lambda: all(j["state"] == "succeeded" for j in states(other, ids).values()), "every job to succeed")
    final = states(other, ids)
    assert [m["job_id"] for m in worker.jobs] == ids, "each job once, in order"
    assert {j["attempts"] for j in final.values()} == {1}, "a worker that came back keeps its jobs: no retry"


def test_accounts_take_turns_on_the_queue_both_processes_share(scaled) -> None:
    """The contract's fair-share example across processes: alice's a1..a6 through one, bob's b1, b2
    through the other; positions and dispatch alternate between the accounts."""
    stack, alice_token, worker_token, workers = scaled
    alice = api(stack, stack.port, alice_token)
    bob = api(stack, stack.scale_port, stack.manage("create_account", "bob"))
    alices = [submit(alice) for _ in range(6)]
    bobs = [submit(bob) for _ in range(2)]
    order = [alices[0], bobs[0], alices[1], bobs[1], *alices[2:]]

    places = {**{k: v["position"] for k, v in states(bob, bobs).items()},
              **{k: v["position"] for k, v in states(alice, alices).items()}}
    assert [places[job_id] for job_id in order] == list(range(1, 9))
    worker = workers.add(Worker([f"ws://127.0.0.1:{stack.scale_port}/ws/worker/?token={worker_token}"], "turns:0"))
    wait_until(lambda: len(worker.jobs) == 8, "every job to be dispatched")
    assert [m["job_id"] for m in worker.jobs] == order


def test_the_surviving_process_finds_a_killed_processs_dead_worker_with_nothing_connected_to_it(scaled) -> None:
    """A worker on process A holds two running jobs; A is killed and the worker never comes back.
    Process B has no worker and no browser: its own sweep still finds the worker silent and sends
    its jobs back to the queue (attempt 2), within the contract's dead-worker window."""
    stack, account, worker_token, workers = scaled
    first = next(p for p in stack.processes if p.name == "daphne" and str(stack.port) in p.argv)
    worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "doomed:0",
                                finish=False))  # it only ever knows A: once A is gone it stays away
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")
    survivor = api(stack, stack.scale_port, account)
    ids = [submit(survivor) for _ in range(2)]
    wait_until(lambda: len(worker.jobs) == 2, "the worker to hold both jobs")
    for job_id in ids:
        workers.call(worker.ws.send(json.dumps({"type": "job_started", "job_id": job_id})))
    wait_until(lambda: {j["state"] for j in states(survivor, ids).values()} == {"running"}, "both jobs running")

    stack.kill(first)
    # silent for 3 heartbeat periods (1 s here), noticed within 4, plus the sweep's own period
    deadline = time.monotonic() + 20
    while (seen := [(j["state"], j["attempts"]) for j in states(survivor, ids).values()]) != [("queued", 2)] * 2:
        assert time.monotonic() < deadline, f"the survivor did not send the dead worker's jobs back: {seen}"
        time.sleep(0.1)


def test_a_redis_that_lost_the_queue_loses_no_job(scaled) -> None:
    """Redis here keeps nothing on disk: a restart empties it. The queue is rebuilt from the database."""
    import redis

    stack, account, worker_token, workers = scaled
    client = api(stack, stack.scale_port, account)
    ids = [submit(client, priority=p) for p in (0, 1, 0)]
    store = redis.Redis.from_url(os.environ["REDIS_URL"])
    lost = [key for key in store.scan_iter(match="potocolom:*:jobs2:*")]
    assert lost, "the queue lives in Redis"
    store.delete(*lost)  # what a restart of Redis does to it
    store.script_flush()

    assert client.get(f"/api/v1/jobs/{ids[2]}/").json()["position"] == 3
    worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "after:0"))
    wait_until(lambda: len(worker.jobs) == 3, "every job to be dispatched")
    assert [m["job_id"] for m in worker.jobs] == [ids[1], ids[0], ids[2]]


class PrivateRedis:
    """A Redis server of this test's own (as the deployment runs it: nothing on disk), so it can be
    killed and started again without touching the one the rest of the suite uses."""

    def __init__(self, workdir: Path) -> None:
        from tests.support.stack import free_port

        self.port, self.workdir = free_port(), workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(answers, "the private Redis to answer", timeout=20)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def scaled_on_private_redis(tmp_path: Path) -> Iterator[tuple[PrivateRedis, Stack, str, str, Workers]]:
    """Two API processes on a Redis of the test's own, which the test may kill or restrict;
    (redis, stack, account token, worker token, workers)."""
    redis_server = PrivateRedis(tmp_path)
    redis_server.start()
    try:
        with Stack(workdir=tmp_path, WORKER_HEARTBEAT_SECONDS="1") as stack:
            stack.env["REDIS_URL"] = redis_server.url
            account, worker_token = stack.prepare()
            stack.register(fake_manifest(MODEL))
            stack.start_api()
            stack.start_api(port=stack.scale_port)
            with running_workers() as workers:
                yield redis_server, stack, account, worker_token, workers
    finally:
        redis_server.kill()


@pytest.mark.skipif(not os.environ.get("DATABASE_URL", "").startswith("postgres"),
                    reason="the queue is rebuilt from PostgreSQL")
def test_a_redis_restart_loses_no_job_and_both_processes_carry_on(tmp_path: Path) -> None:
    with scaled_on_private_redis(tmp_path) as (redis_server, stack, account, worker_token, workers):
        client = api(stack, stack.scale_port, account)
        ids = [submit(client, priority=p) for p in (0, 1, 0)]

        redis_server.kill()  # kill -9: everything in it is gone, every connection to it drops
        redis_server.start()

        worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"],
                                    "after-restart:0"))
        wait_until(lambda: len(worker.jobs) == 3, "the queued jobs, rebuilt from the database")
        assert [m["job_id"] for m in worker.jobs] == [ids[1], ids[0], ids[2]]
        # The other process still hands its jobs over through the restarted Redis.
        later = submit(client)
        wait_until(lambda: len(worker.jobs) == 4, "a job submitted to the other process")
        assert worker.jobs[3]["job_id"] == later
        final = states(client, [*ids, later])
        assert {j["state"] for j in final.values()} == {"succeeded"}
        assert {j["attempts"] for j in final.values()} == {1}


# --- live sessions on two API processes: one admission ---------------------------------------------

from tests.support.stack import next_of  # noqa: E402  (the session tests' reader)

LIVE_MODEL = "scale-live"
shared_sessions = pytest.mark.skipif(not os.environ.get("DATABASE_URL", "").startswith("postgres"),
                                     reason="shared admission holds PostgreSQL advisory locks")


class RealtimeWorker(Worker):
    """A worker socket offering realtime slots of LIVE_MODEL: it accepts every session_start and
    answers each frame with a frame_result of the same seq, at once."""

    def __init__(self, urls: list[str], worker_id: str, *, slots: int = 1) -> None:
        super().__init__(urls, worker_id)
        self.slots = slots
        self.starts: list[dict[str, Any]] = []
        self.ends: list[str] = []
        self.frames: list[int] = []

    def hello_models(self) -> list[dict[str, Any]]:
        return [{"model_id": LIVE_MODEL, "rung": "full", "realtime": True, "frame_ms_p95": 5.0,
                 "realtime_slots": self.slots}]

    async def on_message(self, ws: Any, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "session_start":
            self.starts.append(message)
            await ws.send(json.dumps({"type": "session_accepted", "session_id": message["session_id"]}))
        elif kind == "session_end":
            self.ends.append(message["session_id"])
        elif kind == "frame":
            self.frames.append(message["seq"])
            await ws.send(json.dumps({"type": "frame_result", "session_id": message["session_id"],
                                      "seq": message["seq"], "image": TINY_PNG_B64, "gpu_ms": 1.0,
                                      "batch_size": 1}))


def canvas(seq: int) -> str:
    return json.dumps({"type": "frame", "seq": seq, "image": f"data:image/png;base64,{TINY_PNG_B64}",
                       "params": {"prompt": "p"}})


@pytest.fixture
def live_scaled(tmp_path: Path) -> Iterator[tuple[Stack, dict[str, str], str, Workers]]:
    """Two API processes sharing admission; (stack, {account: token}, worker token, workers)."""
    with Stack(workdir=tmp_path, WORKER_HEARTBEAT_SECONDS="1", SESSION_SWEEP_SECONDS="1") as stack:
        alice, worker_token = stack.prepare()
        accounts = {"alice": alice, "bob": stack.manage("create_account", "bob")}
        stack.register(fake_manifest(LIVE_MODEL, ("txt2img", "img2img")))
        stack.start_api()
        stack.start_api(port=stack.scale_port)
        with running_workers() as workers:
            yield stack, accounts, worker_token, workers


def session_url(port: int, token: str) -> str:
    return f"ws://127.0.0.1:{port}/ws/session/?model_id={LIVE_MODEL}&token={token}"


async def open_session(port: int, token: str) -> Any:
    import websockets

    return await websockets.connect(session_url(port, token), max_size=None, open_timeout=10)


async def close_code(ws: Any) -> int | None:
    import websockets

    try:
        while True:
            await asyncio.wait_for(ws.recv(), WAIT_S)
    except websockets.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd is not None else None


def daphne_of(stack: Stack, port: int) -> Any:
    return next(p for p in stack.processes if p.name == "daphne" and str(port) in p.argv)


def sweep_holders(stack: Stack) -> list[int]:
    """The pids of the API processes holding the session sweep lock now (pg_locks)."""
    import psycopg

    from realtime.admission.presence import SWEEP_LOCK

    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = %s AND l.objid::bigint = %s "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            list(SWEEP_LOCK)).fetchall()
    return [int(name.split(":")[1]) for (name,) in rows]


@shared_sessions
def test_a_browser_on_one_process_goes_live_on_a_worker_of_the_other_and_gets_its_frames_in_order(
        live_scaled) -> None:
    """30 frames sent at once: one is in flight at a time (v2 backpressure), only the newest waits,
    so some give way; those that come back come in order, the last one among them."""
    stack, accounts, worker_token, workers = live_scaled
    worker = workers.add(RealtimeWorker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "gpu-a:0"))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")

    async def scenario() -> list[int]:
        ws = await open_session(stack.scale_port, accounts["alice"])
        live = await next_of(ws, {"type": "state", "state": "live"}, WAIT_S)
        assert live == {"type": "state", "state": "live", "model_id": LIVE_MODEL, "worker_id": "gpu-a:0"}
        for seq in range(1, 31):
            await ws.send(canvas(seq))
        got = [(await next_of(ws, {"type": "frame"}, WAIT_S))["seq"]]
        while got[-1] != 30:
            got.append((await next_of(ws, {"type": "frame"}, WAIT_S))["seq"])
        await ws.close()
        return got

    got = asyncio.run(scenario())
    assert got[0] == 1 and got[-1] == 30 and got == sorted(set(got)), f"frames back in order, the newest last: {got}"
    assert worker.frames == got, "the worker got exactly the frames that came back"
    wait_until(lambda: worker.ends == [worker.starts[0]["session_id"]], "session_end when the browser left")


@shared_sessions
def test_slots_are_global_one_browser_is_live_and_the_other_process_queues_the_next(live_scaled) -> None:
    stack, accounts, worker_token, workers = live_scaled
    worker = workers.add(RealtimeWorker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "gpu-a:0"))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")

    async def scenario() -> None:
        first = await open_session(stack.port, accounts["alice"])
        await next_of(first, {"type": "state", "state": "live"}, WAIT_S)
        second = await open_session(stack.scale_port, accounts["bob"])
        assert await next_of(second, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                     "position": 1}
        assert len(worker.starts) == 1, "the one slot was given once"

        await first.close()
        live = await next_of(second, {"type": "state", "state": "live"}, WAIT_S)
        assert live["worker_id"] == "gpu-a:0"
        await second.send(canvas(1))
        assert (await next_of(second, {"type": "frame"}, WAIT_S))["seq"] == 1
        await second.close()

    asyncio.run(scenario())
    assert len(worker.starts) == 2 and len({s["session_id"] for s in worker.starts}) == 2


@shared_sessions
def test_the_account_limit_and_positions_hold_across_processes(live_scaled) -> None:
    stack, accounts, _, _ = live_scaled

    async def scenario() -> None:
        one = await open_session(stack.port, accounts["alice"])
        assert await next_of(one, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 1}
        two = await open_session(stack.scale_port, accounts["alice"])
        assert await next_of(two, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 2}
        three = await open_session(stack.scale_port, accounts["alice"])
        assert await close_code(three) == 4003
        four = await open_session(stack.port, accounts["alice"])
        assert await close_code(four) == 4003
        other = await open_session(stack.port, accounts["bob"])
        assert await next_of(other, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                    "position": 3}

        await one.close()  # positions move up on both processes
        assert await next_of(two, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 1}
        assert await next_of(other, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                    "position": 2}
        for ws in (two, other):
            await ws.close()

    asyncio.run(scenario())


@shared_sessions
def test_the_sweep_runs_in_one_process_and_moves_to_the_other_when_it_dies(live_scaled) -> None:
    stack, accounts, _, _ = live_scaled
    pids = {port: daphne_of(stack, port).proc.pid for port in (stack.port, stack.scale_port)}

    async def scenario() -> None:
        # A browser on each process: each process runs its sweep task, and tries for the lock.
        sockets = [await open_session(port, accounts["alice"]) for port in pids]
        for ws in sockets:
            await next_of(ws, {"type": "state", "state": "queued"}, WAIT_S)
        wait_until(lambda: len(sweep_holders(stack)) == 1, "one process to hold the sweep")
        (holder,) = sweep_holders(stack)
        assert holder in pids.values()
        survivor_port = next(port for port, pid in pids.items() if pid != holder)
        dead_place = 1 + next(n for n, pid in enumerate(pids.values()) if pid == holder)
        log = daphne_of(stack, survivor_port).log_path

        stack.kill(next(p for p in stack.processes if p.proc is not None and p.proc.pid == holder))
        wait_until(lambda: sweep_holders(stack) == [pids[survivor_port]], "the other process to take the sweep")
        assert "now runs the session sweep" in log.read_text()

        # The dead process's browser reconnects to the survivor: the account limit does not count
        # the session of a socket that died with its process, and the new session takes its place.
        again = await open_session(survivor_port, accounts["alice"])
        assert await next_of(again, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                    "position": dead_place}
        for ws in sockets + [again]:
            await ws.close()

    asyncio.run(scenario())


@shared_sessions
def test_killing_a_process_loses_no_session_its_worker_moves_and_the_session_goes_live_again(
        live_scaled) -> None:
    stack, accounts, worker_token, workers = live_scaled
    urls = [f"ws://127.0.0.1:{port}/ws/worker/?token={worker_token}" for port in (stack.port, stack.scale_port)]
    worker = workers.add(RealtimeWorker(urls, "mover:0"))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")

    async def scenario() -> None:
        ws = await open_session(stack.scale_port, accounts["alice"])
        await next_of(ws, {"type": "state", "state": "live"}, WAIT_S)
        await ws.send(canvas(1))
        assert (await next_of(ws, {"type": "frame"}, WAIT_S))["seq"] == 1

        stack.kill(daphne_of(stack, stack.port))  # the worker's process: it reconnects to the other
        # Its hello sends the session back to the queue at its old place (first), and admission
        # places it again at once, on the same worker: the next state the browser hears is live.
        live = await next_of(ws, {"type": "state"}, WAIT_S)
        assert live["state"] == "live" and live["worker_id"] == "mover:0" and worker.hellos == 2
        await ws.send(canvas(2))
        assert (await next_of(ws, {"type": "frame"}, WAIT_S))["seq"] == 2
        await ws.close()

    asyncio.run(scenario())
    assert [s["session_id"] for s in worker.starts][0] == worker.starts[1]["session_id"], "the same session resumed"


@shared_sessions
def test_a_browser_whose_process_died_reconnects_to_the_other_and_gets_its_place_back(live_scaled) -> None:
    stack, accounts, _, _ = live_scaled  # no worker: every session waits in the queue

    async def scenario() -> None:
        first = await open_session(stack.port, accounts["alice"])
        assert await next_of(first, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 1}
        second = await open_session(stack.scale_port, accounts["bob"])
        assert await next_of(second, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                     "position": 2}
        third = await open_session(stack.scale_port, accounts["alice"])
        assert await next_of(third, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 3}

        stack.kill(daphne_of(stack, stack.port))  # the first browser's process
        # Its session closes (the sweep finds its process gone): the others move up.
        assert await next_of(second, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                     "position": 1}
        assert await next_of(third, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 2}

        # Its browser reconnects to the other process, with the same model and params: it takes its
        # place back (alice's session still open there is not a place to take), and the sessions
        # that moved up move back down.
        again = await open_session(stack.scale_port, accounts["alice"])
        assert await next_of(again, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 1}
        assert await next_of(second, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                     "position": 2}
        assert await next_of(third, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 3}

        # The place was taken once: another socket of the account joins at the end.
        await third.close()
        fourth = await open_session(stack.scale_port, accounts["alice"])
        assert await next_of(fourth, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                     "position": 3}
        for ws in (again, second, fourth):
            await ws.close()

    asyncio.run(scenario())


@shared_sessions
def test_a_live_session_whose_browser_process_died_comes_back_first_and_goes_live_again(live_scaled) -> None:
    stack, accounts, worker_token, workers = live_scaled
    worker = workers.add(RealtimeWorker([f"ws://127.0.0.1:{stack.scale_port}/ws/worker/?token={worker_token}"],
                                        "stays:0"))
    wait_until(lambda: worker.hellos == 1, "the worker's welcome")

    async def scenario() -> None:
        ws = await open_session(stack.port, accounts["alice"])
        await next_of(ws, {"type": "state", "state": "live"}, WAIT_S)
        (gone,) = [s["session_id"] for s in worker.starts]
        waiting = [await open_session(stack.scale_port, accounts["bob"]) for _ in range(2)]
        for place, bob in enumerate(waiting, start=1):
            assert await next_of(bob, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                      "position": place}

        stack.kill(daphne_of(stack, stack.port))  # the browser's process; the worker's lives on
        # The session closes with its process: its worker gets session_end, the slot goes to the next.
        assert (await next_of(waiting[0], {"type": "state"}, WAIT_S))["state"] == "live"
        assert await next_of(waiting[1], {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                         "position": 1}
        assert gone in worker.ends

        # The browser comes back first in the queue, and is live again at the next free slot.
        again = await open_session(stack.scale_port, accounts["alice"])
        assert await next_of(again, {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued", "position": 1}
        assert await next_of(waiting[1], {"type": "state"}, WAIT_S) == {"type": "state", "state": "queued",
                                                                         "position": 2}
        await waiting[0].close()
        live = await next_of(again, {"type": "state"}, WAIT_S)
        assert live == {"type": "state", "state": "live", "model_id": LIVE_MODEL, "worker_id": "stays:0"}
        await again.send(canvas(1))
        assert (await next_of(again, {"type": "frame"}, WAIT_S))["seq"] == 1
        for sock in (again, waiting[1]):
            await sock.close()

    asyncio.run(scenario())
