"""Small moves on a job's row that several services share: the microsecond clock the queue keys on,
a row as the queue's QueuedJob, a held job sent back off its worker (to queued, or paused), an ended
job's checkpoint dropped. The job path's story: docs/protocol.md, "The job" (with "Pausing")."""
from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import QuerySet

from scheduling.checkpoints import checkpoint_discard
from scheduling.models import Job, JobState, WebhookDelivery
from scheduling.policy import STEPS_UNSAID, QueuedJob
from scheduling.signals import webhook_due

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# What a job leaves behind when it goes back off its worker (sent back, preempted, paused).
OFF_WORKER: dict[str, Any] = {"worker_id": None, "dispatched_at": None, "started_at": None}


def to_microseconds(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def queued_job(job: Job) -> QueuedJob:
    return QueuedJob(job_id=str(job.id), model_id=job.model_id, priority=job.priority, submitted_us=job.submitted_us,
                     account=str(job.account_id), steps=STEPS_UNSAID if job.steps is None else job.steps)


def send_back(held: QuerySet[Job], *, now: datetime, **fields: Any) -> JobState | None:
    """Move a held job off its worker: to `queued`, or to `paused` (as of `now`) when a pause was
    asked. Two compare-and-sets, so that a pause asked meanwhile is never lost; the state it went
    to, or None when `held` no longer finds it."""
    if held.filter(pause_requested=False).update(state=JobState.QUEUED, **OFF_WORKER, **fields):
        return JobState.QUEUED
    if held.filter(pause_requested=True).update(state=JobState.PAUSED, pause_requested=False, paused_at=now,
                                                 **OFF_WORKER, **fields):
        return JobState.PAUSED
    return None


def drop_checkpoint(job: Job) -> None:
    """An ended job keeps no checkpoint: its row forgets it, its blob is deleted."""
    if job.checkpoint:
        Job.objects.filter(id=job.id, checkpoint=job.checkpoint).update(checkpoint="", checkpoint_step=None)
        checkpoint_discard(job.checkpoint)
        job.checkpoint, job.checkpoint_step = "", None


def webhook_outbox(job_id: uuid.UUID | str, *, now: datetime) -> None:
    """Inside the transaction that ends a job: its webhook's delivery row (the outbox), when it was
    submitted with one, so that the end and its delivery commit together; the delivery runner wakes
    after the commit."""
    url = Job.objects.filter(id=job_id).exclude(webhook_url="").values_list("webhook_url", flat=True).first()
    if url:
        WebhookDelivery.objects.create(job_id=job_id, url=url, created_at=now, due_at=now)
        transaction.on_commit(lambda: webhook_due.send(sender=WebhookDelivery))
