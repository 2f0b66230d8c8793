"""Safe to share, measured: parts chosen by name, each against its own baseline from the same run.

  admission  (b) admission at scale: with Q sessions queued (100, 1,000, 2,000), the p95 of a join
             (socket open -> its `queued` position) and of "head leaves -> the last queued session
             hears its new place", on one API process and on two (the queued browsers split across
             both). Goal: at 2,000 no more than 2x the figure at 100.

    .venv/bin/python bench/tenancy.py admission [--sizes 100,1000,2000] [--repeats 10]

On PostgreSQL and Redis (DATABASE_URL/REDIS_URL, or the local servers by default): the shared
admission is what is measured.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/9")

import websockets  # noqa: E402

from tests.support.stack import Stack, fake_manifest  # noqa: E402

MODEL = "tenancy-bench"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def position_of(ws: Any, timeout: float = 120.0) -> int:
    """The next `queued` position a browser socket is told."""
    async def read() -> int:
        while True:
            message = json.loads(await ws.recv())
            if message.get("type") == "state" and message.get("state") == "queued":
                return int(message["position"])
    return await asyncio.wait_for(read(), timeout)


async def admission_at(ports: list[int], account: str, queued: int, repeats: int) -> tuple[list[float], list[float]]:
    """(join ms, head-leaves -> last-hears ms) with `queued` sessions waiting (no slot anywhere)."""
    urls = [f"ws://127.0.0.1:{port}/ws/session/?model_id={MODEL}&token={account}" for port in ports]
    sockets: list[Any] = []
    joins: list[float] = []
    moves: list[float] = []
    try:
        for n in range(queued):
            sockets.append(await websockets.connect(urls[n % len(urls)], compression=None, open_timeout=60))
            await position_of(sockets[-1])
        for n in range(repeats):
            started = time.perf_counter()  # a join at the tail: only its own position is new
            ws = await websockets.connect(urls[n % len(urls)], compression=None, open_timeout=60)
            await position_of(ws)
            joins.append((time.perf_counter() - started) * 1000)
            sockets.append(ws)
            last = sockets[-1]
            started = time.perf_counter()  # the head leaves: every queued session moves up one
            await sockets.pop(0).close()
            await position_of(last)
            moves.append((time.perf_counter() - started) * 1000)
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return joins, moves


def admission(args: argparse.Namespace) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    print(f"(b) admission at scale: queued sessions {sizes}, {args.repeats} joins and head departures each")
    with Stack(api_processes=1, ACCOUNT_SESSION_LIMIT=str(max(sizes) + args.repeats + 10),
               SESSION_IDLE_SECONDS="3600", SESSION_SWEEP_SECONDS="3600") as stack:
        account, _ = stack.prepare()
        stack.register(fake_manifest(MODEL, ("txt2img", "img2img")))
        stack.start_api()
        for label, ports_of in (("one API process", lambda: [stack.port]),
                                ("two API processes", lambda: [stack.port, stack.scale_port])):
            ports: list[int] = ports_of()
            for port in ports:
                stack.start_api(port=port)
            figures: dict[int, tuple[float, float]] = {}
            for size in sizes:
                joins, moves = asyncio.run(admission_at(ports, account, size, args.repeats))
                figures[size] = (percentile(joins, 95), percentile(moves, 95))
                print(f"  {label:<18} {size:>5} queued   join p95 {figures[size][0]:8.2f} ms   "
                      f"head leaves -> last hears p95 {figures[size][1]:8.2f} ms")
            base, top = figures[sizes[0]], figures[sizes[-1]]
            for name, index in (("join", 0), ("head leaves", 1)):
                ratio = top[index] / base[index] if base[index] else float("inf")
                print(f"  {label:<18} {name} at {sizes[-1]} vs {sizes[0]}: {ratio:.2f}x   "
                      f"goal <= 2x: {'met' if ratio <= 2 else 'NOT met'}")


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {"admission": admission}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=list(PARTS), help=f"which parts: {', '.join(PARTS)} (all)")
    parser.add_argument("--sizes", default="100,1000,2000", help="admission: queued sessions, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    print(f"database {os.environ['DATABASE_URL'].split('@')[-1]}, Redis {os.environ['REDIS_URL']}, "
          f"{os.cpu_count()} CPUs\n")
    for part in args.parts:
        with contextlib.suppress(KeyboardInterrupt):
            PARTS[part](args)
        print()


if __name__ == "__main__":
    main()
