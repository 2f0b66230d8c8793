"""The database reads that rebuild the job queue (every queued job's key, each account's last turn
per model) and the queue backend JOB_QUEUE names. docs/design/redis-queue.md, "Losing the queue
and rebuilding it"."""
from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import connection
from django.db.models import Max

from scheduling.models import Job, JobState
from scheduling.policy import STEPS_UNSAID, QueuedJob, Turn
from scheduling.queues import JobQueues
from scheduling.queues.memory import MemoryQueues
from scheduling.queues.redis import RecoveringQueues, RedisQueues, redis_client_from_url


def queued_rows() -> list[QueuedJob]:
    """Every queued job's queue key, read in one query (the start-up cost of an API process)."""
    if connection.vendor == "postgresql":  # skip building UUID objects only to turn them back into text
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id::text, model_id, priority, submitted_us, account_id::text, NULL, "
                           f"COALESCE(steps, %s) FROM {Job._meta.db_table} WHERE state = %s",
                           [STEPS_UNSAID, JobState.QUEUED.value])
            return [QueuedJob(*row) for row in cursor.fetchall()]
    rows = Job.objects.filter(state=JobState.QUEUED).values_list("id", "model_id", "priority", "submitted_us",
                                                                 "account_id", "steps")
    return [QueuedJob(str(job_id), model_id, priority, us, str(account), None, STEPS_UNSAID if steps is None else steps)
            for job_id, model_id, priority, us, account, steps in rows]


def turn_rows() -> list[Turn]:
    """Each account's last turn per model (the latest `turn_us` of its jobs there): one grouped
    query over the index on (account, model_id, turn_us)."""
    rows = (Job.objects.filter(turn_us__isnull=False).values("model_id", "account_id")
            .annotate(last=Max("turn_us")).values_list("model_id", "account_id", "last").order_by())
    return [Turn(model_id, str(account), last) for model_id, account, last in rows]


def queues_from_settings() -> JobQueues:
    """The backend JOB_QUEUE names: this process's own (memory), or Redis (the default with
    REDIS_URL), one queue for every API process on the same database. Its keys are named after the
    database, so two deployments (or test databases) on one Redis never share a queue."""
    if settings.JOB_QUEUE != "redis":
        return MemoryQueues()
    database = f"{connection.vendor}:{connection.settings_dict.get('HOST') or ''}:{connection.settings_dict['NAME']}"
    # "jobs2": entries hold each job's steps since issue 26; an older deployment's keys are left aside,
    # and the new queue is rebuilt from the database on first use
    prefix = f"potocolom:{hashlib.sha1(database.encode()).hexdigest()[:12]}:jobs2"
    client = redis_client_from_url(settings.REDIS_URL or "", socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT,
                                   socket_timeout=settings.REDIS_READ_TIMEOUT)  # DATABASE_TIMEOUT_SECONDS
    return RecoveringQueues(RedisQueues(client, prefix), queued_rows, turn_rows)
