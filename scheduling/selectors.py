"""Reads of the job path: an account's jobs, queue positions, and the queue as operators see it."""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Count, F, Max, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce

from potocolom.runtime import Slot, runtime
from scheduling.dispatcher import dispatcher
from scheduling.eta import ModelLoad, eta_seconds, first_etas, job_overhead_seconds
from scheduling.models import HELD_STATES, Job, JobState, PurgedJobs
from scheduling.policy import STEPS_UNSAID
from workers import selectors as worker_rows


def jobs_of(*, account: User, state: str | None = None) -> QuerySet[Job]:
    """An account's jobs, newest first."""
    jobs = Job.objects.filter(account=account).order_by("-created_at", "id")
    return jobs.filter(state=state) if state else jobs


def positions_of(jobs: Iterable[Job]) -> dict[str, int]:
    """Queue positions of the queued jobs among these (a page's in one call to the queue)."""
    return dispatcher().positions([str(job.id) for job in jobs if job.state == JobState.QUEUED])


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
    """How many jobs each (model, state) has: one grouped query (GET /metrics), plus the jobs that
    retention purged, so that an ended state's count never goes down."""
    rows = Job.objects.order_by().values_list("model_id", "state").annotate(n=Count("id"))
    counts = {(model_id, state): n for model_id, state, n in rows}
    for model_id, state, purged in PurgedJobs.objects.values_list("model_id", "state", "count"):
        counts[(model_id, state)] = counts.get((model_id, state), 0) + purged
    return counts


def queued_demand() -> dict[str, tuple[int, int]]:
    """Queued jobs per model and their steps summed (placement's demand): the counters the queue
    keeps as jobs come and go, never a scan of the queued rows."""
    return dispatcher().demand()


def recent_steps(*, since: Sequence[datetime]) -> dict[str, tuple[int, ...]]:
    """Steps of the jobs submitted per model since each moment of `since`, whatever became of them
    (placement's trend and burst: what arrives, before a queue forms), in one grouped query."""
    steps = Coalesce(F("steps"), Value(STEPS_UNSAID))
    windows = {f"since_{n}": Sum(steps, filter=Q(created_at__gte=moment)) for n, moment in enumerate(since)}
    rows = (Job.objects.filter(created_at__gte=min(since)).order_by().values("model_id").annotate(**windows)
            .values_list("model_id", *windows))
    return {model_id: tuple(int(total or 0) for total in totals) for model_id, *totals in rows}


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


OVERHEAD_SAMPLE_JOBS = 20  # a model's latest succeeded jobs, for its time per job beyond the steps


def model_loads(model_ids: Collection[str], *, now: datetime) -> dict[str, ModelLoad]:
    """What the ETA reads of each model (scheduling.eta.ModelLoad): its queued jobs and steps, and
    every other model's (the queue's counters); the held jobs and the steps they have left on each
    worker (one grouped query over the held rows); the connected workers that take new jobs and the
    step_ms of their copies, and the model's time per job beyond its steps from its latest
    succeeded jobs (both kept briefly: EtaReads)."""
    ids = sorted(set(model_ids))
    if not ids:
        return {}
    queued = dispatcher().demand()
    held = _held_steps_left()
    kept = runtime.get(ETA_READS)
    copies = kept.copies(now=now, version=dispatcher().fleet_version, read=lambda: _copies(now))
    loads = {}
    for model_id in ids:
        pool = copies.get(model_id, {})
        shared_jobs = shared_steps = 0.0
        for other, (jobs, total) in queued.items():
            if other != model_id and (theirs := copies.get(other)):
                here = sum(1 for worker_id in theirs if worker_id in pool) / len(theirs)
                shared_jobs, shared_steps = shared_jobs + jobs * here, shared_steps + total * here
        measured = [ms for ms in pool.values() if ms]
        step_ms = sum(measured) / len(measured) if measured else None
        loads[model_id] = ModelLoad(
            *queued.get(model_id, (0, 0)),
            held_steps_left=sum(held.get(worker_id, (0, 0))[1] for worker_id in pool),
            copies_step_ms=tuple(pool.values()), shared_queued_jobs=shared_jobs, shared_queued_steps=shared_steps,
            held_jobs=sum(held.get(worker_id, (0, 0))[0] for worker_id in pool),
            job_overhead_seconds=kept.overhead(model_id, step_ms=step_ms, now=now,
                                               read=partial(_recent_runs, model_id)))
    return loads


def _held_steps_left() -> dict[str, tuple[int, int]]:
    """worker_id -> (its held jobs, their steps left), one grouped query over the held rows. In SQL
    written once (it runs for every estimate: the ORM's build of it cost as much as running it):
    each job's steps left are its progress's total (else its steps, else STEPS_UNSAID) less the
    steps done, never below 0."""
    left = (f"COALESCE(progress_steps, steps, {int(STEPS_UNSAID)}) - COALESCE(progress_step, 0)")
    states = ", ".join(f"'{state.value}'" for state in HELD_STATES)  # the enum's own words
    sql = (f"SELECT worker_id, COUNT(*), SUM(CASE WHEN {left} > 0 THEN {left} ELSE 0 END) "
           f"FROM {Job._meta.db_table} WHERE state IN ({states}) GROUP BY worker_id")
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return {worker_id: (int(jobs), int(total or 0)) for worker_id, jobs, total in cursor.fetchall()}


def _copies(now: datetime) -> dict[str, dict[str, float | None]]:
    """model_id -> worker_id -> its copy's step_ms, over the connected workers that take new jobs."""
    copies: dict[str, dict[str, float | None]] = {}
    for worker in worker_rows.connected_workers(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS, now=now):
        if worker.draining:
            continue
        for entry in worker.models:
            copies.setdefault(entry.model_id, {})[worker.worker_id] = entry.step_ms
    return copies


COPIES_FRESH = timedelta(seconds=1)  # another process's worker joining or leaving counts within this
OVERHEAD_FRESH = timedelta(seconds=10)  # a median over 20 runs: it moves slowly


class EtaReads:
    """What every estimate reads of the fleet, kept briefly instead of read per submission: the
    connected copies and their step times (again after COPIES_FRESH, or at once when a worker of
    this process connected, left, drained or changed models: `version`), and each model's time per
    job beyond its steps (again after OVERHEAD_FRESH). The held jobs' steps left are read each time:
    they move with every dispatch and step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: tuple[datetime, int, dict[str, dict[str, float | None]]] | None = None
        self._overheads: dict[str, tuple[datetime, float | None, float]] = {}

    def copies(self, *, now: datetime, version: int,
               read: Callable[[], dict[str, dict[str, float | None]]]) -> dict[str, dict[str, float | None]]:
        with self._lock:
            kept = self._copies
        if kept is not None and kept[1] == version and timedelta(0) <= now - kept[0] < COPIES_FRESH:
            return kept[2]
        value = read()
        with self._lock:
            self._copies = (now, version, value)
        return value

    def overhead(self, model_id: str, *, step_ms: float | None, now: datetime,
                 read: Callable[[], list[tuple[float, int]]]) -> float:
        with self._lock:
            kept = self._overheads.get(model_id)
        if kept is not None and kept[1] == step_ms and timedelta(0) <= now - kept[0] < OVERHEAD_FRESH:
            return kept[2]
        value = job_overhead_seconds(read(), step_ms=step_ms)
        with self._lock:
            if len(self._overheads) >= 10_000:  # bounded: models come and go
                self._overheads.clear()
            self._overheads[model_id] = (now, step_ms, value)
        return value


ETA_READS = Slot("scheduling.selectors.eta_reads", make=EtaReads)


def _recent_runs(model_id: str) -> list[tuple[float, int]]:
    """(run seconds, steps) of the model's latest succeeded jobs."""
    steps = Coalesce(F("steps"), Value(STEPS_UNSAID))
    rows = (Job.objects.filter(model_id=model_id, state=JobState.SUCCEEDED, started_at__isnull=False,
                               finished_at__isnull=False).order_by("-finished_at")
            .annotate(job_steps=steps).values_list("started_at", "finished_at", "job_steps")[:OVERHEAD_SAMPLE_JOBS])
    return [((finished - started).total_seconds(), int(n)) for started, finished, n in rows if started and finished]


def etas_of(jobs: Iterable[Job], *, positions: dict[str, int], now: datetime) -> dict[str, float]:
    """The estimated waits of the queued jobs among these (those with a position and an estimate).
    Each job's first estimate is kept to measure its error when it starts (scheduling.eta)."""
    queued = [job for job in jobs if job.state == JobState.QUEUED and str(job.id) in positions]
    if not queued:
        return {}
    loads = model_loads({job.model_id for job in queued}, now=now)
    at_us = int(now.timestamp() * 1_000_000)
    etas: dict[str, float] = {}
    for job in queued:
        eta = eta_seconds(position=positions[str(job.id)], load=loads[job.model_id])
        if eta is not None:
            etas[str(job.id)] = eta
            first_etas().offer(str(job.id), eta=eta, at_us=at_us)
    return etas
