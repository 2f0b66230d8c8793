"""Writes about workers, the only ones of Worker rows: credentials, and what each hello, heartbeat,
rung change and lost socket says of a worker."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from models_registry.selectors import registered_ids
from potocolom.protocol.worker import ModelEntry
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


@dataclass(frozen=True)
class HelloRecord:
    """What a hello changed: the entries of registered models it serves, the ids the API does not
    know, and the channel of the connection it said hello on before (empty: none, or gone)."""

    served: list[ModelEntry]
    unknown: list[str]
    previous_channel: str


def worker_hello(*, worker_id: str, token: WorkerToken, gpu: Any, models: tuple[ModelEntry, ...], channel_name: str,
                 now: datetime) -> HelloRecord:
    """Record a worker's hello on the socket at `channel_name`."""
    registered = registered_ids([m.model_id for m in models])
    served = [m for m in models if m.model_id in registered]
    unknown = [m.model_id for m in models if m.model_id not in registered]
    with transaction.atomic():
        previous = Worker.objects.select_for_update().filter(worker_id=worker_id) \
            .values_list("channel_name", flat=True).first()
        Worker.objects.update_or_create(worker_id=worker_id, defaults={
            "token": token, "connected": True, "gpu": gpu, "served_models": [m.to_wire() for m in served],
            "unknown_models": unknown, "connected_at": now, "last_seen": now, "channel_name": channel_name})
    return HelloRecord(served, unknown, previous or "")


def worker_seen(*, worker_id: str, now: datetime) -> None:
    """A worker connected here is alive (every heartbeat period): other processes read this to tell
    a worker connected elsewhere from one that is gone."""
    Worker.objects.filter(worker_id=worker_id).update(connected=True, last_seen=now)


def worker_gone(*, worker_id: str, now: datetime) -> None:
    Worker.objects.filter(worker_id=worker_id).update(connected=False, last_seen=now)


def worker_channel_clear(*, worker_id: str, channel_name: str) -> bool:
    """The socket at `channel_name` closed: forget it, unless a newer connection (on any API
    process) took over; True when it was still the worker's."""
    return Worker.objects.filter(worker_id=worker_id, channel_name=channel_name).update(channel_name="") == 1


def worker_rung_set(*, worker_id: str, entry: ModelEntry) -> None:
    """Record a model's new rung (after a demotion) in the worker's served entries."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().filter(worker_id=worker_id).first()
        if worker is None:
            return
        worker.served_models = [entry.to_wire() if m.get("model_id") == entry.model_id else m
                                for m in worker.served_models]
        worker.save(update_fields=["served_models"])
