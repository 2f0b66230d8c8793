"""Writes about workers: credentials and connection records."""
from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from models_registry.models import ModelManifest
from workers.models import Worker, WorkerToken, hash_token


def worker_token_create(*, name: str) -> str:
    """A new worker credential under `name` (an existing one is replaced); the secret, shown once."""
    secret = WorkerToken.new_secret()
    with transaction.atomic():
        WorkerToken.objects.update_or_create(name=name, defaults={"token_hash": hash_token(secret), "revoked": False})
    return secret


def worker_token_check(*, token: str | None) -> WorkerToken | None:
    """The worker credential for a presented token, or None."""
    if not token or len(token) > 200:
        return None
    return WorkerToken.objects.filter(token_hash=hash_token(token), revoked=False).first()


def worker_hello(*, worker_id: str, token: WorkerToken, gpu: Any, models: list[dict[str, Any]]) -> tuple[
        list[dict[str, Any]], list[str]]:
    """Record a worker's hello; the entries of registered models it serves, and the unknown ids."""
    registered = set(ModelManifest.objects.filter(model_id__in=[m["model_id"] for m in models])
                     .values_list("model_id", flat=True))
    served = [m for m in models if m["model_id"] in registered]
    unknown = [m["model_id"] for m in models if m["model_id"] not in registered]
    now = timezone.now()
    Worker.objects.update_or_create(worker_id=worker_id, defaults={
        "token": token, "connected": True, "gpu": gpu, "served_models": served, "unknown_models": unknown,
        "connected_at": now, "last_seen": now})
    return served, unknown


def worker_gone(*, worker_id: str) -> None:
    Worker.objects.filter(worker_id=worker_id).update(connected=False, last_seen=timezone.now())


def worker_rung_set(*, worker_id: str, model_id: str, entry: dict[str, Any]) -> None:
    """Record a model's new rung (after a demotion) in what operators see of the worker."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().filter(worker_id=worker_id).first()
        if worker is None:
            return
        worker.served_models = [entry if m.get("model_id") == model_id else m for m in worker.served_models]
        worker.save(update_fields=["served_models"])
