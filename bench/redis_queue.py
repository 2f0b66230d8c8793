"""The shared job queue in Redis (RedisQueues) against the in-process one, 100,000 queued jobs.

Prints, in one run: MemoryQueues.rebuild as the baseline; RedisQueues.rebuild (close the queue,
stage in chunks, swap in); plain pipelined ZADD + HSET of the same rows (what naive chunked writes
cost); then pushes, and pops by 1 and by 8 processes (threads with their own clients) per second.
Goal: a rebuild of 100,000 jobs well under 1 s.

    REDIS_URL=redis://127.0.0.1:6379/15 .venv/bin/python bench/redis_queue.py [--jobs N]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduling.policy import QueuedJob
from scheduling.queues.memory import MemoryQueues  # noqa: E402
from scheduling.queues.redis import RedisQueues, member_of, redis_client_from_url  # noqa: E402

MODELS = ("model-a", "model-b", "model-c")


def best_of(runs: int, action) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def naive_writes(url: str, prefix: str, jobs: list[QueuedJob]) -> None:
    client = redis_client_from_url(url)
    pipe = client.pipeline(transaction=False)
    for start in range(0, len(jobs), 10_000):
        chunk = jobs[start:start + 10_000]
        for model in MODELS:
            members = {member_of(j): 0 for j in chunk if j.model_id == model}
            if members:
                pipe.zadd(f"{prefix}:naive:q:{model}", members)
        pipe.hset(f"{prefix}:naive:jobs", mapping={j.job_id: member_of(j) + j.model_id for j in chunk})
        pipe.execute()
    client.delete(*(f"{prefix}:naive:q:{model}" for model in MODELS), f"{prefix}:naive:jobs")


def pops_per_second(url: str, prefix: str, jobs: list[QueuedJob], processes: int) -> float:
    clients = [redis_client_from_url(url) for _ in range(processes)]
    queues = [RedisQueues(client, prefix) for client in clients]
    queues[0].rebuild(jobs)
    barrier = threading.Barrier(processes + 1)

    def pop_all(mine: RedisQueues) -> None:
        barrier.wait()
        while mine.pop_for(MODELS) is not None:
            pass

    threads = [threading.Thread(target=pop_all, args=(mine,)) for mine in queues]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
    return len(jobs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"
    base_us = int(time.time() * 1e6) - args.jobs * 10
    jobs = [QueuedJob(str(uuid.uuid4()), MODELS[n % 3], n % 10, base_us + n * 10) for n in range(args.jobs)]
    prefix = f"bench:potocolom:jobs:{uuid.uuid4().hex}"
    client = redis_client_from_url(url)
    queues = RedisQueues(client, prefix)
    try:
        in_process_s = best_of(3, lambda: MemoryQueues().rebuild(jobs))
        redis_s = best_of(3, lambda: queues.rebuild(jobs))
        naive_s = best_of(3, lambda: naive_writes(url, prefix, jobs))
        queues.rebuild([])
        started = time.perf_counter()
        for queued in jobs[:20_000]:
            queues.push(queued)
        push_rate = 20_000 / (time.perf_counter() - started)
        pop_1 = pops_per_second(url, prefix, jobs[:20_000], 1)
        pop_8 = pops_per_second(url, prefix, jobs[:20_000], 8)
    finally:
        queues.delete_all()
        client.close()
    print(f"queued jobs:                              {args.jobs}")
    print(f"baseline MemoryQueues.rebuild:         {in_process_s * 1000:8.0f} ms")
    print(f"RedisQueues.rebuild (stage + swap):       {redis_s * 1000:8.0f} ms  goal < 1000 ms: "
          f"{'met' if redis_s < 1 else 'NOT met'}")
    print(f"naive pipelined ZADD + HSET, same rows:   {naive_s * 1000:8.0f} ms")
    print(f"push, one process:                        {push_rate:8.0f} /s")
    print(f"pop_for 3 models, one process:            {pop_1:8.0f} /s")
    print(f"pop_for 3 models, 8 processes at once:    {pop_8:8.0f} /s")


if __name__ == "__main__":
    main()
