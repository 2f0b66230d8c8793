"""Writes of the job path: each state change is a compare-and-set in the database, then this
process's dispatcher is told, then messages go to workers after the commit. Services are
synchronous (consumers call them through database_sync_to_async) and take the clock as `now=`."""
from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce

from models_registry.routing import route
from models_registry.selectors import registered_manifests
from potocolom.protocol.worker import Cancel, JobOrder
from potocolom.transport import relay
from potocolom.transport.notify import to_socket_after_commit
from scheduling.dispatcher import Dispatcher, dispatcher
from scheduling.errors import JobAlreadyEnded, TooManyJobs
from scheduling.models import ACTIVE_STATES, HELD_STATES, UNFINISHED_STATES, Job, JobState
from scheduling.policy import Assignment, QueuedJob, retry_decision
from workers import selectors as worker_rows

log = logging.getLogger(__name__)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
WORKER_LOST = "worker_lost"
MAX_IMAGE_BYTES = 12 * 1024 * 1024
WORKERS_GROUP = "potocolom.workers"  # every worker socket of every API process, when the queue is shared


@dataclass(frozen=True)
class JobRequest:
    params: dict[str, Any]
    model_id: str | None = None
    tier: str | None = None
    capabilities: tuple[str, ...] = ()
    priority: int = 0


def to_microseconds(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def queued_job(job: Job) -> QueuedJob:
    return QueuedJob(job_id=str(job.id), model_id=job.model_id, priority=job.priority, submitted_us=job.submitted_us,
                     account=str(job.account_id))


def _claim(*, job_id: str, worker_id: str, turn_us: int | None, now: datetime) -> tuple[int, dict[str, Any]] | None:
    """Compare-and-set queued -> dispatched, recording the turn the dispatch gave the job's
    account; the job's attempt and params, or None when it is no longer queued. One statement
    (UPDATE ... RETURNING, PostgreSQL and SQLite >= 3.35), since the claim sits on the submit ->
    dispatch path."""
    fields = Job._meta
    sql = (f"UPDATE {fields.db_table} SET state = %s, worker_id = %s, dispatched_at = %s, "
           "turn_us = COALESCE(%s, turn_us), progress_step = NULL, progress_steps = NULL "
           "WHERE id = %s AND state = %s RETURNING attempts, params")
    dispatched_at = fields.get_field("dispatched_at").get_db_prep_value(now, connection)
    values = [JobState.DISPATCHED.value, worker_id, dispatched_at, turn_us,
              fields.pk.get_db_prep_value(uuid.UUID(job_id), connection), JobState.QUEUED.value]
    with connection.cursor() as cursor:  # one statement: atomic without a transaction block
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return None
    params = row[1]  # text from both backends (Django loads jsonb as text), unless a driver decoded it
    return row[0], json.loads(params) if isinstance(params, (str, bytes)) else params


def jobs_dispatch(*, now: datetime) -> list[Assignment]:
    """Hand queued jobs to workers with room, claiming each in the database first."""
    current = dispatcher()

    def claim(assignment: Assignment) -> bool:
        job = assignment.job
        claimed = _claim(job_id=job.job_id, worker_id=assignment.worker_id, turn_us=job.turn_us, now=now)
        if claimed is None:
            return False
        channel = current.channel_of(assignment.worker_id)
        if channel:
            attempts, params = claimed
            to_socket_after_commit(channel, JobOrder(job.job_id, attempts, job.model_id, params).to_wire())
        return True

    return current.plan(claim, at_us=to_microseconds(now))


def jobs_dispatch_or_wake(*, queued: set[str], now: datetime) -> list[Assignment]:
    """Dispatch; with a shared queue, jobs of `queued` that no worker of this process took wake the
    other processes (from the dispatch's own answer: no queue lookup on the submit path; a job
    another thread dispatched meanwhile only costs a needless wake-up). The dispatch's assignments."""
    assignments = jobs_dispatch(now=now)
    if dispatcher().shared and queued - {assignment.job.job_id for assignment in assignments}:
        # every process with a worker looks at the shared queue again (`jobs.available`)
        relay.group_send_others_sync(WORKERS_GROUP, {"type": "jobs.available"})
    return assignments


# --- REST side --------------------------------------------------------------------------------

def job_submit(*, account: User, request: JobRequest, now: datetime) -> Job:
    """Route, persist and queue a job; workers with room get it after the commit."""
    manifest = route(registered_manifests(), model_id=request.model_id, tier=request.tier,
                     capabilities=request.capabilities, params=request.params)
    # Counted, then inserted: concurrent submissions of one account may pass the limit by as many
    # as run at once (bounded by JOB_SUBMIT_RATE); a lock would cost every submission two round trips.
    if _unfinished_jobs(account.pk, up_to=settings.ACCOUNT_JOB_LIMIT) >= settings.ACCOUNT_JOB_LIMIT:
        raise TooManyJobs(f"the account already has {settings.ACCOUNT_JOB_LIMIT} unfinished jobs "
                          "(ACCOUNT_JOB_LIMIT); wait for some to end, or cancel some")
    # One INSERT commits on its own (no BEGIN/COMMIT round trips); inside a caller's transaction the
    # job is queued only once that commits.
    job = Job.objects.create(account=account, model_id=manifest.model_id, params=request.params,
                             priority=request.priority, created_at=now, submitted_us=to_microseconds(now))
    transaction.on_commit(lambda: _queue_and_dispatch(job, now=now))
    return job


def _unfinished_jobs(account_id: int, *, up_to: int) -> int:
    """The account's unfinished jobs, counted up to `up_to` only; one statement, no ORM machinery,
    since it sits on the submit path. Its WHERE is the partial index job_account_unfinished's own
    condition, written out as constants so that the planner can prove it and read only that index."""
    states = ", ".join(f"'{state.value}'" for state in UNFINISHED_STATES)  # the enum's own words
    sql = (f"SELECT COUNT(*) FROM (SELECT 1 FROM {Job._meta.db_table} WHERE account_id = %s AND state IN "
           f"({states}) LIMIT %s) AS unfinished")
    with connection.cursor() as cursor:
        cursor.execute(sql, [account_id, up_to])
        return int(cursor.fetchone()[0])


def _queue_and_dispatch(job: Job, *, now: datetime) -> None:
    """Queue the new job and dispatch. When a worker here took it, `job` says so as the claim wrote
    it, so that the submission's answer needs no second read of the row."""
    dispatcher().push(queued_job(job))
    for assignment in jobs_dispatch_or_wake(queued={str(job.id)}, now=now):
        if assignment.job.job_id == str(job.id):
            job.state, job.worker_id, job.dispatched_at = JobState.DISPATCHED, assignment.worker_id, now
            job.turn_us = assignment.job.turn_us if assignment.job.turn_us is not None else job.turn_us
            job.progress_step = job.progress_steps = None


def _tell_holder(current: Dispatcher, holder: str | None, job_id: str, worker_id: str | None) -> None:
    """Tell the worker holding a job (`holder` here, or `worker_id` in the database) to cancel it,
    wherever it is connected."""
    channel = current.channel_of(holder)
    if channel:
        to_socket_after_commit(channel, Cancel(job_id).to_wire())
    elif current.shared and (holder or worker_id):
        # Connected to another API process (or to none): the one holding its socket tells it.
        relay.group_send_sync(WORKERS_GROUP, {"type": "worker.cancel", "worker_id": holder or worker_id,
                                              "job_id": job_id})


def job_cancel(*, job: Job, now: datetime) -> Job:
    """Cancel a job that has not ended; a worker holding it gets `cancel` (a v2 worker's place frees
    when it lets the job go, a v1 worker's at once). JobAlreadyEnded otherwise."""
    with transaction.atomic():
        cancelled = Job.objects.filter(id=job.id, state__in=ACTIVE_STATES).update(
            state=JobState.CANCELLED, finished_at=now)
    job.refresh_from_db()
    if not cancelled:
        raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
    current = dispatcher()
    current.remove(str(job.id))
    holder = current.release(str(job.id), until_let_go=True)
    _tell_holder(current, holder, str(job.id), job.worker_id)
    if holder:
        jobs_dispatch(now=now)
    return job


def job_requeue(*, job: Job, now: datetime) -> Job:
    """Operators: put a failed, cancelled or stuck job back in the queue at its old place."""
    worker_id = Job.objects.filter(id=job.id).values_list("worker_id", flat=True).first()
    with transaction.atomic():
        moved = Job.objects.filter(id=job.id).exclude(state__in=(JobState.QUEUED, JobState.SUCCEEDED)).update(
            state=JobState.QUEUED, worker_id=None, dispatched_at=None, started_at=None, finished_at=None,
            error=None, attempts=1, progress_step=None, progress_steps=None)
    job.refresh_from_db()
    if moved:
        current = dispatcher()
        holder = current.release(str(job.id))
        _tell_holder(current, holder, str(job.id), worker_id)
        current.push(queued_job(job))
        jobs_dispatch_or_wake(queued={str(job.id)}, now=now)
    return job


# --- worker side ------------------------------------------------------------------------------

def job_started(*, worker_id: str, job_id: str, now: datetime) -> bool:
    return Job.objects.filter(id=job_id, worker_id=worker_id, state=JobState.DISPATCHED).update(
        state=JobState.RUNNING, started_at=now) == 1


def job_progress(*, worker_id: str, job_id: str, step: int, steps: int, now: datetime) -> bool:
    updated = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES).update(
        progress_step=step, progress_steps=steps)
    # A worker may report progress before job_started arrives; progress means it is running.
    Job.objects.filter(id=job_id, worker_id=worker_id, state=JobState.DISPATCHED).update(
        state=JobState.RUNNING, started_at=now)
    return updated == 1


def decode_image(value: str) -> tuple[bytes, str]:
    """A worker's base64 PNG or JPEG (bare, or a data: URL) as bytes and its extension."""
    if not isinstance(value, str):
        raise ValueError("an image must be a base64 string")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image is not valid base64") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError("an image is too large")
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return data, "png"
    if data.startswith(b"\xff\xd8\xff"):
        return data, "jpg"
    raise ValueError("an image must be a PNG or a JPEG")


def job_finish(*, worker_id: str, job_id: str, images: list[str], gpu_ms: float | None, rung: str,
               now: datetime) -> bool:
    """Store a job's images and mark it succeeded; frees the worker's place for the next job. (No
    check before storing: a result for a job this worker no longer holds is rare, and its files are
    deleted again when the compare-and-set below finds it so; a check costs every job a round trip.)
    The result of a run the worker was told to cancel (v2) only frees its place."""
    if _let_go(job_id, worker_id, now=now):
        return False
    try:
        decoded = [decode_image(image) for image in images]
    except ValueError as exc:
        return job_fail(worker_id=worker_id, job_id=job_id, error=f"the worker sent a bad image: {exc}", now=now)
    names: list[str] = []
    try:
        for n, (data, extension) in enumerate(decoded):
            names.append(default_storage.save(f"jobs/{job_id}/{n}.{extension}", ContentFile(data)))
        finished = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES).update(
            state=JobState.SUCCEEDED, images=names, gpu_ms=gpu_ms, rung=rung[:40], finished_at=now,
            started_at=Coalesce(F("started_at"), Value(now))) == 1
    except Exception:
        _delete_images(names)  # nothing stored: the caller does not ack, and a v2 worker sends it again
        raise
    if not finished:
        _delete_images(names)
    # A result ends the worker's hold on the job even when it changed nothing: it runs it no more.
    _release_and_dispatch(job_id, worker_id, now=now)
    return finished


def _delete_images(names: list[str]) -> None:
    for name in names:
        try:
            default_storage.delete(name)
        except Exception:  # the storage is failing: a stray file is no reason to lose the answer
            log.exception("could not delete %s", name)


def job_fail(*, worker_id: str, job_id: str, error: str, now: datetime) -> bool:
    """A failure the worker reports is final. A v2 worker's answer to `cancel` only frees its place."""
    if _let_go(job_id, worker_id, now=now):
        return False
    failed = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES).update(
        state=JobState.FAILED, error=str(error)[:2000] or "failed", finished_at=now) == 1
    # Also when it changed nothing: the worker runs it no more, whatever the database says.
    _release_and_dispatch(job_id, worker_id, now=now)
    return failed


def _let_go(job_id: str, worker_id: str, *, now: datetime) -> bool:
    """Whether the worker was letting go of this job (told to cancel it); its place frees. The job
    may since have been queued again, even for this worker: the answer must not touch that run."""
    if not dispatcher().let_go(job_id, worker_id=worker_id):
        return False
    jobs_dispatch(now=now)
    return True


def _release_and_dispatch(job_id: str, worker_id: str, *, now: datetime) -> None:
    if dispatcher().release(job_id, worker_id=worker_id):
        jobs_dispatch(now=now)


def job_left_worker(*, worker_id: str, job_id: str, now: datetime) -> None:
    """Another API process cancelled or requeued a job this process's worker holds: its place frees
    (a v2 worker's once it lets the job go: its job_failed or job_result)."""
    if dispatcher().release(job_id, worker_id=worker_id, until_let_go=True):
        jobs_dispatch(now=now)


def jobs_return(*, job_ids: set[str], now: datetime) -> None:
    """The worker holding these jobs died: each goes back to the queue at its old place once,
    and fails with worker_lost the second time."""
    current = dispatcher()
    requeued: list[str] = []
    for job in Job.objects.filter(id__in=job_ids, state__in=HELD_STATES):
        current.release(str(job.id))
        if retry_decision(attempts=job.attempts) == "requeue":
            moved = Job.objects.filter(id=job.id, state__in=HELD_STATES, attempts=job.attempts).update(
                state=JobState.QUEUED, worker_id=None, attempts=job.attempts + 1, dispatched_at=None,
                started_at=None, progress_step=None, progress_steps=None)
            if moved:
                current.push(queued_job(job))
                requeued.append(str(job.id))
        else:
            Job.objects.filter(id=job.id, state__in=HELD_STATES).update(
                state=JobState.FAILED, error=WORKER_LOST, finished_at=now)
    jobs_dispatch_or_wake(queued=set(requeued), now=now)


# --- workers connecting and leaving (called by workers.lifecycle) ------------------------------

def worker_jobs_connect(*, worker_id: str, channel_name: str, models: list[str], now: datetime,
                        protocol: int = 1, listed: tuple[str, ...] | None = None) -> str | None:
    """Register a worker connection and hand it work; the channel of a connection it replaced.
    A v1 worker keeps every job the API gave it, and jobs cancelled while it was away (this API
    restarted meanwhile) are cancelled on it first. A v2 worker (`listed`: its hello's `jobs`)
    keeps those it lists, the others follow the dead-worker rule at once, and a listed job the API
    does not give it gets `cancel`."""
    held = {str(job_id) for job_id in Job.objects.filter(worker_id=worker_id, state__in=HELD_STATES)
            .values_list("id", flat=True)}
    joined = dispatcher().connect(worker_id=worker_id, channel_name=channel_name, models=models, held=held,
                                  protocol=protocol, listed=listed)
    for job_id in sorted(joined.cancel):
        to_socket_after_commit(channel_name, Cancel(job_id).to_wire())
    if joined.lost:
        jobs_return(job_ids=joined.lost, now=now)
    orphans_sweep(now=now)
    jobs_dispatch(now=now)
    return joined.replaced


def worker_jobs_disconnect(*, worker_id: str, channel_name: str, now: datetime) -> bool:
    """A worker's socket closed or fell silent: it is dead, and its jobs follow the retry rule.
    False when a newer connection of the same worker had already taken over."""
    held = dispatcher().disconnect(worker_id=worker_id, channel_name=channel_name)
    if held is None:
        return False
    jobs_return(job_ids=held, now=now)
    return True


def orphans_sweep(*, now: datetime) -> None:
    """Jobs held by workers that did not reconnect after this API process started follow the retry
    rule. With a shared queue, so do the jobs of workers that no API process has seen for the
    dead-worker window (their process died and they did not come back); a worker connected to
    another live process is not an orphan."""
    current = dispatcher()
    expired = current.expired_orphans(now=now)
    if current.shared:
        window = 4 * settings.WORKER_HEARTBEAT_SECONDS
        alive = worker_rows.seen_within(list(expired), seconds=window, now=now)
        expired = {worker_id: held for worker_id, held in expired.items() if worker_id not in alive}
        waiting = current.orphan_ids() | current.connected_ids()  # this process decides on those itself
        silent = worker_rows.silent_ids(seconds=window, now=now)
        stale = (Job.objects.filter(state__in=HELD_STATES, worker_id__in=silent).exclude(worker_id__in=waiting)
                 .values_list("id", "worker_id"))
        for job_id, worker_id in stale:
            expired.setdefault(worker_id or "", set()).add(str(job_id))
    for held in expired.values():
        jobs_return(job_ids=held, now=now)
