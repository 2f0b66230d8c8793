"""Reads of the session path: metering per account, and what operators see of the queue."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User

from realtime import admission, shared
from realtime.models import UsageRecord
from realtime.services import board, shared_sessions
from realtime.state import LIVE, PLACING, QUEUED


def usage_of(*, account: User, now: datetime) -> dict[str, Any]:
    """The account's metered seconds per model; a slot held now counts up to now."""
    seconds: dict[str, float] = defaultdict(float)
    for model_id, started_at, ended_at, counted in UsageRecord.objects.filter(account=account).values_list(
            "model_id", "started_at", "ended_at", "seconds"):
        seconds[model_id] += counted if ended_at is not None else max(0.0, (now - started_at).total_seconds())
    models: list[dict[str, Any]] = [{"model_id": model_id, "seconds": round(value, 3)}
                                    for model_id, value in sorted(seconds.items())]
    return {"total_seconds": round(sum(value for value in seconds.values()), 3), "models": models}


def sessions_snapshot() -> dict[str, Any]:
    """Queued sessions in order with positions; per worker its free slots and live sessions."""
    if shared_sessions():
        return shared.snapshot()
    entries, workers, free = board().snapshot()
    queued = [e for e in entries if e.state == QUEUED]
    places = admission.positions(e.queued() for e in queued)
    queue = [{"session_id": e.session_id, "model_id": e.model_id, "position": places[e.session_id],
              "account_id": e.account_id} for e in sorted(queued, key=lambda e: places[e.session_id])]
    per_worker = {}
    for worker in workers:
        per_worker[worker.worker_id] = {
            "slots": [{"model_id": model_id, "slots": count, "free": free.get((worker.worker_id, model_id), 0)}
                      for model_id, count in sorted(worker.slots.items())],
            "sessions": [{"session_id": e.session_id, "model_id": e.model_id, "state": e.state}
                         for e in entries if e.worker_id == worker.worker_id and e.state in (PLACING, LIVE)]}
    return {"sessions": queue, "workers": per_worker}
