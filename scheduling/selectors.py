"""Reads of the job path: an account's jobs, queue positions, and the queue as operators see it."""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db.models import Count, IntegerField, Max, QuerySet, Sum, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce

from scheduling.dispatcher import dispatcher
from scheduling.models import HELD_STATES, Job, JobState


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


def position_of(job: Job) -> int | None:
    return dispatcher().position(str(job.id)) if job.state == JobState.QUEUED else None


def dispatch_order(*, per_model: int) -> list[str]:
    """The ids of the first `per_model` queued jobs of each model, in dispatch order (model by
    model), as the queue's turns give it: what the admin's 'Queued, in dispatch order' lists first."""
    queues = dispatcher().queues
    return [job.job_id for model_id in sorted(queues.counts()) for job in queues.queued(model_id)[:per_model]]


def queue_snapshot() -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Queued jobs per model, and the jobs each worker connected to this process holds."""
    current = dispatcher()
    counts = current.queues.counts()
    return ([{"model_id": model_id, "queued": count} for model_id, count in sorted(counts.items())],
            current.held())


def jobs_per_model_and_state() -> dict[tuple[str, str], int]:
    """How many job rows each (model, state) has: one grouped query (GET /metrics)."""
    rows = Job.objects.order_by().values_list("model_id", "state").annotate(n=Count("id"))
    return {(model_id, state): n for model_id, state, n in rows}


STEPS_UNSAID = 30  # what placement counts for a queued job whose params name no steps (its schema's default)


def queued_demand() -> dict[str, tuple[int, int]]:
    """Queued jobs per model and their steps summed (placement's demand): one grouped query that
    reads `steps` out of the params in the database (params may hold init images)."""
    steps = Coalesce(Cast(KT("params__steps"), IntegerField()), Value(STEPS_UNSAID))
    rows = (Job.objects.filter(state=JobState.QUEUED).order_by().values_list("model_id")
            .annotate(jobs=Count("id"), steps=Sum(steps)))
    return {model_id: (jobs, int(total or 0)) for model_id, jobs, total in rows}


def recent_steps(*, since: datetime) -> dict[str, int]:
    """Steps of the jobs submitted per model since `since`, whatever became of them (placement's
    trend: what arrives, before a queue forms)."""
    steps = Coalesce(Cast(KT("params__steps"), IntegerField()), Value(STEPS_UNSAID))
    rows = Job.objects.filter(created_at__gte=since).order_by().values_list("model_id").annotate(steps=Sum(steps))
    return {model_id: int(total or 0) for model_id, total in rows}


def held_models(worker_ids: list[str]) -> set[tuple[str, str]]:
    """(worker_id, model_id) of the jobs these workers hold (dispatched or running): placement
    never unloads such a model."""
    rows = Job.objects.filter(state__in=HELD_STATES, worker_id__in=worker_ids).order_by().values_list(
        "worker_id", "model_id").distinct()
    return {(worker_id, model_id) for worker_id, model_id in rows if worker_id}


def last_job_use(worker_ids: list[str], *, since: datetime) -> dict[tuple[str, str], datetime]:
    """When each (worker, model) last ended a job after `since`."""
    rows = (Job.objects.filter(worker_id__in=worker_ids, finished_at__gte=since).order_by()
            .values_list("worker_id", "model_id").annotate(last=Max("finished_at")))
    return {(worker_id, model_id): last for worker_id, model_id, last in rows}
