"""Scale out: one API process against two, on one PostgreSQL database and one Redis.

In one run, on loopback (DATABASE_URL/REDIS_URL, or the local PostgreSQL and Redis by default):
  (1) jobs/s: 8 keep-alive clients submit N jobs, 4 fake workers finish each job at once; from the
      first POST to the last job_result. One API process (every client and worker on it), then
      two (clients and workers split across both). Goal: two give >= 1.6x the jobs/s of one.
  (2) freed slot -> next session live, p95, with the slot's worker on one process and the waiting
      browser on the other (beside the same figure with both on one process).
  (3) frames/s relayed browser -> API -> worker -> API -> browser with the browser on one process and
      the worker on the other (8 sessions, one frame in flight each), beside a plain
      RedisChannelLayer relay between two processes in the same run: by group_send to a group per
      session and side (what a hand-rolled Channels relay does; the goal's baseline: >= 2x), and by
      send to the other process's channel (a stronger baseline, for information).

    .venv/bin/python bench/scale.py [--jobs 2000] [--repeats 20] [--seconds 5]
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
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")

import websockets  # noqa: E402

from bench.dispatch import KeepAliveClient  # noqa: E402
from tests.support.stack import ROOT, TINY_PNG_B64, BenchWorker, Stack, fake_manifest, next_of  # noqa: E402

MODEL = "scale-bench"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def Worker(url: str, name: str, slots: int = 0) -> BenchWorker:  # noqa: N802 - a worker of MODEL
    return BenchWorker(url, name, MODEL, slots=slots)


async def start_workers(workers: list[BenchWorker]) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.wait_for(asyncio.gather(*(w.ready.wait() for w in workers)), 30)
    return tasks


async def stop(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def jobs_per_second(ports: list[int], account: str, worker_token: str, jobs: int) -> float:
    workers = [Worker(f"ws://127.0.0.1:{ports[n % len(ports)]}/ws/worker/?token={worker_token}",
                      f"jobs-{len(ports)}-{n}:0") for n in range(4)]
    tasks = await start_workers(workers)
    clients = [KeepAliveClient("127.0.0.1", ports[n % len(ports)], account) for n in range(8)]
    body = {"model_id": MODEL, "params": {"prompt": "scale"}}
    try:
        for client in clients:  # warm-up: connections, caches
            status, job = await client.post("/api/v1/jobs/", body)
            assert status == 201, job
        while sum(w.finished for w in workers) < len(clients):
            await asyncio.sleep(0.005)
        done_before = sum(w.finished for w in workers)
        counter = iter(range(jobs))
        started = time.perf_counter()

        async def submitter(client: KeepAliveClient) -> None:
            for _ in counter:
                status, job = await client.post("/api/v1/jobs/", body)
                assert status == 201, job

        await asyncio.gather(*(submitter(c) for c in clients))
        deadline = time.perf_counter() + 120
        while sum(w.finished for w in workers) < done_before + jobs:
            assert time.perf_counter() < deadline, "jobs were lost"
            await asyncio.sleep(0.005)
        return jobs / (time.perf_counter() - started)
    finally:
        for client in clients:
            await client.close()
        await stop(tasks)


async def handover(worker_port: int, browser_ports: tuple[int, int], accounts: tuple[str, str], worker_token: str,
                   repeats: int, name: str) -> list[float] | str:
    """Close the live session A (on browser_ports[0]); time until B (on browser_ports[1]) is live."""
    worker = Worker(f"ws://127.0.0.1:{worker_port}/ws/worker/?token={worker_token}", name, slots=1)
    tasks = await start_workers([worker])
    times = []
    try:
        for _ in range(repeats):
            a = await websockets.connect(f"ws://127.0.0.1:{browser_ports[0]}/ws/session/?model_id={MODEL}"
                                         f"&token={accounts[0]}", compression=None)
            await next_of(a, {"type": "state", "state": "live"}, 10)
            b = await websockets.connect(f"ws://127.0.0.1:{browser_ports[1]}/ws/session/?model_id={MODEL}"
                                         f"&token={accounts[1]}", compression=None)
            await next_of(b, {"type": "state", "state": "queued"}, 10)
            b_live = asyncio.create_task(next_of(b, {"type": "state", "state": "live"}, 10))
            await asyncio.sleep(0.01)
            started = time.perf_counter()
            await a.close()
            try:
                await b_live
            except TimeoutError:
                return "not measured: the waiting session never went live (admission is per process)"
            times.append((time.perf_counter() - started) * 1000)
            await b.close()
            await asyncio.sleep(0.05)
        return times
    except TimeoutError as exc:
        return f"not measured: {exc or 'a session never reached the expected state'}"
    finally:
        await stop(tasks)


async def relayed_frames(worker_port: int, browser_port: int, account: str, worker_token: str, sessions: int,
                         seconds: float) -> float | str:
    worker = Worker(f"ws://127.0.0.1:{worker_port}/ws/worker/?token={worker_token}", "frames:0", slots=sessions)
    tasks = await start_workers([worker])
    url = f"ws://127.0.0.1:{browser_port}/ws/session/?model_id={MODEL}&token={account}"
    sockets = [await websockets.connect(url, max_size=None, compression=None) for _ in range(sessions)]
    image = "data:image/png;base64," + TINY_PNG_B64
    try:
        try:
            await asyncio.gather(*(next_of(ws, {"type": "state", "state": "live"}, 10) for ws in sockets))
        except TimeoutError:
            return "not measured: the sessions never went live on the other process's worker"
        done = [0] * sessions
        deadline = time.perf_counter() + seconds

        async def loop(n: int, ws: Any) -> None:
            seq = 0
            while time.perf_counter() < deadline:
                seq += 1
                await ws.send(json.dumps({"type": "frame", "seq": seq, "image": image,
                                          "params": {"prompt": "p", "strength": 0.5}}))
                await next_of(ws, {"type": "frame", "seq": seq}, 10)
                done[n] += 1

        started = time.perf_counter()
        await asyncio.gather(*(loop(n, ws) for n, ws in enumerate(sockets)))
        return sum(done) / (time.perf_counter() - started)
    finally:
        for ws in sockets:
            with contextlib.suppress(Exception):
                await ws.close()
        await stop(tasks)


PLAIN_RELAY = r"""
import asyncio, json, os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "potocolom.settings")
import django; django.setup()
from channels.layers import get_channel_layer
role, mode, sessions, seconds, image, run = sys.argv[1:7]
sessions, seconds, group = int(sessions), float(seconds), mode == "group"
import logging; logging.getLogger("channels_redis").setLevel(logging.WARNING)

async def main():
    layer = get_channel_layer()
    me = await layer.new_channel()
    if role == "echo":
        if group:  # what a hand-rolled Channels relay does: a group per session and side
            for k in range(sessions):
                await layer.group_add(f"bench-{run}-worker-{k}", me)
        await layer.send(f"scale-bench-echo-{run}", {"type": "hello", "reply_to": me})
        while True:
            message = await layer.receive(me)
            if message["type"] == "stop":
                return
            reply = {"type": "frame", "n": message["n"], "k": message["k"], "image": message["image"]}
            if group:
                await layer.group_send(f"bench-{run}-browser-{message['k']}", reply)
            else:
                await layer.send(message["reply_to"], reply)
    echo = (await layer.receive(f"scale-bench-echo-{run}"))["reply_to"]
    inboxes = [await layer.new_channel() for _ in range(sessions)]
    if group:
        for k, inbox in enumerate(inboxes):
            await layer.group_add(f"bench-{run}-browser-{k}", inbox)
    done = [0] * sessions
    deadline = time.perf_counter() + seconds
    async def loop(k):
        n = 0
        while time.perf_counter() < deadline:
            n += 1
            message = {"type": "frame", "n": n, "k": k, "image": image, "reply_to": inboxes[k]}
            if group:
                await layer.group_send(f"bench-{run}-worker-{k}", message)
            else:
                await layer.send(echo, message)
            while (await layer.receive(inboxes[k]))["n"] != n:
                pass
            done[k] += 1
    started = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(sessions)))
    print(sum(done) / (time.perf_counter() - started))
    await layer.send(echo, {"type": "stop"})

asyncio.run(main())
"""


def plain_redis_relay(mode: str, sessions: int, seconds: float, env: dict[str, str]) -> float | str:
    """Frames/s through a plain RedisChannelLayer between two processes, one frame in flight per
    session: by group_send to a group per session and side (mode "group"), or by send to a channel."""
    argv = [sys.executable, "-c", PLAIN_RELAY]
    image = "data:image/png;base64," + TINY_PNG_B64
    run = uuid.uuid4().hex[:8]  # groups of earlier runs stay in Redis for a day: never reuse their names
    echo = subprocess.Popen([*argv, "echo", mode, str(sessions), str(seconds), image, run], cwd=ROOT, env=env)
    try:
        result = subprocess.run([*argv, "drive", mode, str(sessions), str(seconds), image, run], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=seconds + 60)
        if result.returncode != 0:
            return f"not measured: {result.stderr.strip().splitlines()[-1:]}"
        return float(result.stdout.strip().splitlines()[-1])
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            echo.wait(10)
        echo.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(f"database {os.environ['DATABASE_URL'].split('@')[-1]}, Redis {os.environ['REDIS_URL']}, "
          f"{os.cpu_count()} CPUs\n")
    # one account submits every job as fast as it can: its limit and rate are lifted out of the way
    with Stack(api_processes=1, ACCOUNT_SESSION_LIMIT="20", SESSION_IDLE_SECONDS="300", ACCOUNT_JOB_LIMIT="1000000",
               JOB_SUBMIT_RATE="1000000/minute") as stack:
        account, worker_token = stack.prepare()
        other_account = stack.manage("create_account", "bob")
        stack.register(fake_manifest(MODEL, ("txt2img", "img2img")))
        stack.start_api()
        one = [stack.port]
        print(f"(1) jobs/s, {args.jobs} jobs, 8 clients, 4 workers that finish each job at once")
        single = asyncio.run(jobs_per_second(one, account, worker_token, args.jobs))
        print(f"  one API process    {single:7.0f} jobs/s")
        stack.start_api(port=stack.scale_port)
        two = [stack.port, stack.scale_port]
        double = asyncio.run(jobs_per_second(two, account, worker_token, args.jobs))
        print(f"  two API processes  {double:7.0f} jobs/s   ratio {double / single:.2f}x   "
              f"goal >= 1.6x: {'met' if double / single >= 1.6 else 'NOT met'}")

        print(f"\n(2) freed slot -> next session live, {args.repeats} handovers")
        accounts = (account, other_account)
        for label, ports, name in (("worker and browsers on one process", (stack.port, stack.port), "hand-1:0"),
                                   ("worker on one, waiting browser on the other", (stack.port, stack.scale_port),
                                    "hand-2:0")):
            result = asyncio.run(handover(stack.port, ports, accounts, worker_token, args.repeats, name))
            if isinstance(result, str):
                print(f"  {label:<46} {result}")
            else:
                print(f"  {label:<46} p50 {statistics.median(result):6.2f} ms   p95 {percentile(result, 95):6.2f} ms")

        print(f"\n(3) frames/s relayed across processes, 8 sessions, {args.seconds:g} s")
        relayed = asyncio.run(relayed_frames(stack.port, stack.scale_port, account, worker_token, 8, args.seconds))
        plain = plain_redis_relay("group", 8, args.seconds, stack.env)
        direct = plain_redis_relay("send", 8, args.seconds, stack.env)
        for label, value in (("browser on B -> worker on A (potocolom)", relayed),
                             ("plain RedisChannelLayer group relay", plain),
                             ("plain RedisChannelLayer send relay", direct)):
            print(f"  {label:<46} " + (f"{value:7.0f} frames/s" if isinstance(value, float) else value))
        if isinstance(relayed, float) and isinstance(plain, float):
            print(f"  ratio to the group relay {relayed / plain:.2f}x   goal >= 2x: "
                  f"{'met' if relayed / plain >= 2 else 'NOT met'}")
        if isinstance(relayed, float) and isinstance(direct, float):
            print(f"  ratio to the send relay {relayed / direct:.2f}x")


if __name__ == "__main__":
    main()
