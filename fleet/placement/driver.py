"""Placement's driver: reads the demand and the connected workers, runs the pure planner, and has
each action recorded and sent; one planner at a time across processes (an advisory lock on
PostgreSQL). docs/design/placement.md."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from fleet.placement.planner import (
    InstalledModel,
    LoadedModel,
    ModelDemand,
    PendingLoad,
    PlacementAction,
    PlacementSettings,
    WorkerState,
    plan_placement,
)
from potocolom.protocol.rungs import RUNG_FULL
from potocolom.runtime import Slot, runtime
from realtime import selectors as session_reads
from scheduling import selectors as job_reads
from workers import services
from workers.models import Worker
from workers.placement_state import Waiting, epoch, free_mib
from workers.selectors import installed_entries, model_entries, silence_cutoff

log = logging.getLogger(__name__)

PLACEMENT_LOCK = (0x706F_0004, 1)  # pg_advisory_xact_lock(*PLACEMENT_LOCK): one planner at a time
LAST_USE_WINDOW = timedelta(hours=1)  # last use is looked up this far back; older counts as the load
KEPT_RECORDS = timedelta(days=1)  # placement records older than this are deleted

# Off PostgreSQL, the lock that keeps this process's planner runs one at a time.
LOCAL_PLANNER_LOCK = Slot("fleet.placement.lock", make=threading.Lock)


def placement_enabled() -> bool:
    return bool(settings.PLACEMENT == "demand")


def placement_settings() -> PlacementSettings:
    return PlacementSettings(target_wait_seconds=settings.PLACEMENT_TARGET_WAIT_SECONDS,
                             idle_seconds=settings.PLACEMENT_IDLE_SECONDS,
                             min_residency_seconds=settings.PLACEMENT_MIN_RESIDENCY_SECONDS,
                             failed_load_backoff_seconds=settings.PLACEMENT_FAILED_LOAD_BACKOFF_SECONDS,
                             target_wait_jobs=settings.PLACEMENT_TARGET_WAIT_JOBS,
                             copy_busy_share=settings.PLACEMENT_COPY_BUSY_SHARE,
                             burst_window_seconds=settings.PLACEMENT_BURST_WINDOW_SECONDS,
                             burst_busy_share=settings.PLACEMENT_BURST_BUSY_SHARE,
                             retire_slow_copies=settings.PLACEMENT_RETIRE_SLOW_COPIES)


@contextlib.contextmanager
def planner_lock() -> Iterator[None]:
    """A transaction in which this is the only planner acting (every API process)."""
    if connection.vendor == "postgresql":
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(PLACEMENT_LOCK))
            yield
        return
    with runtime.get(LOCAL_PLANNER_LOCK), transaction.atomic():
        yield


# --- planning -----------------------------------------------------------------------------------

def placement_run(*, now: datetime, periodic: bool = False) -> list[PlacementAction]:
    """Plan once and send the actions (after the commit); the actions. `periodic` adds the
    planner's long-queue and trend rules (extra copies, for which only idle copies make room)."""
    if not placement_enabled():
        return []
    # The queue's counters, read before the planner's transaction: the dispatcher's lock is never
    # taken inside a transaction (a dispatch holds it while its claim waits for SQLite's write lock).
    queued = job_reads.queued_demand()
    with planner_lock():
        workers = _connected_rows(now)
        if not workers:
            return []
        rules = placement_settings()
        demand = _demand(queued, since=now - timedelta(seconds=rules.demand_window_seconds),
                         burst_since=now - timedelta(seconds=rules.burst_window_seconds)
                         if rules.burst_busy_share > 0 else None)
        fleet = _fleet(workers, now=now)
        actions = plan_placement(demand, fleet, now=epoch(now), periodic=periodic, settings=rules)
        by_id = {w.worker_id: w for w in workers}
        for action in actions:
            services.placement_action_record(worker=by_id[action.worker_id], action=action, now=now)
    if periodic:
        services.placement_records_prune(before=now - KEPT_RECORDS)
    for action in actions:
        log.info("placement: %s %s on %s%s: %s", action.kind, action.model_id, action.worker_id,
                 f" (rung {action.rung})" if action.rung else "", action.reason)
    return actions


def _connected_rows(now: datetime) -> list[Worker]:
    cutoff = silence_cutoff(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS, now=now)
    return list(Worker.objects.select_for_update().filter(connected=True, last_seen__gte=cutoff)
                .exclude(channel_name="").order_by("worker_id"))


def _demand(jobs: dict[str, tuple[int, int]], *, since: datetime, burst_since: datetime | None) -> list[ModelDemand]:
    """What waits per model (`jobs`: queued jobs and their steps per model), the trend since `since`,
    and the burst since `burst_since` (None: the burst rule is off)."""
    sessions = session_reads.waiting_sessions_per_model()
    arrived = job_reads.recent_steps(since=[since] if burst_since is None else [since, burst_since])
    out = []
    for model_id in sorted(jobs.keys() | sessions.keys() | arrived.keys()):
        queued_jobs, queued_steps = jobs.get(model_id, (0, 0))
        recent, burst = (*arrived.get(model_id, ()), 0, 0)[:2]  # no burst window: burst 0
        out.append(ModelDemand(model_id, queued_jobs=queued_jobs, queued_steps=queued_steps,
                               waiting_sessions=sessions.get(model_id, 0), recent_steps=recent, burst_steps=burst))
    return out


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
    installed = [InstalledModel(e.model_id, dict(e.needs_mib), e.step_ms)
                 for e in installed_entries(worker.installed)] if placeable else []
    needs = {m.model_id: m.needs_mib for m in installed}
    connected_at = epoch(worker.connected_at or now)
    loaded = []
    for entry in model_entries(worker.served_models):
        model_id, rung = entry.model_id, entry.rung
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
