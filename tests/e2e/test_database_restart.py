"""A real PostgreSQL restart: while the server is down every request answers 503, and when it is back
the same API process answers again, with nothing lost.

The test runs a PostgreSQL server of its own (so it can stop and start it without touching the one
the rest of the suite uses), whatever DATABASE_URL the suite runs with: it needs only the server's
binaries.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_scale import MODEL, Worker, api, running_workers, submit, wait_until
from tests.support.stack import Stack, fake_manifest, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

START_S = 30.0  # initdb, or a start with crash recovery, on a slow CI machine
STOP_S = 30.0


def postgres_bin_dir() -> Path | None:
    """Where `initdb` and `postgres` are: on the PATH, else the newest Debian cluster's bin/."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


class PrivatePostgres:
    """A PostgreSQL server of this test's own, on a data directory of its own. `stop()` is a fast
    shutdown (SIGINT: every session is cut, as a restart does); `start()` again on the same port and
    data directory is a real restart.

    initdb and postgres refuse to run as root: as root they run as the `postgres` user, set by Popen
    itself (`runuser` would stay in between as the parent and turn our SIGINT into SIGTERM, a smart
    shutdown that waits for the API's sessions to end), on a directory that user owns."""

    def __init__(self, bin_dir: Path, user: str | None) -> None:
        self.bin_dir, self.user = bin_dir, user
        self.base = Path(tempfile.mkdtemp(prefix="potocolom-pg-"))  # not tmp_path: root's, mode 700
        self.data = self.base / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        if user is not None:
            shutil.chown(self.base, user, user)

    def run_as(self) -> dict[str, Any]:
        return {} if self.user is None else {"user": self.user, "group": self.user, "extra_groups": []}

    def log(self) -> str:
        return (self.base / "postgres.log").read_text(errors="replace")

    def init(self) -> None:
        result = subprocess.run([str(self.bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                                 "--no-sync", "-E", "UTF8", "--locale=C"], cwd=self.base, capture_output=True,
                                text=True, timeout=120, **self.run_as())
        assert result.returncode == 0, f"initdb failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"

    def start(self) -> None:
        import psycopg

        with open(self.base / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.base),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                cwd=self.base, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **self.run_as())

        def accepts() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"postgres exited:\n{self.log()[-3000:]}"
            try:
                psycopg.connect(self.url, connect_timeout=1).close()
                return True
            except psycopg.OperationalError:
                return False

        wait_until(accepts, "the private PostgreSQL to accept connections", timeout=START_S)

    def presence_holders(self, database_url: str) -> list[int]:
        """The API processes' keys holding their presence locks on that database of this server."""
        import psycopg

        from realtime.admission.presence import PRESENCE_LOCKS

        try:
            with psycopg.connect(database_url, autocommit=True, connect_timeout=2) as conn:
                rows = conn.execute(
                    "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
                    "classid::bigint = %s AND objsubid = 2 AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())", [PRESENCE_LOCKS]).fetchall()
        except psycopg.OperationalError:
            return []
        return [int(key) for (key,) in rows]

    def stop(self) -> None:
        """A fast shutdown; returns when the postmaster has exited."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(STOP_S)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on the PATH or in /usr/lib/postgresql/*/bin")
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres").pw_name
        except KeyError:
            pytest.skip("running as root, and PostgreSQL refuses root: no `postgres` user to run it as")
    server = PrivatePostgres(bin_dir, user)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.close()


def test_a_postgresql_restart_answers_503_while_it_is_down_then_the_same_process_recovers(
        private_postgres: PrivatePostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", private_postgres.url)  # Stack makes its database on this server
    monkeypatch.delenv("REDIS_URL", raising=False)  # one API process, its queue in process
    monkeypatch.delenv("STACK_API_PROCESSES", raising=False)

    with Stack(workdir=tmp_path, WORKER_HEARTBEAT_SECONDS="1") as stack:
        account, worker_token = stack.prepare()
        stack.register(fake_manifest(MODEL))
        daphne = stack.start_api()
        pid = daphne.proc.pid if daphne.proc is not None else None
        client = api(stack, stack.port, account)
        assert client.get("/api/v1/jobs/").status_code == 200
        before = submit(client)
        assert client.get(f"/api/v1/jobs/{before}/").json()["state"] == "queued"
        assert all_answer(stack, account) == [200] * 4  # 4 HTTP threads (a caller's lane) keep connections

        private_postgres.stop()
        for _ in range(3):  # for as long as it is down, not only the first request after
            response = client.get("/api/v1/jobs/")
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"]
            assert response.json()["error"] == "unavailable"
        response = client.post("/api/v1/jobs/", json={"model_id": MODEL, "params": {"prompt": "p"}})
        assert response.status_code == 503 and response.headers["Retry-After"], response.text
        assert response.json()["error"] == "unavailable"
        assert daphne.running

        private_postgres.start()
        wait_until(lambda: client.get("/api/v1/jobs/").status_code == 200, "the API to recover by itself",
                   timeout=30)
        assert daphne.running and daphne.proc is not None and daphne.proc.pid == pid, "no restart of Daphne"
        # Threads idle since before the restart check their kept connection before using it (without
        # that, a thread's first request after the restart answered 503: a round may miss such a thread).
        assert [all_answer(stack, account) for _ in range(3)] == [[200] * 4] * 3
        job = client.get(f"/api/v1/jobs/{before}/").json()
        assert (job["state"], job["position"]) == ("queued", 1)
        after = submit(client)
        job = client.get(f"/api/v1/jobs/{after}/").json()
        assert (job["state"], job["position"]) == ("queued", 2)

        # A worker that connects now gets both jobs, in the order they were submitted.
        with running_workers() as workers:
            worker = workers.add(Worker([f"ws://127.0.0.1:{stack.port}/ws/worker/?token={worker_token}"], "after:0"))
            wait_until(lambda: len(worker.jobs) == 2, "both jobs to be dispatched", timeout=30)
            assert [m["job_id"] for m in worker.jobs] == [before, after]
            wait_until(lambda: all(client.get(f"/api/v1/jobs/{j}/").json()["state"] == "succeeded"
                                   for j in (before, after)), "both jobs to succeed", timeout=30)


def all_answer(stack: Stack, account: str) -> list[int]:
    """The statuses of 4 GETs sent at once (each on an HTTP thread of its own)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> int:
        return api(stack, stack.port, account).get("/api/v1/jobs/").status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(4)))


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="two API processes share their queue through Redis: "
                    "set REDIS_URL (CI's second pass does)")
def test_a_postgresql_restart_under_two_processes_kills_no_worker_job_or_session(
        private_postgres: PrivatePostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While PostgreSQL is down no process can write that its workers are alive, and the restart takes
    every process's presence lock: none of that is a death. Held jobs stay with their worker (no
    retry), live sessions stay live, queued ones keep their places."""

    from tests.e2e.test_scale import LIVE_MODEL, RealtimeWorker, canvas, next_of, open_session, states

    monkeypatch.setenv("DATABASE_URL", private_postgres.url)
    monkeypatch.delenv("STACK_API_PROCESSES", raising=False)
    heartbeat, sweep = 1.0, 1.0
    with Stack(workdir=tmp_path, WORKER_HEARTBEAT_SECONDS=str(heartbeat), SESSION_SWEEP_SECONDS=str(sweep)) as stack:
        stack.env["REDIS_URL"] = os.environ["REDIS_URL"]
        alice, worker_token = stack.prepare()
        bob = stack.manage("create_account", "bob")
        stack.register(fake_manifest(MODEL), fake_manifest(LIVE_MODEL, ("txt2img", "img2img")))
        stack.start_api()
        stack.start_api(port=stack.scale_port)
        one, two = stack.port, stack.scale_port
        client = api(stack, one, alice)
        with running_workers() as workers:
            holder = workers.add(Worker([f"ws://127.0.0.1:{one}/ws/worker/?token={worker_token}"], "holder:0",
                                        finish=False))
            painter = workers.add(RealtimeWorker([f"ws://127.0.0.1:{two}/ws/worker/?token={worker_token}"],
                                                 "painter:0"))
            wait_until(lambda: holder.hellos == 1 and painter.hellos == 1, "both workers' welcomes")
            job_id = submit(client)
            wait_until(lambda: len(holder.jobs) == 1, "the job to reach its worker")

            async def before() -> tuple[Any, Any, Any]:
                live = await open_session(one, alice)  # its worker is on the other process
                await next_of(live, {"type": "state", "state": "live"}, 30)
                first = await open_session(two, bob)
                assert await next_of(first, {"type": "state"}, 30) == {"type": "state", "state": "queued",
                                                                       "position": 1}
                second = await open_session(one, alice)
                assert await next_of(second, {"type": "state"}, 20) == {"type": "state", "state": "queued",
                                                                        "position": 2}
                return live, first, second

            live, first, second = workers.call(before())

            private_postgres.stop()
            # An outage longer than the dead-worker window (4 heartbeat periods) and than the grace
            # for presence locks (2 sweep periods): the length of the fault under test, not a wait.
            time.sleep(4 * heartbeat + 2 * sweep + 1)
            private_postgres.start()
            wait_until(lambda: client.get("/api/v1/jobs/").status_code == 200, "the API to answer again", 30)
            wait_until(lambda: len(private_postgres.presence_holders(stack.database_url)) == 2,
                       "both processes to take their presence locks again", 30)
            # Let every rule that could declare someone dead come round again (sweeps run every period).
            time.sleep(4 * heartbeat + 2 * sweep + 1)

            job = states(client, [job_id])[job_id]
            assert (job["state"], job["attempts"], job["worker_id"]) == ("dispatched", 1, "holder:0"), job
            assert len(holder.jobs) == 1, "the job was not dispatched again"
            assert painter.ends == [], "no session was ended on its worker"

            async def after() -> None:
                await live.send(canvas(1))  # still live on the same worker, across processes
                assert (await next_of(live, {"type": "frame"}, 20))["seq"] == 1
                await live.close()  # its slot goes to the first in the queue; the second moves up
                assert (await next_of(first, {"type": "state"}, 20))["state"] == "live"
                assert await next_of(second, {"type": "state"}, 20) == {"type": "state", "state": "queued",
                                                                        "position": 1}
                for ws in (first, second):
                    await ws.close()

            workers.call(after())
            workers.call(holder.complete(job_id))
            wait_until(lambda: states(client, [job_id])[job_id]["state"] == "succeeded", "the job to succeed", 30)
