"""Placement's driver (docs/protocol.md, "Placement across machines"): reads the demand and the
connected workers from the database, runs the pure planner (workers.placement), records each action
(PlacementRecord, and what the worker row waits for) and sends it to the worker's socket, on
whichever API process holds it; then the workers' answers update the rows. One planner acts at a
time across processes (an advisory transaction lock on PostgreSQL, a lock of this process on
other databases, which serve one process)."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from models_registry.selectors import registered_ids
from potocolom.protocol.rungs import RUNG_FULL
from potocolom.protocol.worker import ModelEntry
from potocolom.transport.notify import notify_after_commit
from realtime import selectors as session_reads
from scheduling import selectors as job_reads
from workers.models import PlacementRecord, Worker
from workers.placement import (
    LOAD,
    InstalledModel,
    LoadedModel,
    ModelDemand,
    PendingLoad,
    PlacementAction,
    PlacementSettings,
    WorkerState,
    plan_placement,
)
from workers.selectors import silence_cutoff

log = logging.getLogger(__name__)

PLACEMENT_LOCK = (0x706F_0004, 1)  # pg_advisory_xact_lock(*PLACEMENT_LOCK): one planner at a time
WORKER_PLACE = "worker.place"  # the event a worker's consumer turns into load_model / unload_model
LAST_USE_WINDOW = timedelta(hours=1)  # last use is looked up this far back; older counts as the load
KEPT_RECORDS = timedelta(days=1)  # placement records older than this are deleted
SHOWN_RECORDS = timedelta(hours=1)  # what the queues page and the admin list
MAX_SHOWN_RECORDS = 500

_local_lock = threading.Lock()


def placement_enabled() -> bool:
    return bool(settings.PLACEMENT == "demand")


def placement_settings() -> PlacementSettings:
    return PlacementSettings(target_wait_seconds=settings.PLACEMENT_TARGET_WAIT_SECONDS,
                             idle_seconds=settings.PLACEMENT_IDLE_SECONDS,
                             min_residency_seconds=settings.PLACEMENT_MIN_RESIDENCY_SECONDS,
                             failed_load_backoff_seconds=settings.PLACEMENT_FAILED_LOAD_BACKOFF_SECONDS)


@contextlib.contextmanager
def planner_lock() -> Iterator[None]:
    """A transaction in which this is the only planner acting (every API process)."""
    if connection.vendor == "postgresql":
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(PLACEMENT_LOCK))
            yield
        return
    with _local_lock, transaction.atomic():
        yield


# --- the state a worker row keeps ---------------------------------------------------------------

@dataclass
class Waiting:
    """What placement waits for on one worker (Worker.placement), plain data: loads sent and not
    answered (model_id -> rung), unloads sent and not answered, when loads failed and when the API
    loaded models (epoch seconds), and the memory each API-loaded model took (MiB, measured as the
    drop of its worker's free memory)."""

    loading: dict[str, str]
    unloading: list[str]
    failed: dict[str, float]
    loaded_at: dict[str, float]
    held_mib: dict[str, int]

    @classmethod
    def of(cls, raw: Any) -> Waiting:
        raw = raw if isinstance(raw, dict) else {}
        return cls(dict(raw.get("loading") or {}), list(raw.get("unloading") or []), dict(raw.get("failed") or {}),
                   dict(raw.get("loaded_at") or {}), dict(raw.get("held_mib") or {}))

    def to_json(self) -> dict[str, Any]:
        return {"loading": self.loading, "unloading": self.unloading, "failed": self.failed,
                "loaded_at": self.loaded_at, "held_mib": self.held_mib}

    def keep_only(self, loaded: set[str]) -> None:
        """A new connection: what was sent on the old one is not waited for any more (an answer that
        still comes is taken all the same), and what was loaded is known by its hello."""
        self.loading, self.unloading = {}, []
        self.loaded_at = {m: t for m, t in self.loaded_at.items() if m in loaded}
        self.held_mib = {m: n for m, n in self.held_mib.items() if m in loaded}


def epoch(moment: datetime) -> float:
    return moment.timestamp()


def free_mib(gpu: Any) -> int | None:
    if isinstance(gpu, dict) and isinstance(gpu.get("free_mib"), int) and not isinstance(gpu["free_mib"], bool):
        return int(gpu["free_mib"])
    return None


# --- planning -----------------------------------------------------------------------------------

def placement_run(*, now: datetime, periodic: bool = False) -> list[PlacementAction]:
    """Plan once and send the actions (after the commit); the actions. `periodic` adds the
    planner's rule 2 (copies for long queues; unloads only of idle copies)."""
    if not placement_enabled():
        return []
    with planner_lock():
        workers = _connected_rows(now)
        if not workers:
            return []
        rules = placement_settings()
        demand = _demand(since=now - timedelta(seconds=rules.demand_window_seconds))
        fleet = _fleet(workers, now=now)
        actions = plan_placement(demand, fleet, now=epoch(now), periodic=periodic, settings=rules)
        by_id = {w.worker_id: w for w in workers}
        for action in actions:
            _record(by_id[action.worker_id], action, now=now)
    if periodic:
        PlacementRecord.objects.filter(sent_at__lt=now - KEPT_RECORDS).delete()
    for action in actions:
        log.info("placement: %s %s on %s%s: %s", action.kind, action.model_id, action.worker_id,
                 f" (rung {action.rung})" if action.rung else "", action.reason)
    return actions


def _connected_rows(now: datetime) -> list[Worker]:
    cutoff = silence_cutoff(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS, now=now)
    return list(Worker.objects.select_for_update().filter(connected=True, last_seen__gte=cutoff)
                .exclude(channel_name="").order_by("worker_id"))


def _demand(*, since: datetime) -> list[ModelDemand]:
    jobs = job_reads.queued_demand()
    sessions = session_reads.waiting_sessions_per_model()
    recent = job_reads.recent_steps(since=since)
    return [ModelDemand(model_id, queued_jobs=jobs.get(model_id, (0, 0))[0], queued_steps=jobs.get(model_id, (0, 0))[1],
                        waiting_sessions=sessions.get(model_id, 0), recent_steps=recent.get(model_id, 0))
            for model_id in sorted(jobs.keys() | sessions.keys() | recent.keys())]


def _fleet(workers: list[Worker], *, now: datetime) -> list[WorkerState]:
    ids = [w.worker_id for w in workers]
    busy = job_reads.held_models(ids) | session_reads.holding_sessions(ids)
    since = now - LAST_USE_WINDOW
    used = job_reads.last_job_use(ids, since=since)
    for key, moment in session_reads.last_session_use(ids, since=since).items():
        used[key] = max(used.get(key, moment), moment)
    return [_worker_state(w, busy=busy, used=used, now=now) for w in workers]


def _worker_state(worker: Worker, *, busy: set[tuple[str, str]], used: dict[tuple[str, str], datetime],
                  now: datetime) -> WorkerState:
    """One row as the planner reads it. A worker that said nothing of what it has installed (v1) is
    planned around, never acted on: its models count as copies, each one busy."""
    waiting = Waiting.of(worker.placement)
    placeable = worker.installed is not None and worker.protocol >= 2
    installed = [InstalledModel(e["model_id"], dict(e.get("needs_mib") or {}), e.get("step_ms"))
                 for e in (worker.installed or []) if isinstance(e, dict) and "model_id" in e] if placeable else []
    needs = {m.model_id: m.needs_mib for m in installed}
    connected_at = epoch(worker.connected_at or now)
    loaded = []
    for entry in worker.served_models:
        model_id, rung = entry.get("model_id"), entry.get("rung", RUNG_FULL)
        key = (worker.worker_id, model_id)
        held = waiting.held_mib.get(model_id)
        if held is None:  # preloaded: what the rung needs (weights and working memory on full; offload keeps ~0)
            held = int(needs.get(model_id, {}).get(RUNG_FULL, 0)) if rung == RUNG_FULL else 0
        last = max(epoch(used[key]) if key in used else 0.0, waiting.loaded_at.get(model_id, connected_at))
        loaded.append(LoadedModel(model_id, rung, int(held), busy=key in busy or not placeable,
                                  last_used=epoch(now) if key in busy else last,
                                  loaded_at=waiting.loaded_at.get(model_id)))
    return WorkerState(worker.worker_id, installed, loaded, free_mib=free_mib(worker.gpu) if placeable else 0,
                       loading=[PendingLoad(m, r) for m, r in sorted(waiting.loading.items())],
                       unloading=frozenset(waiting.unloading), failed_loads=waiting.failed,
                       draining=worker.draining)


def _record(worker: Worker, action: PlacementAction, *, now: datetime) -> None:
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
    notify_after_commit(worker.channel_name, {"type": WORKER_PLACE, "worker_id": worker.worker_id,
                                              "action": action.kind, "model_id": action.model_id,
                                              "rung": action.rung, "record": record.pk})


# --- the workers' answers -----------------------------------------------------------------------

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


def model_loaded(*, worker_id: str, entry: ModelEntry, gpu: Any, now: datetime) -> tuple[bool, float | None]:
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


def model_load_failed(*, worker_id: str, model_id: str, error: str, gpu: Any, now: datetime) -> float | None:
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


def model_withdrawn(*, worker_id: str, model_id: str) -> ModelEntry | None:
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


def unload_kept(*, worker_id: str, model_id: str, why: str, now: datetime) -> None:
    """The unload was not sent (the model held work by then): the row stops waiting for it."""
    with transaction.atomic():
        worker = _locked_row(worker_id)
        if worker is not None:
            waiting = Waiting.of(worker.placement)
            waiting.unloading = [m for m in waiting.unloading if m != model_id]
            worker.placement = waiting.to_json()
            worker.save(update_fields=["placement"])
        _end_record(worker_id, model_id, "unload", outcome="kept", now=now, error=why)


def model_unloaded(*, worker_id: str, model_id: str, gpu: Any, now: datetime) -> None:
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


def connection_ended(*, worker_id: str, now: datetime) -> None:
    """The worker's connection ended (or a new one said hello): what was sent on it and not answered
    is recorded as lost; a reconnect's hello says what it has loaded."""
    PlacementRecord.objects.filter(worker_id=worker_id, outcome="").update(outcome="lost", ended_at=now)


def placement_hello(worker: Worker, *, installed: list[dict[str, Any]] | None, protocol: int) -> None:
    """Fields a hello sets on the row (saved by the caller): its installed models and protocol, and
    what placement waits for, reset to the new connection."""
    waiting = Waiting.of(worker.placement)
    waiting.keep_only({m.get("model_id") for m in worker.served_models})
    worker.installed, worker.protocol, worker.placement = installed, protocol, waiting.to_json()


# --- what operators see -------------------------------------------------------------------------

def placement_log(*, now: datetime) -> list[dict[str, Any]]:
    """The placement actions of the last hour, newest first, with reason, outcome and duration."""
    rows = PlacementRecord.objects.filter(sent_at__gte=now - SHOWN_RECORDS)[:MAX_SHOWN_RECORDS]
    return [{"at": r.sent_at.isoformat(), "worker_id": r.worker_id, "model_id": r.model_id, "action": r.action,
             "rung": r.rung or None, "reason": r.reason, "outcome": r.outcome or "waiting",
             "error": r.error or None,
             "duration_seconds": None if r.duration_seconds is None else round(r.duration_seconds, 3)}
            for r in rows]
