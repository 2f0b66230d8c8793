"""Writes about workers, the only ones of Worker rows: credentials (and revoking them), and what each
hello, heartbeat, rung change and lost socket says of a worker. A worker_id is bound to the token
that first said hello with it (Worker.token) until that token is revoked."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from models_registry.selectors import registered_ids
from potocolom.protocol.entries import InstalledEntry
from potocolom.protocol.worker import ModelEntry
from workers import placing
from workers.errors import WorkerIdTaken
from workers.models import Worker, WorkerToken, hash_token
from workers.selectors import silence_cutoff


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


def worker_token_holds(*, token_id: int) -> bool:
    """Whether a credential is still valid (each worker socket asks every heartbeat period)."""
    return WorkerToken.objects.filter(pk=token_id, revoked=False).exists()


def worker_tokens_revoke(*, token_ids: Iterable[int]) -> int:
    """Revoke these credentials and end their bindings (their worker_ids may be claimed by another
    token); how many were valid until now. Their open sockets close within a heartbeat period."""
    with transaction.atomic():
        revoked = list(WorkerToken.objects.select_for_update().filter(pk__in=list(token_ids), revoked=False)
                       .values_list("pk", flat=True))
        WorkerToken.objects.filter(pk__in=revoked).update(revoked=True)
        Worker.objects.filter(token_id__in=revoked).update(token=None)
    return len(revoked)


@dataclass(frozen=True)
class HelloRecord:
    """What a hello changed: the entries of registered models it serves, the ids the API does not
    know, and the channel of the connection it said hello on before (empty: none, or gone)."""

    served: list[ModelEntry]
    unknown: list[str]
    previous_channel: str


def worker_hello(*, worker_id: str, token: WorkerToken, gpu: Any, models: tuple[ModelEntry, ...], channel_name: str,
                 now: datetime, installed: tuple[InstalledEntry, ...] | None = None,
                 protocol: int = 1) -> HelloRecord:
    """Record a worker's hello on the socket at `channel_name`. The worker_id belongs to the token
    that first said hello with it (until that token is revoked): WorkerIdTaken for another token,
    and nothing changes. A v2 hello's `installed` is kept for placement (None: it said nothing)."""
    registered = registered_ids([m.model_id for m in models])
    served = [m for m in models if m.model_id in registered]
    unknown = [m.model_id for m in models if m.model_id not in registered]
    fields = {"token": token, "connected": True, "gpu": gpu, "served_models": [m.to_wire() for m in served],
              "unknown_models": unknown, "connected_at": now, "last_seen": now, "channel_name": channel_name,
              "draining": False}
    wire_installed = None if installed is None else [entry.to_wire() for entry in installed]
    with transaction.atomic():
        # Locked (or created: a second token racing to create it finds it here, bound) before the check.
        worker, created = Worker.objects.select_for_update().get_or_create(worker_id=worker_id, defaults=fields)
        if not created and worker.token_id not in (None, token.pk) and worker_token_holds(token_id=worker.token_id):
            raise WorkerIdTaken(f"worker_id {worker_id} belongs to another worker token")
        previous = "" if created else worker.channel_name
        for name, value in fields.items():
            setattr(worker, name, value)
        placing.placement_hello(worker, installed=wire_installed, protocol=protocol)
        worker.save(update_fields=[*fields, "installed", "protocol", "placement"])
        placing.connection_ended(worker_id=worker_id, now=now)
    return HelloRecord(served, unknown, previous)


def worker_seen(*, worker_id: str, now: datetime) -> None:
    """A worker connected here is alive (its messages, at most once a heartbeat period): operators
    see when, and other processes read this to tell a worker connected elsewhere from one that is gone."""
    Worker.objects.filter(worker_id=worker_id).update(connected=True, last_seen=now)


def workers_silent_forget(*, seconds: float, now: datetime) -> int:
    """Rows of workers no API process has heard for `seconds` (their process died, and they did not
    come back) stop reading as connected; how many."""
    return Worker.objects.filter(connected=True, last_seen__lt=silence_cutoff(seconds=seconds, now=now)).update(
        connected=False)


def worker_gone(*, worker_id: str, now: datetime) -> None:
    Worker.objects.filter(worker_id=worker_id).update(connected=False, last_seen=now)


def worker_channel_clear(*, worker_id: str, channel_name: str) -> bool:
    """The socket at `channel_name` closed: forget it, unless a newer connection (on any API
    process) took over; True when it was still the worker's."""
    return Worker.objects.filter(worker_id=worker_id, channel_name=channel_name).update(channel_name="") == 1


def worker_draining_set(*, worker_id: str, channel_name: str) -> list[ModelEntry]:
    """The worker said `draining` on the socket at `channel_name`: its row says so (the shared
    admission reads no slots of it then); the model entries it serves, or none when that socket is
    no longer the worker's."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().filter(worker_id=worker_id, channel_name=channel_name).first()
        if worker is None:
            return []
        worker.draining = True
        worker.save(update_fields=["draining"])
        return [ModelEntry.parse(entry) for entry in worker.served_models]


def worker_rung_set(*, worker_id: str, entry: ModelEntry) -> None:
    """Record a model's new rung (after a demotion) in the worker's served entries."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().filter(worker_id=worker_id).first()
        if worker is None:
            return
        worker.served_models = [entry.to_wire() if m.get("model_id") == entry.model_id else m
                                for m in worker.served_models]
        worker.save(update_fields=["served_models"])
