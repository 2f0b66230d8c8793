"""Writes of the job path: each state change is a compare-and-set in the database, then this
process's dispatcher is told, then messages go to workers after the commit. Services are
synchronous (consumers call them through database_sync_to_async) and take the clock as `now=`."""
from __future__ import annotations

from scheduling.services.dispatch import (
    ACCOUNT_KEY_SALT,
    WORKERS_GROUP,
    Claimed,
    account_key,
    jobs_dispatch,
    jobs_dispatch_for,
    jobs_dispatch_or_wake,
    jobs_make_room,
    waiting_of,
)
from scheduling.services.job_rows import EPOCH, queued_job, to_microseconds
from scheduling.services.reports import (
    MAX_IMAGE_BYTES,
    decode_image,
    job_checkpoint,
    job_fail,
    job_finish,
    job_left_worker,
    job_preempt_held,
    job_preempted,
    job_progress,
    job_started,
)
from scheduling.services.requests import JobRequest, job_cancel, job_pause, job_requeue, job_resume, job_submit
from scheduling.services.worker_jobs import (
    WORKER_LOST,
    jobs_return,
    orphans_sweep,
    worker_jobs_connect,
    worker_jobs_disconnect,
    worker_jobs_drain,
    worker_model_rung,
    worker_model_serve,
    worker_model_withdraw,
)

__all__ = [
    "ACCOUNT_KEY_SALT",
    "EPOCH",
    "MAX_IMAGE_BYTES",
    "WORKERS_GROUP",
    "WORKER_LOST",
    "Claimed",
    "JobRequest",
    "account_key",
    "decode_image",
    "job_cancel",
    "job_checkpoint",
    "job_fail",
    "job_finish",
    "job_left_worker",
    "job_pause",
    "job_preempt_held",
    "job_preempted",
    "job_progress",
    "job_requeue",
    "job_resume",
    "job_started",
    "job_submit",
    "jobs_dispatch",
    "jobs_dispatch_for",
    "jobs_dispatch_or_wake",
    "jobs_make_room",
    "jobs_return",
    "orphans_sweep",
    "queued_job",
    "to_microseconds",
    "waiting_of",
    "worker_jobs_connect",
    "worker_jobs_disconnect",
    "worker_jobs_drain",
    "worker_model_rung",
    "worker_model_serve",
    "worker_model_withdraw",
]
