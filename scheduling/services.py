"""Writes of the job path: each state change is a compare-and-set in the database, then this
process's dispatcher is told, then messages go to workers after the commit. Services are
synchronous (consumers call them through database_sync_to_async) and take the clock as `now=`."""
from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection, transaction
from django.db.models import F, QuerySet, Value
from django.db.models.functions import Coalesce
from django.utils.crypto import salted_hmac

from models_registry.routing import route
from models_registry.selectors import registered_manifests
from potocolom.protocol.worker import MAX_CHECKPOINT_CHARS, PROTOCOL_V2, Cancel, JobOrder, Preempt, Resume
from potocolom.transport import relay
from potocolom.transport.notify import to_socket_after_commit
from scheduling.checkpoints import checkpoint_discard, checkpoint_read, checkpoint_save
from scheduling.dispatcher import Dispatcher, dispatcher
from scheduling.errors import JobAlreadyEnded, JobNotPaused, TooManyJobs
from scheduling.models import ENDED_STATES, HELD_STATES, UNFINISHED_STATES, Job, JobState
from scheduling.policy import Assignment, HeldJob, Preemption, QueuedJob, retry_decision
from workers import selectors as worker_rows

log = logging.getLogger(__name__)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
WORKER_LOST = "worker_lost"
MAX_IMAGE_BYTES = 12 * 1024 * 1024
WORKERS_GROUP = "potocolom.workers"  # every worker socket of every API process, when the queue is shared
ACCOUNT_KEY_SALT = "potocolom.scheduling.worker-account"  # job.account: an HMAC of the account id
# What a job leaves behind when it goes back off its worker (sent back, preempted, paused).
_OFF_WORKER: dict[str, Any] = {"worker_id": None, "dispatched_at": None, "started_at": None}


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


@dataclass(frozen=True)
class Claimed:
    """What a dispatch's compare-and-set read back for the job order: its attempt and params, and
    its stored checkpoint (storage name, "" without one, and the step it holds)."""

    attempts: int
    params: Any
    checkpoint: str
    checkpoint_step: int | None


def _claim(*, job_id: str, worker_id: str, turn_us: int | None, now: datetime) -> Claimed | None:
    """Compare-and-set queued -> dispatched, recording the turn the dispatch gave the job's
    account; what the job order needs of the row, or None when it is no longer queued. One
    statement (UPDATE ... RETURNING, PostgreSQL and SQLite >= 3.35), since the claim sits on the
    submit -> dispatch path."""
    fields = Job._meta
    sql = (f"UPDATE {fields.db_table} SET state = %s, worker_id = %s, dispatched_at = %s, "
           "turn_us = COALESCE(%s, turn_us), progress_step = NULL, progress_steps = NULL "
           "WHERE id = %s AND state = %s RETURNING attempts, params, checkpoint, checkpoint_step")
    dispatched_at = fields.get_field("dispatched_at").get_db_prep_value(now, connection)
    values = [JobState.DISPATCHED.value, worker_id, dispatched_at, turn_us,
              fields.pk.get_db_prep_value(uuid.UUID(job_id), connection), JobState.QUEUED.value]
    with connection.cursor() as cursor:  # one statement: atomic without a transaction block
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return None
    params = row[1]  # text from both backends (Django loads jsonb as text), unless a driver decoded it
    return Claimed(row[0], json.loads(params) if isinstance(params, (str, bytes)) else params, row[2] or "", row[3])


def account_key(account_id: str) -> str:
    """`job.account` for a v2 worker: the same opaque key for every job of one account (so that the
    worker can apply its priority rule within an account), which tells it nothing else about the
    account (an HMAC of its id under SECRET_KEY)."""
    return salted_hmac(ACCOUNT_KEY_SALT, account_id).hexdigest()[:32]


def _job_order(job: QueuedJob, claimed: Claimed, *, protocol: int) -> JobOrder:
    """The `job` message: v1's fields for a v1 worker; a v2 worker also gets the job's priority,
    its account's key and, when it has a stored checkpoint, `resume` (a checkpoint that cannot be
    read, or is over the wire's size, is left out: the job restarts from step 0)."""
    if protocol < PROTOCOL_V2:
        return JobOrder(job.job_id, claimed.attempts, job.model_id, claimed.params)
    return JobOrder(job.job_id, claimed.attempts, job.model_id, claimed.params, priority=job.priority,
                    account=account_key(job.account), resume=_resume_of(job.job_id, claimed))


def _resume_of(job_id: str, claimed: Claimed) -> Resume | None:
    """A job's stored checkpoint as `job.resume`, or None without a usable one."""
    if not claimed.checkpoint or claimed.checkpoint_step is None:
        return None
    try:
        data = checkpoint_read(claimed.checkpoint)
    except Exception:  # the storage is failing: the job runs all the same, from step 0
        log.exception("job %s: its checkpoint %s could not be read; it restarts from step 0", job_id,
                      claimed.checkpoint)
        return None
    if data is None:
        return None
    text = base64.b64encode(data).decode("ascii")
    if len(text) > MAX_CHECKPOINT_CHARS:
        log.warning("job %s: its checkpoint is over the wire's size; it restarts from step 0", job_id)
        return None
    return Resume(claimed.checkpoint_step, text)


def jobs_dispatch(*, now: datetime) -> list[Assignment]:
    """Hand queued jobs to workers with room, claiming each in the database first; each gets the
    `job` its worker's protocol reads."""
    current = dispatcher()
    orders: list[tuple[str, int, QueuedJob, Claimed]] = []

    def claim(assignment: Assignment) -> bool:
        job = assignment.job
        claimed = _claim(job_id=job.job_id, worker_id=assignment.worker_id, turn_us=job.turn_us, now=now)
        if claimed is None:
            return False
        worker = current.workers.get(assignment.worker_id)  # plan() holds the dispatcher's lock
        if worker is not None:
            orders.append((worker.channel_name, worker.protocol, job, claimed))
        return True

    try:
        return current.plan(claim, at_us=to_microseconds(now))
    finally:
        # Built once plan() let go of the dispatcher's lock: a resume reads its checkpoint from the
        # storage. Every job claimed is sent, even when the plan stopped half way.
        for channel_name, protocol, job, claimed in orders:
            to_socket_after_commit(channel_name, _job_order(job, claimed, protocol=protocol).to_wire())


def jobs_dispatch_or_wake(*, queued: Collection[QueuedJob], now: datetime) -> list[Assignment]:
    """Dispatch; jobs of `queued` (just queued) that no worker of this process took may make room
    for themselves by the priority preemption (`jobs_make_room`), and with a shared queue those
    still waiting wake the other processes, which try the same with their workers (from the
    dispatch's own answer: no queue lookup on the submit path; a job another thread dispatched
    meanwhile only costs a needless wake-up). The dispatch's assignments."""
    assignments = jobs_dispatch(now=now)
    taken = {assignment.job.job_id for assignment in assignments}
    waiting = jobs_make_room([job for job in queued if job.job_id not in taken], now=now)
    if dispatcher().shared and waiting:
        # every process with a worker looks at the shared queue again (`jobs.available`)
        relay.group_send_others_sync(WORKERS_GROUP, {"type": "jobs.available",
                                                     "waiting": [list(job[:5]) for job in waiting]})
    return assignments


def jobs_dispatch_for(*, waiting: Collection[QueuedJob], now: datetime) -> None:
    """Another process queued `waiting` and could not place them (`jobs.available`): dispatch here,
    and make room for those still queued on this process's workers."""
    taken = {assignment.job.job_id for assignment in jobs_dispatch(now=now)}
    jobs_make_room([job for job in waiting if job.job_id not in taken], now=now)


def waiting_of(event: dict[str, Any]) -> list[QueuedJob]:
    """The waiting jobs a `jobs.available` event names (none from an older process, or a bad entry)."""
    jobs: list[QueuedJob] = []
    for entry in event.get("waiting") or ():
        try:
            job_id, model_id, priority, submitted_us, account = entry
            jobs.append(QueuedJob(str(job_id), str(model_id), int(priority), int(submitted_us), str(account)))
        except (TypeError, ValueError):
            log.warning("a jobs.available event names a waiting job this process cannot read: %r", entry)
    return jobs


def jobs_make_room(waiting: Collection[QueuedJob], *, now: datetime) -> list[QueuedJob]:
    """The priority preemption: for each waiting job that can go nowhere, a worker of this process
    holding a lower-priority job of the same account is sent `preempt` for it (policy.plan_preemptions),
    and the job goes there once that worker answers. Only jobs still queued in the database are
    served (another process may have placed one meanwhile). The waiting jobs left without room."""
    if not waiting:
        return []
    current = dispatcher()
    planned = current.preemptions_for(waiting)
    if planned:
        queued = {str(job_id) for job_id in Job.objects.filter(
            id__in=[p.for_job_id for p in planned], state=JobState.QUEUED).values_list("id", flat=True)}
        served = {p.for_job_id for p in planned if p.for_job_id in queued and _send_preempt(current, p)}
        return [job for job in waiting if job.job_id not in served]
    return list(waiting)


def _send_preempt(current: Dispatcher, preemption: Preemption) -> bool:
    channel = current.preempting(preemption)
    if channel is None:
        return False
    log.info("job %s preempted on %s to make room for job %s of the same account, with a higher priority",
             preemption.job_id, preemption.worker_id, preemption.for_job_id)
    to_socket_after_commit(channel, Preempt(preemption.job_id).to_wire())
    return True


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
        relay.group_send_sync(WORKERS_GROUP, {"type": "worker.cancel", "worker_id": holder or worker_id,
                                              "job_id": job_id})


def job_cancel(*, job: Job, now: datetime) -> Job:
    """Cancel a job that has not ended (a paused one too); a worker holding it gets `cancel` (a v2
    worker's place frees when it lets the job go, a v1 worker's at once), and its stored checkpoint
    is deleted. JobAlreadyEnded otherwise."""
    with transaction.atomic():
        cancelled = Job.objects.filter(id=job.id, state__in=UNFINISHED_STATES).update(
            state=JobState.CANCELLED, finished_at=now, pause_requested=False)
    job.refresh_from_db()
    if not cancelled:
        raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
    _drop_checkpoint(job)
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
            error=None, attempts=1, progress_step=None, progress_steps=None, pause_requested=False)
    job.refresh_from_db()
    if moved:
        current = dispatcher()
        holder = current.release(str(job.id))
        _tell_holder(current, holder, str(job.id), worker_id)
        current.push(queued_job(job))
        jobs_dispatch_or_wake(queued=[queued_job(job)], now=now)
    return job


def job_pause(*, job: Job, now: datetime) -> Job:
    """Pause a job that has not ended. A queued one is paused at once: it leaves the queue (its key,
    and its account's turn, stay in the row for its resume). A held one is preempted (_preempt) and
    becomes paused when its worker answers. A paused one stays so. JobAlreadyEnded for an ended one."""
    if Job.objects.filter(id=job.id, state=JobState.QUEUED).update(state=JobState.PAUSED):
        dispatcher().remove(str(job.id))
    elif Job.objects.filter(id=job.id, state__in=HELD_STATES, pause_requested=False).update(pause_requested=True):
        worker_id = Job.objects.filter(id=job.id).values_list("worker_id", flat=True).first()
        _preempt(dispatcher(), str(job.id), worker_id, now=now)
    job.refresh_from_db()
    if job.state in ENDED_STATES:
        raise JobAlreadyEnded(f"job {job.id} already ended: {job.state}")
    return job


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


def _preempt(current: Dispatcher, job_id: str, worker_id: str | None, *, now: datetime,
             relayed: bool = False) -> None:
    """Take a held job off its worker for a pause. A v2 worker connected here gets `preempt`; the
    job counts against its depth until its `job_preempted`, which pauses it with its checkpoint.
    A worker this process does not know, with a shared queue, may be connected to another process:
    that one is asked to do the same (`worker.preempt`; `relayed`: this process is that one, and
    leaves a worker it does not hold either to the dead-worker rule, which pauses the job). Any
    other holder (a v1 worker, one not back since this process started) is told to cancel it, and
    the job is paused at once, with no new checkpoint."""
    holder = current.holder_of(job_id)
    if holder is not None and holder.protocol >= PROTOCOL_V2:
        current.asked_to_preempt(job_id)
        to_socket_after_commit(holder.channel_name, Preempt(job_id).to_wire())
        return
    if holder is None and current.shared and worker_id and not current.knows(worker_id):
        if not relayed:
            relay.group_send_sync(WORKERS_GROUP, {"type": "worker.preempt", "worker_id": worker_id, "job_id": job_id})
        return
    released = current.release(job_id)
    _tell_holder(current, released, job_id, worker_id)
    Job.objects.filter(id=job_id, state__in=HELD_STATES).update(
        state=JobState.PAUSED, pause_requested=False, preemptions=F("preemptions") + 1, **_OFF_WORKER)
    if released:
        jobs_dispatch(now=now)


def _send_back(held: QuerySet[Job], **fields: Any) -> JobState | None:
    """Move a held job off its worker: to `queued`, or to `paused` when a pause was asked. Two
    compare-and-sets, so that a pause asked meanwhile is never lost; the state it went to, or None
    when `held` no longer finds it."""
    if held.filter(pause_requested=False).update(state=JobState.QUEUED, **_OFF_WORKER, **fields):
        return JobState.QUEUED
    if held.filter(pause_requested=True).update(state=JobState.PAUSED, pause_requested=False, **_OFF_WORKER,
                                                 **fields):
        return JobState.PAUSED
    return None


def _drop_checkpoint(job: Job) -> None:
    """An ended job keeps no checkpoint: its row forgets it, its blob is deleted."""
    if job.checkpoint:
        Job.objects.filter(id=job.id, checkpoint=job.checkpoint).update(checkpoint="", checkpoint_step=None)
        checkpoint_discard(job.checkpoint)
        job.checkpoint, job.checkpoint_step = "", None


# --- worker side ------------------------------------------------------------------------------

def job_started(*, worker_id: str, job_id: str, now: datetime) -> bool:
    dispatcher().started(job_id, worker_id=worker_id)
    return Job.objects.filter(id=job_id, worker_id=worker_id, state=JobState.DISPATCHED).update(
        state=JobState.RUNNING, started_at=now) == 1


def job_progress(*, worker_id: str, job_id: str, step: int, steps: int, now: datetime) -> bool:
    updated = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES).update(
        progress_step=step, progress_steps=steps)
    # A worker may report progress before job_started arrives; progress means it is running.
    dispatcher().started(job_id, worker_id=worker_id)
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
        finished = _end_held(job_id, worker_id, state=JobState.SUCCEEDED, images=names, gpu_ms=gpu_ms,
                             rung=rung[:40], finished_at=now, started_at=Coalesce(F("started_at"), Value(now)))
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
    failed = _end_held(job_id, worker_id, state=JobState.FAILED, error=str(error)[:2000] or "failed",
                       finished_at=now)
    # Also when it changed nothing: the worker runs it no more, whatever the database says.
    _release_and_dispatch(job_id, worker_id, now=now)
    return failed


def _end_held(job_id: str, worker_id: str, **fields: Any) -> bool:
    """Compare-and-set a job this worker holds to its end (`fields`); its stored checkpoint goes
    with it. A job without one (nearly all) costs one statement, as before checkpoints existed."""
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    if held.filter(checkpoint="").update(**fields):
        return True
    name = held.values_list("checkpoint", flat=True).first()
    if not name or not held.filter(checkpoint=name).update(checkpoint="", checkpoint_step=None, **fields):
        return False
    checkpoint_discard(name)
    return True


def job_checkpoint(*, worker_id: str, job_id: str, step: int, steps: int, checkpoint: bytes, now: datetime) -> bool:
    """A running job's periodic checkpoint (`job_checkpoint`) replaces the stored one: what the job
    resumes from if its worker dies. False, and nothing kept, when this worker no longer holds it."""
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    previous = held.values_list("checkpoint", flat=True).first()
    stored = _store_checkpoint(job_id, step, checkpoint) if previous is not None else ""
    if not stored:
        return False
    try:
        kept = held.filter(checkpoint=previous).update(checkpoint=stored, checkpoint_step=step) == 1
    except Exception:
        checkpoint_discard(stored, keep=previous or "")
        raise
    if kept:
        checkpoint_discard(previous or "", keep=stored)
    else:
        checkpoint_discard(stored, keep=previous or "")
    return kept


def job_preempted(*, worker_id: str, job_id: str, step: int, steps: int, checkpoint: bytes | None,
                  now: datetime) -> bool:
    """A worker stopped a job at a step boundary (told to by `preempt`, or draining) and no longer
    holds it. Its checkpoint replaces the stored one, and the job goes back to `queued` at its old
    place with the same attempts (the retry rule is for dead workers), or to `paused` when a pause
    was asked. A null checkpoint (not started yet, or a scheduler that cannot be resumed) keeps the
    stored one, if any: it is still the job's exact state at its step. False when the answer
    changed nothing (the job was cancelled or requeued meanwhile, or is another worker's); the
    worker's place frees all the same."""
    if _let_go(job_id, worker_id, now=now):
        return False
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    job = held.first()
    if job is None:
        _release_and_dispatch(job_id, worker_id, now=now)
        return False
    stored = _store_checkpoint(job_id, step, checkpoint) if checkpoint is not None else ""
    fields: dict[str, Any] = {"preemptions": F("preemptions") + 1}
    if stored:
        fields |= {"checkpoint": stored, "checkpoint_step": step}
    try:
        back = _send_back(held, **fields)
    except Exception:
        checkpoint_discard(stored, keep=job.checkpoint)
        raise
    if back is None:  # cancelled or requeued since the read: this checkpoint is no one's
        checkpoint_discard(stored, keep=job.checkpoint)
        _release_and_dispatch(job_id, worker_id, now=now)
        return False
    checkpoint_discard(job.checkpoint if stored else "", keep=stored)
    log.info("job %s preempted on %s at step %d of %d: now %s", job_id, worker_id, step, steps, back.value)
    current = dispatcher()
    current.release(job_id, worker_id=worker_id)
    if back == JobState.QUEUED:
        current.push(queued_job(job))
        jobs_dispatch_or_wake(queued=[queued_job(job)], now=now)
    else:
        jobs_dispatch(now=now)
    return True


def _store_checkpoint(job_id: str, step: int, data: bytes) -> str:
    """Store a worker's checkpoint; its storage name, or "" for one over the contract's size (the
    job then resumes from the checkpoint it had, or step 0)."""
    try:
        return checkpoint_save(job_id, step, data)
    except ValueError as exc:
        log.warning("job %s: checkpoint refused: %s", job_id, exc)
        return ""


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


def job_preempt_held(*, worker_id: str, job_id: str, now: datetime) -> None:
    """Another API process paused a job held by this process's worker (`worker.preempt`): a v2
    worker gets `preempt`, a v1 one `cancel` (and the job is paused at once), as for a pause here."""
    try:
        uuid.UUID(job_id)
    except ValueError:
        log.warning("a worker.preempt event names no job: %r", job_id)
        return
    if Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES, pause_requested=True).exists():
        _preempt(dispatcher(), job_id, worker_id, now=now, relayed=True)


def job_left_worker(*, worker_id: str, job_id: str, now: datetime) -> None:
    """Another API process cancelled or requeued a job this process's worker holds: its place frees
    (a v2 worker's once it lets the job go: its job_failed or job_result)."""
    if dispatcher().release(job_id, worker_id=worker_id, until_let_go=True):
        jobs_dispatch(now=now)


def jobs_return(*, job_ids: set[str], now: datetime) -> None:
    """The worker holding these jobs died: each goes back to the queue at its old place once,
    and fails with worker_lost the second time."""
    current = dispatcher()
    requeued: list[QueuedJob] = []
    for job in Job.objects.filter(id__in=job_ids, state__in=HELD_STATES):
        current.release(str(job.id))
        if retry_decision(attempts=job.attempts) == "requeue":
            # back at its old place, from its latest checkpoint; paused instead when a pause was asked
            back = _send_back(Job.objects.filter(id=job.id, state__in=HELD_STATES, attempts=job.attempts),
                              attempts=job.attempts + 1, progress_step=None, progress_steps=None)
            if back == JobState.QUEUED:
                current.push(queued_job(job))
                requeued.append(queued_job(job))
        elif Job.objects.filter(id=job.id, state__in=HELD_STATES).update(
                state=JobState.FAILED, error=WORKER_LOST, finished_at=now, pause_requested=False, checkpoint="",
                checkpoint_step=None):
            checkpoint_discard(job.checkpoint)
    jobs_dispatch_or_wake(queued=requeued, now=now)


# --- workers connecting and leaving (called by workers.lifecycle) ------------------------------

def worker_jobs_connect(*, worker_id: str, channel_name: str, models: list[str], now: datetime,
                        protocol: int = 1, listed: tuple[str, ...] | None = None) -> str | None:
    """Register a worker connection and hand it work; the channel of a connection it replaced.
    A v1 worker keeps every job the API gave it, and jobs cancelled while it was away (this API
    restarted meanwhile) are cancelled on it first. A v2 worker (`listed`: its hello's `jobs`)
    keeps those it lists, the others follow the dead-worker rule at once, and a listed job the API
    does not give it gets `cancel`."""
    rows = list(Job.objects.filter(worker_id=worker_id, state__in=HELD_STATES).values_list(
        "id", "pause_requested", "model_id", "priority", "submitted_us", "account_id", "state"))
    held = {str(row[0]) for row in rows}
    current = dispatcher()
    joined = current.connect(worker_id=worker_id, channel_name=channel_name, models=models, held=held,
                             protocol=protocol, listed=listed)
    current.describe(worker_id, [HeldJob(QueuedJob(str(job_id), model_id, priority, submitted_us, str(account)),
                                         state == JobState.RUNNING)
                                 for job_id, _, model_id, priority, submitted_us, account, state in rows])
    for job_id in sorted(joined.cancel):
        to_socket_after_commit(channel_name, Cancel(job_id).to_wire())
    if joined.lost:
        jobs_return(job_ids=joined.lost, now=now)
    # A pause asked while it held a job: its preempt (or its answer) may have been lost with the
    # connection, so the worker that still holds the job is asked again.
    for job_id in sorted({str(row[0]) for row in rows if row[1]} - joined.lost):
        _preempt(current, job_id, worker_id, now=now)
    orphans_sweep(now=now)
    jobs_dispatch(now=now)
    return joined.replaced


def worker_jobs_drain(*, worker_id: str, channel_name: str) -> bool:
    """A worker said `draining`: it is sent no new job from now on (its held jobs come back as
    job_preempted, which puts them back in the queue at their old places)."""
    return dispatcher().drain(worker_id=worker_id, channel_name=channel_name)


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
