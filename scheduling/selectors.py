"""Reads of the job path."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet

from scheduling.models import Job, JobState
from scheduling.services import dispatcher


def jobs_of(*, account: User, state: str | None = None) -> QuerySet[Job]:
    """An account's jobs, newest first."""
    jobs = Job.objects.filter(account=account).order_by("-created_at", "id")
    return jobs.filter(state=state) if state else jobs


def positions_of(jobs: Iterable[Job]) -> dict[str, int]:
    """Queue positions of the queued jobs among these."""
    current = dispatcher()
    found: dict[str, Any] = {str(job.id): current.position(str(job.id)) for job in jobs
                             if job.state == JobState.QUEUED}
    return {job_id: position for job_id, position in found.items() if position is not None}


def queues_snapshot() -> dict[str, Any]:
    """What operators see: queued jobs per model, queued sessions in order, and the connected
    workers with the jobs they hold, their free realtime slots per model and their live sessions."""
    from realtime.selectors import sessions_snapshot
    from workers.models import Worker

    current = dispatcher()
    with current.lock:
        counts = current.queues.counts()
        held = {w.worker_id: sorted(w.held) for w in current.workers.values()}
    sessions = sessions_snapshot()
    realtime = sessions["workers"]
    workers = [{"worker_id": w.worker_id, "gpu": w.gpu, "models": w.served_models, "jobs": held.get(w.worker_id, []),
                "slots": realtime.get(w.worker_id, {}).get("slots", []),
                "sessions": realtime.get(w.worker_id, {}).get("sessions", [])}
               for w in Worker.objects.filter(worker_id__in=list(held.keys() | realtime.keys()))]
    return {"jobs": [{"model_id": model_id, "queued": count} for model_id, count in sorted(counts.items())],
            "sessions": sessions["sessions"], "workers": workers}
