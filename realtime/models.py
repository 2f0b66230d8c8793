"""Realtime drawing sessions and their metering: the database is the truth."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class SessionState(models.TextChoices):
    QUEUED = "queued"
    PLACING = "placing"  # session_start sent, session_accepted not yet received
    LIVE = "live"
    IDLE = "idle"
    CLOSED = "closed"


OPEN_STATES = (SessionState.QUEUED, SessionState.PLACING, SessionState.LIVE, SessionState.IDLE)
HOLDING_STATES = (SessionState.PLACING, SessionState.LIVE)  # the session holds a slot on its worker


class RealtimeSession(models.Model):
    """One browser socket's drawing session."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sessions")
    model_id = models.CharField(max_length=200)
    params = models.JSONField(default=dict, blank=True)  # width, height, steps from the query string
    state = models.CharField(max_length=20, choices=SessionState.choices, default=SessionState.QUEUED)
    joined_at = models.DateTimeField()  # first joined: the queue order, kept when sent back
    worker_id = models.CharField(max_length=200, null=True, blank=True)
    last_frame_at = models.DateTimeField(null=True, blank=True)
    live_since = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True)
    # Shared admission (several API processes, realtime/shared.py): where the browser socket is,
    # which process holds it, the workers that refused it, the position it was last told, and a
    # count of its placements (so that a late event about an earlier one is told from a new one).
    channel_name = models.CharField(max_length=200, blank=True, default="")
    api_process = models.BigIntegerField(null=True, blank=True)
    refused_by = models.JSONField(default=list, blank=True)
    told_position = models.IntegerField(null=True, blank=True)
    placements = models.IntegerField(default=0)
    # A session closed because its process died: when that was found, and the session of the
    # browser's reconnect that took its place (so that no second reconnect takes it too).
    orphaned_at = models.DateTimeField(null=True, blank=True)
    resumed_by = models.UUIDField(null=True, blank=True)
    # When the process holding its browser socket last vouched that the socket is open (at the join,
    # then at each of its sweep ticks): a row unseen for long has lost its socket (a close that
    # failed) and the sweep closes it. Null: a row of a version that did not vouch (left alone).
    seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["joined_at", "id"]
        indexes = [
            models.Index(fields=["account", "state"], name="session_account_state"),
            models.Index(fields=["state", "joined_at"], name="session_state_joined"),
            # the shared admission's first fit walks one model's queue in order
            models.Index(fields=["state", "model_id", "joined_at"], name="session_state_model_joined"),
            # retention deletes the sessions closed longest ago first
            models.Index(fields=["state", "closed_at"], name="session_state_closed"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.model_id}, {self.state})"


class UsageRecord(models.Model):
    """The time one session held one slot: ended_at is null while it still holds it."""

    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage_records")
    model_id = models.CharField(max_length=200)
    session = models.ForeignKey(RealtimeSession, on_delete=models.CASCADE, related_name="usage_records")
    worker_id = models.CharField(max_length=200, blank=True, default="")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    seconds = models.FloatField(default=0.0)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["account", "model_id"], name="usage_account_model")]

    def __str__(self) -> str:
        return f"{self.account_id} {self.model_id} {self.seconds:.1f}s"


class UsageTally(models.Model):
    """An account's metered seconds per model of the usage records retention deleted (with the
    closed sessions they belonged to): `GET /api/v1/usage/` adds them, so its totals never shrink."""

    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage_tallies")
    model_id = models.CharField(max_length=200)
    seconds = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["account", "model_id"], name="usage_tally_account_model")]

    def __str__(self) -> str:
        return f"{self.account_id} {self.model_id} {self.seconds:.1f}s (purged records)"
