"""The API's start-to-first-dispatch time with 100,000 queued jobs in PostgreSQL.

Prints, in one run: a raw psycopg read (and sort) of the same queued rows as the baseline; then
Daphne's start on that database (process spawn -> answering HTTP) and the first dispatch (a worker's
hello -> its first `job` message, which includes rebuilding the queue from the database).
Goal: hello -> first job under 1 s.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres .venv/bin/python bench/rebuild.py [--jobs N]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402
import websockets  # noqa: E402

from tests.support.stack import Stack, fake_manifest  # noqa: E402

MODEL = "bench-model"


def psycopg_url(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def insert_jobs(url: str, count: int) -> None:
    """COPY `count` queued jobs (priorities 0-9, a small params payload) straight into the table."""
    with psycopg.connect(psycopg_url(url)) as conn:
        account_id = conn.execute("SELECT id FROM auth_user WHERE username = 'alice'").fetchone()[0]
        base_us = int(time.time() * 1e6) - count * 10
        with conn.cursor().copy("COPY scheduling_job (id, account_id, model_id, params, priority, state, attempts, "
                                "submitted_us, created_at, images, rung) FROM STDIN") as copy:
            for n in range(count):
                us = base_us + n * 10
                created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(us / 1e6)) + f".{us % 1_000_000:06d}+00"
                copy.write_row((uuid.uuid4(), account_id, MODEL, json.dumps({"prompt": f"job {n}"}), n % 10,
                                "queued", 1, us, created, "[]", ""))
        conn.commit()


def raw_read(url: str) -> tuple[float, int]:
    """Seconds to read the queued rows' keys with plain psycopg and sort them into dispatch order."""
    started = time.perf_counter()
    with psycopg.connect(psycopg_url(url)) as conn:
        rows = conn.execute("SELECT id, model_id, priority, submitted_us FROM scheduling_job "
                            "WHERE state = 'queued'").fetchall()
    keys = sorted((-priority, us, str(job_id)) for job_id, _, priority, us in rows)
    return time.perf_counter() - started, len(keys)


async def first_dispatch(ws_url: str, token: str) -> tuple[float, dict]:
    async with websockets.connect(f"{ws_url}/ws/worker/?token={token}", max_size=None) as ws:
        started = time.perf_counter()
        await ws.send(json.dumps({"type": "hello", "worker_id": "bench:0", "gpu": None, "models": [
            {"model_id": MODEL, "rung": "full", "realtime": False, "frame_ms_p95": None, "realtime_slots": 0}]}))
        while True:
            message = json.loads(await ws.recv())
            if message.get("type") == "job":
                return time.perf_counter() - started, message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    args = parser.parse_args()
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    if not os.environ["DATABASE_URL"].startswith(("postgres://", "postgresql://")):
        sys.exit("bench/rebuild.py measures PostgreSQL: set DATABASE_URL to a postgres:// URL")
    with Stack() as stack:
        _, worker_token = stack.prepare()
        stack.register(fake_manifest(MODEL))
        started = time.perf_counter()
        insert_jobs(stack.database_url, args.jobs)
        print(f"inserted {args.jobs} queued jobs in {time.perf_counter() - started:.1f} s")
        with psycopg.connect(psycopg_url(stack.database_url), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE scheduling_job")
        raw_s, rows = min(raw_read(stack.database_url) for _ in range(3))

        api = stack.start_api()
        ready_s = time.monotonic() - api.started_at
        hello_s, job = asyncio.run(first_dispatch(stack.ws_url, worker_token))
        with psycopg.connect(psycopg_url(stack.database_url)) as conn:
            expected = conn.execute("SELECT id FROM scheduling_job WHERE state IN ('queued', 'dispatched') "
                                    "ORDER BY priority DESC, submitted_us, id LIMIT 1").fetchone()[0]
        print(f"\nqueued jobs in PostgreSQL:            {rows}")
        print(f"baseline raw psycopg read + sort:     {raw_s * 1000:8.0f} ms")
        print(f"Daphne spawn -> answering HTTP:       {ready_s * 1000:8.0f} ms  (Django import, no queue work)")
        print(f"worker hello -> first job (rebuild):  {hello_s * 1000:8.0f} ms  goal < 1000 ms: "
              f"{'met' if hello_s < 1 else 'NOT met'}")
        rebuild = re.search(r"rebuilt the job queue from the database: (\d+) queued, \d+ held, in (\d+) ms",
                            api.log())
        print(f"queue rebuild inside the API:         {rebuild.group(2) if rebuild else '?':>8} ms  "
              f"({rebuild.group(1) if rebuild else '?'} jobs; runs while Daphne starts listening)")
        print(f"spawn -> first dispatch in all:       {(ready_s + hello_s) * 1000:8.0f} ms")
        print(f"first job is the head of the queue:   {job['job_id'] == str(expected)}")


if __name__ == "__main__":
    main()
