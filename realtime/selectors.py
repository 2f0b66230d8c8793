"""Reads of the session path: metering per account, and what operators see of the queue."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Count, Max

from realtime.admission import admission
from realtime.models import HOLDING_STATES, RealtimeSession, SessionState, UsageRecord, UsageTally
from realtime.policy import SlotKey


def usage_of(*, account: User, now: datetime) -> dict[str, Any]:
    """The account's metered seconds per model; a slot held now counts up to now; the records
    retention deleted count by their tally."""
    seconds: dict[str, float] = defaultdict(float)
    for model_id, counted in UsageTally.objects.filter(account=account).values_list("model_id", "seconds"):
        seconds[model_id] += counted
    for model_id, started_at, ended_at, counted in UsageRecord.objects.filter(account=account).values_list(
            "model_id", "started_at", "ended_at", "seconds"):
        seconds[model_id] += counted if ended_at is not None else max(0.0, (now - started_at).total_seconds())
    models: list[dict[str, Any]] = [{"model_id": model_id, "seconds": round(value, 3)}
                                    for model_id, value in sorted(seconds.items())]
    return {"total_seconds": round(sum(value for value in seconds.values()), 3), "models": models}


def sessions_snapshot() -> dict[str, Any]:
    """Queued sessions in order with positions; per worker its free slots and live sessions."""
    return admission().snapshot()


def queue_positions() -> dict[str, int]:
    """1-based places of the queued sessions (operators)."""
    return admission().positions()


def slots_free() -> dict[SlotKey, int]:
    """Free slots per (worker, model) (operators)."""
    return admission().free()


def sessions_per_state() -> dict[str, int]:
    """How many session rows each state has, every state named (0 when none): one grouped query."""
    counts = dict.fromkeys(SessionState.values, 0)
    counts.update(RealtimeSession.objects.order_by().values_list("state").annotate(n=Count("id")))
    return counts


def slots_per_model() -> dict[str, tuple[int, int]]:
    """Free and used realtime slots per model, over every connected worker: free as admission
    counts it, used = the sessions placing or live on the model (one grouped query)."""
    free: dict[str, int] = defaultdict(int)
    for (_, model_id), count in slots_free().items():
        free[model_id] += count
    used = dict(RealtimeSession.objects.filter(state__in=HOLDING_STATES).order_by().values_list("model_id")
                .annotate(n=Count("id")))
    return {model_id: (free.get(model_id, 0), used.get(model_id, 0)) for model_id in sorted(free.keys() | used.keys())}


def waiting_sessions_per_model() -> dict[str, int]:
    """Sessions queued for admission (not placing, not live), per model: what placement loads for."""
    return dict(RealtimeSession.objects.filter(state=SessionState.QUEUED).order_by().values_list("model_id")
                .annotate(n=Count("id")))


def holding_sessions(worker_ids: list[str]) -> set[tuple[str, str]]:
    """(worker_id, model_id) of the sessions placing or live on these workers: placement never
    unloads such a model."""
    rows = RealtimeSession.objects.filter(state__in=HOLDING_STATES, worker_id__in=worker_ids).order_by().values_list(
        "worker_id", "model_id").distinct()
    return {(worker_id, model_id) for worker_id, model_id in rows if worker_id}


def last_session_use(worker_ids: list[str], *, since: datetime) -> dict[tuple[str, str], datetime]:
    """When each (worker, model) last ended holding a slot after `since` (its usage records)."""
    rows = (UsageRecord.objects.filter(worker_id__in=worker_ids, ended_at__gte=since).order_by()
            .values_list("worker_id", "model_id").annotate(last=Max("ended_at")))
    return {(worker_id, model_id): last for worker_id, model_id, last in rows}
