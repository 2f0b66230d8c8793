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
from potocolom.protocol.events import WorkerPlace
from potocolom.protocol.rungs import RUNG_FULL
from potocolom.protocol.worker import ModelEntry
from potocolom.transport.notify import notify_after_commit
from workers.errors import WorkerIdTaken
from workers.models import PlacementRecord, Worker, WorkerToken, hash_token
from workers.placement_state import LOAD, PlacementAction, Waiting, epoch, free_mib
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
        _placement_hello(worker, installed=wire_installed, protocol=protocol)
        worker.save(update_fields=[*fields, "installed", "protocol", "placement"])
        placement_records_lost(worker_id=worker_id, now=now)
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


# --- placement (fleet.placement.driver plans; these write what it sent and what the workers answered) ---



def placement_action_record(*, worker: Worker, action: PlacementAction, now: datetime) -> None:
    """Write the action and what the worker row now waits for; the worker's consumer sends it after
    the commit (in order: a load's unloads first)."""
    record = PlacementRecord.objects.create(worker_id=worker.worker_id, model_id=action.model_id, action=action.kind,
                                            rung=action.rung or "", reason=action.reason[:2000], sent_at=now)
    waiting = Waiting.of(worker.placement)
    if action.kind == LOAD:
        waiting.loading[action.model_id] = action.rung or RUNG_FULL
    elif action.model_id not in waiting.unloading:
        waiting.unloading.append(action.model_id)
    worker.placement = waiting.to_json()
    worker.save(update_fields=["placement"])
    notify_after_commit(worker.channel_name, WorkerPlace(worker.worker_id, action.kind, action.model_id, action.rung,
                                                         record.pk).to_event())


def placement_records_prune(*, before: datetime) -> int:
    """Placement records sent before `before` are deleted (the log is bounded); how many."""
    return int(PlacementRecord.objects.filter(sent_at__lt=before).delete()[0])


def _end_record(worker_id: str, model_id: str, action: str, *, outcome: str, now: datetime,
                error: str = "") -> float | None:
    """Close the latest waiting record of this action; its duration in seconds (None: none waited)."""
    record = (PlacementRecord.objects.filter(worker_id=worker_id, model_id=model_id, action=action, outcome="")
              .order_by("-sent_at", "-id").first())
    if record is None:
        return None
    record.outcome, record.ended_at, record.error = outcome, now, error[:2000]
    record.save(update_fields=["outcome", "ended_at", "error"])
    return record.duration_seconds


def _locked_row(worker_id: str) -> Worker | None:
    return Worker.objects.select_for_update().filter(worker_id=worker_id).first()


def worker_model_loaded(*, worker_id: str, entry: ModelEntry, gpu: Any, now: datetime) -> tuple[bool, float | None]:
    """A worker loaded a model: its row serves it (when the API registry knows it) with the free
    memory it reports; (whether it is a registered model, the load's seconds when the API asked)."""
    registered = bool(registered_ids([entry.model_id]))
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is None:
            return False, None
        waiting = Waiting.of(worker.placement)
        before = free_mib(worker.gpu)
        after = free_mib(gpu)
        waiting.loading.pop(entry.model_id, None)
        waiting.loaded_at[entry.model_id] = epoch(now)
        if before is not None and after is not None:
            waiting.held_mib[entry.model_id] = max(0, before - after)
        served = [m for m in worker.served_models if m.get("model_id") != entry.model_id]
        unknown = [m for m in worker.unknown_models if m != entry.model_id]
        if registered:
            served.append(entry.to_wire())
        else:
            unknown.append(entry.model_id)
        worker.served_models, worker.unknown_models, worker.gpu = served, unknown, gpu
        worker.placement = waiting.to_json()
        worker.save(update_fields=["served_models", "unknown_models", "gpu", "placement"])
        seconds = _end_record(worker_id, entry.model_id, LOAD, outcome="loaded", now=now)
    return registered, seconds


def worker_model_load_failed(*, worker_id: str, model_id: str, error: str, gpu: Any, now: datetime) -> float | None:
    """A load failed: that worker is not asked for that model again within the back-off."""
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is None:
            return None
        waiting = Waiting.of(worker.placement)
        waiting.loading.pop(model_id, None)
        waiting.failed[model_id] = epoch(now)
        worker.gpu, worker.placement = gpu, waiting.to_json()
        worker.save(update_fields=["gpu", "placement"])
        return _end_record(worker_id, model_id, LOAD, outcome="failed", now=now, error=error)


def worker_model_withdrawn(*, worker_id: str, model_id: str) -> ModelEntry | None:
    """Before its unload: the model leaves the worker's served entries (no process places work of
    it there any more); the entry it had, None when it served no such model."""
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is None:
            return None
        entry = next((m for m in worker.served_models if m.get("model_id") == model_id), None)
        if entry is None:
            return None
        worker.served_models = [m for m in worker.served_models if m.get("model_id") != model_id]
        worker.save(update_fields=["served_models"])
        return ModelEntry.parse(entry)


def worker_unload_kept(*, worker_id: str, model_id: str, why: str, now: datetime) -> None:
    """The unload was not sent (the model held work by then): the row stops waiting for it."""
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is not None:
            waiting = Waiting.of(worker.placement)
            waiting.unloading = [m for m in waiting.unloading if m != model_id]
            worker.placement = waiting.to_json()
            worker.save(update_fields=["placement"])
        _end_record(worker_id, model_id, "unload", outcome="kept", now=now, error=why)


def worker_model_unloaded(*, worker_id: str, model_id: str, gpu: Any, now: datetime) -> None:
    """A worker freed a model: its memory is free (its `gpu` says how much)."""
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is None:
            return
        waiting = Waiting.of(worker.placement)
        waiting.unloading = [m for m in waiting.unloading if m != model_id]
        waiting.loaded_at.pop(model_id, None)
        waiting.held_mib.pop(model_id, None)
        worker.served_models = [m for m in worker.served_models if m.get("model_id") != model_id]
        worker.gpu, worker.placement = gpu, waiting.to_json()
        worker.save(update_fields=["served_models", "gpu", "placement"])
        _end_record(worker_id, model_id, "unload", outcome="unloaded", now=now)


def placement_records_lost(*, worker_id: str, now: datetime) -> None:
    """The worker's connection ended (or a new one said hello): what was sent on it and not answered
    is recorded as lost; a reconnect's hello says what it has loaded."""
    PlacementRecord.objects.filter(worker_id=worker_id, outcome="").update(outcome="lost", ended_at=now)


def _placement_hello(worker: Worker, *, installed: list[dict[str, Any]] | None, protocol: int) -> None:
    """Fields a hello sets on the row (saved by the caller): its installed models and protocol, and
    what placement waits for, reset to the new connection."""
    waiting = Waiting.of(worker.placement)
    waiting.keep_only({m.get("model_id") for m in worker.served_models})
    worker.installed, worker.protocol, worker.placement = installed, protocol, waiting.to_json()
