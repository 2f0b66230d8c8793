"""What accounts and operators ask of a job (REST and admin): submit, cancel, requeue, pause and
resume; and telling the worker that holds a job to cancel it, or to preempt it for a pause. The
story: docs/protocol.md, "The job" (with "Pausing")."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import F

from models_registry.routing import route
from models_registry.selectors import registered_manifests
from potocolom.protocol.events import WorkerCancel, WorkerPreempt
from potocolom.protocol.worker import PROTOCOL_V2, Cancel, Preempt
from potocolom.transport import relay
from potocolom.transport.notify import to_socket_after_commit
from scheduling.dispatcher import Dispatcher, dispatcher
from scheduling.errors import JobAlreadyEnded, JobNotPaused, TooManyJobs
from scheduling.eta import first_etas
from scheduling.events import batching, job_changed_as, jobs_changed
from scheduling.images import INIT_IMAGE, init_image_store, param_columns
from scheduling.models import ENDED_STATES, HELD_STATES, UNFINISHED_STATES, Job, JobState
from scheduling.services.dispatch import WORKERS_GROUP, jobs_dispatch, jobs_dispatch_or_wake
from scheduling.services.job_rows import OFF_WORKER, drop_checkpoint, queued_job, to_microseconds, webhook_outbox


@dataclass(frozen=True)
class JobRequest:
    params: dict[str, Any]
    model_id: str | None = None
    tier: str | None = None
    capabilities: tuple[str, ...] = ()
    priority: int = 0
    webhook_url: str = ""  # checked by the caller (scheduling.webhooks.resolving.webhook_url_problem)
    webhook_origin: str = ""  # scheme://host the job was submitted to: its posted URLs are absolute on it


@batching
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
    # An init_image goes to the storage first (a failed insert leaves a stray file, never a row
    # pointing at nothing); the row keeps the numbers the queue's queries read, in columns.
    params = dict(request.params)
    job = Job(account=account, model_id=manifest.model_id, priority=request.priority, created_at=now,
              submitted_us=to_microseconds(now), webhook_url=request.webhook_url,
              webhook_origin=request.webhook_origin, **param_columns(params))
    image = params.pop(INIT_IMAGE, None)
    if isinstance(image, str):
        job.init_image = init_image_store(job.id, image)
    job.params = params
    job.save(force_insert=True)
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
    job_changed_as(job, now=now)  # queued (submitted or resumed), before any dispatch's event
    for assignment in jobs_dispatch_or_wake(queued=[queued_job(job)], now=now):
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
        relay.group_send_sync(WORKERS_GROUP, WorkerCancel(holder or worker_id or "", job_id).to_event())


def job_cancel(*, job: Job, now: datetime) -> Job:
    """Cancel a job that has not ended (a paused one too); a worker holding it gets `cancel` (a v2
    worker's place frees when it lets the job go, a v1 worker's at once), and its stored checkpoint
    is deleted. JobAlreadyEnded otherwise."""
    with transaction.atomic():
        cancelled = Job.objects.filter(id=job.id, state__in=UNFINISHED_STATES).update(
            state=JobState.CANCELLED, finished_at=now, pause_requested=False)
        if cancelled:
            webhook_outbox(job.id, now=now)
    job.refresh_from_db()
    if not cancelled:
        raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
    job_changed_as(job, now=now)
    first_etas().forget(str(job.id))
    drop_checkpoint(job)
    current = dispatcher()
    current.remove(str(job.id))
    holder = current.release(str(job.id), until_let_go=True)
    _tell_holder(current, holder, str(job.id), job.worker_id)
    if holder:
        jobs_dispatch(now=now)
    return job


@batching
def job_requeue(*, job: Job, now: datetime) -> Job:
    """Operators: put a failed, cancelled or stuck job back in the queue at its old place."""
    worker_id = Job.objects.filter(id=job.id).values_list("worker_id", flat=True).first()
    with transaction.atomic():
        moved = Job.objects.filter(id=job.id).exclude(state__in=(JobState.QUEUED, JobState.SUCCEEDED)).update(
            state=JobState.QUEUED, worker_id=None, dispatched_at=None, started_at=None, finished_at=None,
            error=None, attempts=1, progress_step=None, progress_steps=None, pause_requested=False)
    job.refresh_from_db()
    if moved:
        current = dispatcher()
        holder = current.release(str(job.id))
        _tell_holder(current, holder, str(job.id), worker_id)
        current.push(queued_job(job))
        job_changed_as(job, now=now)
        jobs_dispatch_or_wake(queued=[queued_job(job)], now=now)
    return job


def job_pause(*, job: Job, now: datetime) -> Job:
    """Pause a job that has not ended. A queued one is paused at once: it leaves the queue (its key,
    and its account's turn, stay in the row for its resume). A held one is preempted (job_pause_held) and
    becomes paused when its worker answers. A paused one stays so. JobAlreadyEnded for an ended one."""
    if Job.objects.filter(id=job.id, state=JobState.QUEUED).update(state=JobState.PAUSED, paused_at=now):
        dispatcher().remove(str(job.id))
        jobs_changed([str(job.id)], now=now)
        first_etas().forget(str(job.id))
    elif Job.objects.filter(id=job.id, state__in=HELD_STATES, pause_requested=False).update(pause_requested=True):
        worker_id = Job.objects.filter(id=job.id).values_list("worker_id", flat=True).first()
        job_pause_held(job_id=str(job.id), worker_id=worker_id, now=now)
    job.refresh_from_db()
    if job.state in ENDED_STATES:
        raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
    return job


@batching
def job_resume(*, job: Job, now: datetime) -> Job:
    """A paused job is queued again at its old place: the same key (priority, submission) in its
    account's line, and the account's turn untouched, as for a job sent back. JobNotPaused for a job
    in another unfinished state (one being preempted for a pause too), JobAlreadyEnded for an ended one."""
    resumed = Job.objects.filter(id=job.id, state=JobState.PAUSED).update(state=JobState.QUEUED)
    job.refresh_from_db()
    if not resumed:
        if job.state in ENDED_STATES:
            raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
        raise JobNotPaused(f"job {job.id} is not paused: {job.state}")
    _queue_and_dispatch(job, now=now)
    return job


def job_pause_held(*, job_id: str, worker_id: str | None, now: datetime, relayed: bool = False) -> None:
    """Take a held job off its worker (`worker_id` in the database) for a pause. A v2 worker
    connected here gets `preempt`; the job counts against its depth until its `job_preempted`,
    which pauses it with its checkpoint. A worker this process does not know, with a shared queue,
    may be connected to another process: that one is asked to do the same (`worker.preempt`;
    `relayed`: this process is that one, and leaves a worker it does not hold either to the
    dead-worker rule, which pauses the job). Any other holder (a v1 worker, one not back since this
    process started) is told to cancel it, and the job is paused at once, with no new checkpoint."""
    current = dispatcher()
    holder = current.holder_of(job_id)
    if holder is not None and holder.protocol >= PROTOCOL_V2:
        current.asked_to_preempt(job_id)
        to_socket_after_commit(holder.channel_name, Preempt(job_id).to_wire())
        return
    if holder is None and current.shared and worker_id and not current.knows(worker_id):
        if not relayed:
            relay.group_send_sync(WORKERS_GROUP, WorkerPreempt(worker_id, job_id).to_event())
        return
    released = current.release(job_id)
    _tell_holder(current, released, job_id, worker_id)
    if Job.objects.filter(id=job_id, state__in=HELD_STATES).update(
            state=JobState.PAUSED, pause_requested=False, preemptions=F("preemptions") + 1, paused_at=now,
            **OFF_WORKER):
        jobs_changed([job_id], now=now)
    if released:
        jobs_dispatch(now=now)
