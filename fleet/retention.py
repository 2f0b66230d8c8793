"""Retention across the apps (the only place that sees both): ended jobs and paused jobs'
checkpoints (scheduling), then the sessions closed as long ago as the jobs purged (realtime), for
the periodic thread and `manage.py purge_jobs`. docs/operations.md, "Retention"."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from django.conf import settings

from realtime.records import sessions_purge
from scheduling.retention import retention_cutoff
from scheduling.retention_runner import retention_runner
from scheduling.services.retention import PURGE_BATCH, Purged
from scheduling.services.retention import retention_run as jobs_retention_run


def retention_run(*, now: datetime, job_days: int | None = None, checkpoint_days: int | None = None,
                  batch: int = PURGE_BATCH) -> Purged:
    """Jobs and checkpoints as scheduling purges them, then the sessions closed more than
    `job_days` (JOB_RETENTION_DAYS) ago, with their usage records kept as tallies."""
    purged = jobs_retention_run(now=now, job_days=job_days, checkpoint_days=checkpoint_days, batch=batch)
    days = settings.JOB_RETENTION_DAYS if job_days is None else job_days
    return replace(purged, sessions=sessions_purge(cutoff=retention_cutoff(now, days), batch=batch))


RETENTION_RUNNER = retention_runner(retention_run)
