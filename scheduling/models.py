"""Jobs: the database is the truth; the queues are caches rebuilt from it."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class JobState(models.TextChoices):
    QUEUED = "queued"
    PAUSED = "paused"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


HELD_STATES = (JobState.DISPATCHED, JobState.RUNNING)
# What ACCOUNT_JOB_LIMIT counts and what can be cancelled: every state but the three ends. A paused
# job counts, or pausing would be a way past the limit.
UNFINISHED_STATES = (JobState.QUEUED, JobState.PAUSED, *HELD_STATES)
ENDED_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Job(models.Model):
    """One image-generation request of an account."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    model_id = models.CharField(max_length=200)
    params = models.JSONField(default=dict)  # as submitted, without init_image (in the storage)
    # What the queue, ETA and placement queries read of the params, in columns, so that they never
    # read a params value: `steps`, `width` and `height` as submitted (None: the schema's default),
    # and the storage name of the job's init_image ("" for none; the worker gets it in its params).
    steps = models.PositiveIntegerField(null=True, blank=True)
    width = models.PositiveIntegerField(null=True, blank=True)
    height = models.PositiveIntegerField(null=True, blank=True)
    init_image = models.CharField(max_length=300, blank=True, default="")
    priority = models.PositiveSmallIntegerField(default=0)
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED)
    attempts = models.PositiveSmallIntegerField(default=1)
    worker_id = models.CharField(max_length=200, null=True, blank=True)
    # Submission order: integer microseconds since the epoch (exact, unlike a float), then id.
    submitted_us = models.BigIntegerField()
    created_at = models.DateTimeField()
    dispatched_at = models.DateTimeField(null=True, blank=True)
    # Fair share: the turn its latest dispatch gave its account on its model's queue (microseconds,
    # kept when the job is sent back, so the account keeps its turn); the queue's turns are rebuilt
    # from the latest of each account and model.
    turn_us = models.BigIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    progress_step = models.PositiveIntegerField(null=True, blank=True)
    progress_steps = models.PositiveIntegerField(null=True, blank=True)
    images = models.JSONField(default=list, blank=True)  # storage names, in order
    gpu_ms = models.FloatField(null=True, blank=True)
    rung = models.CharField(max_length=40, blank=True, default="")
    error = models.TextField(null=True, blank=True)
    # Step-boundary scheduling: how often the job was taken off a worker before it ended (preempted,
    # paused, drained; a dead worker is `attempts`), the storage name of its latest checkpoint (the
    # blob lives in default_storage, never in the row) and the step it holds, and whether a pause
    # was asked while a worker held it (it becomes paused when that worker answers).
    preemptions = models.PositiveIntegerField(default=0)
    checkpoint = models.CharField(max_length=300, blank=True, default="")
    checkpoint_step = models.PositiveIntegerField(null=True, blank=True)
    pause_requested = models.BooleanField(default=False)
    # When it last became paused: a paused job's checkpoint is deleted PAUSED_CHECKPOINT_DAYS after
    # (docs/operations.md, "Retention"); the job stays, and a resume starts it from step 0.
    paused_at = models.DateTimeField(null=True, blank=True)
    # Its webhook (docs/protocol.md, "Webhooks"): where the job's end is POSTed ("" for none), and the
    # origin it was submitted to, which makes the URLs in the posted representation absolute.
    webhook_url = models.CharField(max_length=2000, blank=True, default="")
    webhook_origin = models.CharField(max_length=300, blank=True, default="")

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [
            models.Index(fields=["state", "model_id"], name="job_state_model"),
            models.Index(fields=["account", "-created_at"], name="job_account_recent"),
            models.Index(fields=["worker_id", "state"], name="job_worker_state"),
            models.Index(fields=["worker_id", "finished_at"], name="job_worker_finished"),  # placement's last use
            models.Index(fields=["created_at"], name="job_created"),  # placement's recent arrivals
            models.Index(fields=["account", "model_id", "turn_us"], name="job_account_turns"),
            # ACCOUNT_JOB_LIMIT's count on every submission: only the unfinished rows, so that it reads
            # a handful of entries however many finished jobs the account has (and whatever the
            # planner's statistics say about the table).
            models.Index(fields=["account"], condition=models.Q(state__in=UNFINISHED_STATES),
                         name="job_account_unfinished"),
            # retention's purge walks the ended jobs oldest first, a batch at a time
            models.Index(fields=["finished_at"], condition=models.Q(state__in=ENDED_STATES), name="job_ended_finished"),
            # the ETA's time per job beyond its steps: a model's latest successes, read on every
            # estimate, 20 index entries however long the model's history
            models.Index(fields=["model_id", "state", "-finished_at"], name="job_model_latest"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.model_id}, {self.state})"


class PurgedJobs(models.Model):
    """How many jobs of a model that ended in a state were purged (docs/operations.md, "Retention"):
    GET /metrics adds them to the rows left, so that `potocolom_jobs` never goes down."""

    model_id = models.CharField(max_length=200)
    state = models.CharField(max_length=20, choices=JobState.choices)
    count = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model_id", "state"], name="purged_jobs_model_state")]

    def __str__(self) -> str:
        return f"{self.count} {self.model_id} {self.state} purged"


class WebhookState(models.TextChoices):
    PENDING = "pending"  # due at due_at (or being attempted, due_at then being its claim's end)
    DELIVERED = "delivered"  # a 2xx answered: never sent again
    FAILED = "failed"  # WEBHOOK_ATTEMPTS attempts and no 2xx


class WebhookDelivery(models.Model):
    """One event of a job's webhook (its end): the outbox row, written in the transaction that ends
    the job, then attempted by the delivery runner (scheduling/webhooks/) until a 2xx or the last
    attempt. Its id is the event's `webhook-id`, the same on every retry."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="webhook_deliveries")
    url = models.CharField(max_length=2000)
    state = models.CharField(max_length=20, choices=WebhookState.choices, default=WebhookState.PENDING)
    created_at = models.DateTimeField()
    # When the next attempt is due; while one is under way, when its claim lapses (a process that
    # died mid-attempt leaves it due again then). Null once delivered or failed.
    due_at = models.DateTimeField(null=True, blank=True)
    # The exact bytes sent, fixed at the first attempt so that every retry carries the same body.
    body = models.TextField(blank=True, default="")
    # Each attempt: {"at": ISO time, "status_code": int | None, "error": str | None, "duration_ms": float}
    attempts = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-created_at", "id"]
        indexes = [models.Index(fields=["state", "due_at"], name="webhook_due")]

    @property
    def webhook_id(self) -> str:
        return f"msg_{self.id.hex}"

    def __str__(self) -> str:
        return f"{self.webhook_id} ({self.state})"


class WebhookSecret(models.Model):
    """An account's webhook signing key (Standard Webhooks: `whsec_` + base64 of the key bytes);
    made on first use, replaced on rotation."""

    account = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhook_secret")
    secret = models.CharField(max_length=100)
    created_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"webhook secret of {self.account_id}"
