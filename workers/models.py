"""Worker credentials, and what operators see of connected workers."""
from __future__ import annotations

import hashlib
import secrets

from django.db import models


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class WorkerToken(models.Model):
    """A credential a GPU worker presents on /ws/worker/?token=T; only its hash is stored."""

    name = models.CharField(max_length=200, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def new_secret() -> str:
        return "wk_" + secrets.token_urlsafe(32)


class Worker(models.Model):
    """The last known state of a worker process, by the worker_id of its hello."""

    worker_id = models.CharField(max_length=200, unique=True)
    token = models.ForeignKey(WorkerToken, null=True, blank=True, on_delete=models.SET_NULL)
    connected = models.BooleanField(default=False)
    gpu = models.JSONField(null=True, blank=True)
    served_models = models.JSONField(default=list, blank=True)  # the hello's model entries that are registered
    unknown_models = models.JSONField(default=list, blank=True)
    connected_at = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    # The worker socket's channel (several API processes: admission on one process sends
    # session_start to a worker connected to another); empty once that connection closed.
    channel_name = models.CharField(max_length=200, blank=True, default="")
    # It said `draining` on its current connection (SIGTERM): no new job and no realtime slot, in
    # every API process's admission; a hello (a new connection) clears it.
    draining = models.BooleanField(default=False)
    # Placement (v2): its hello's `installed` entries (None: a v1 worker, or a v2 one that did not
    # say, which placement never asks to load or unload), the protocol of that hello, and what
    # placement is waiting for on it: {"loading": {model_id: rung}, "unloading": [model_id],
    # "failed": {model_id: epoch seconds}, "loaded_at": {model_id: epoch seconds}} (fleet.placement.driver).
    installed = models.JSONField(null=True, blank=True)
    protocol = models.PositiveSmallIntegerField(default=1)
    placement = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["worker_id"]

    def __str__(self) -> str:
        return self.worker_id


class PlacementRecord(models.Model):
    """One placement action the API sent (load_model or unload_model): why, and how it ended.
    `outcome` is empty while it waits for the worker's answer; the queues page and the admin show
    those of the last hour, and rows older than a day are deleted."""

    LOAD, UNLOAD = "load", "unload"
    worker_id = models.CharField(max_length=200)
    model_id = models.CharField(max_length=200)
    action = models.CharField(max_length=10, choices=[(LOAD, "load"), (UNLOAD, "unload")])
    rung = models.CharField(max_length=20, blank=True, default="")
    reason = models.TextField()
    sent_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    # "" (waiting), "loaded", "failed", "unloaded", "kept" (the unload was not sent: the model held
    # work by then), "lost" (the worker's connection ended first)
    outcome = models.CharField(max_length=20, blank=True, default="")
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-sent_at", "-id"]
        indexes = [models.Index(fields=["sent_at"], name="placement_sent"),
                   models.Index(fields=["worker_id", "model_id", "outcome"], name="placement_waiting")]

    def __str__(self) -> str:
        return f"{self.action} {self.model_id} on {self.worker_id}"

    @property
    def duration_seconds(self) -> float | None:
        return None if self.ended_at is None else (self.ended_at - self.sent_at).total_seconds()
