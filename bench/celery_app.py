"""The Celery baseline of bench/dispatch.py: a no-op task on Redis, one worker, prefetch 1.

The task records how long after its submission it started (the submitter's wall clock is passed in)."""
from __future__ import annotations

import os
import time

import redis
from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/9")
STARTS = "bench:celery:starts"

app = Celery("bench", broker=BROKER)
app.conf.update(worker_prefetch_multiplier=1, task_acks_late=False, task_ignore_result=True,
                broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
_redis = redis.Redis.from_url(BROKER)


@app.task(name="bench.noop")
def noop(submitted_at: float) -> None:
    _redis.rpush(STARTS, time.time() - submitted_at)
