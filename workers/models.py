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

    class Meta:
        ordering = ["worker_id"]

    def __str__(self) -> str:
        return self.worker_id
