"""Handing queued jobs to workers: the claim (compare-and-set), the `job` order in each worker's
protocol, the other processes' wake-ups, the priority preemption and the moves to idle workers.
docs/protocol.md, "The job" (fair share, priority preemption, moving a waiting job)."""
from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils.crypto import salted_hmac

from potocolom import metrics
from potocolom.protocol.events import JobsAvailable, WaitingJob
from potocolom.protocol.worker import MAX_CHECKPOINT_CHARS, PROTOCOL_V2, JobOrder, Preempt, Resume
from potocolom.signals import work_waiting
from potocolom.transport import relay
from potocolom.transport.notify import to_socket_after_commit
from scheduling.checkpoints import checkpoint_read
from scheduling.dispatcher import Dispatcher, dispatcher
from scheduling.events import jobs_changed, send_pending
from scheduling.images import INIT_IMAGE, init_image_text
from scheduling.models import Job, JobState
from scheduling.policy import Assignment, Preemption, QueuedJob
from scheduling.services.job_rows import to_microseconds, webhook_outbox

log = logging.getLogger(__name__)
WORKERS_GROUP = "potocolom.workers"  # every worker socket of every API process, when the queue is shared
ACCOUNT_KEY_SALT = "potocolom.scheduling.worker-account"  # job.account: an HMAC of the account id


@dataclass(frozen=True)
class Claimed:
    """What a dispatch's compare-and-set read back for the job order: its attempt and params, its
    stored checkpoint (storage name, "" without one, and the step it holds) and init_image's
    storage name ("" without one)."""

    attempts: int
    params: Any
    checkpoint: str
    checkpoint_step: int | None
    init_image: str = ""


def _claim(*, job_id: str, worker_id: str, turn_us: int | None, now: datetime) -> Claimed | None:
    """Compare-and-set queued -> dispatched, recording the turn the dispatch gave the job's
    account; what the job order needs of the row, or None when it is no longer queued. One
    statement (UPDATE ... RETURNING, PostgreSQL and SQLite >= 3.35), since the claim sits on the
    submit -> dispatch path."""
    fields = Job._meta
    sql = (f"UPDATE {fields.db_table} SET state = %s, worker_id = %s, dispatched_at = %s, "
           "turn_us = COALESCE(%s, turn_us), progress_step = NULL, progress_steps = NULL "
           "WHERE id = %s AND state = %s RETURNING attempts, params, checkpoint, checkpoint_step, init_image")
    dispatched_at = fields.get_field("dispatched_at").get_db_prep_value(now, connection)
    values = [JobState.DISPATCHED.value, worker_id, dispatched_at, turn_us,
              fields.pk.get_db_prep_value(uuid.UUID(job_id), connection), JobState.QUEUED.value]
    with connection.cursor() as cursor:  # one statement: atomic without a transaction block
        cursor.execute(sql, values)
        row = cursor.fetchone()
    if row is None:
        return None
    params = row[1]  # text from both backends (Django loads jsonb as text), unless a driver decoded it
    return Claimed(row[0], json.loads(params) if isinstance(params, (str, bytes)) else params, row[2] or "", row[3],
                   row[4] or "")


def account_key(account_id: str) -> str:
    """`job.account` for a v2 worker: the same opaque key for every job of one account (so that the
    worker can apply its priority rule within an account), which tells it nothing else about the
    account (an HMAC of its id under SECRET_KEY)."""
    return salted_hmac(ACCOUNT_KEY_SALT, account_id).hexdigest()[:32]


def _job_order(job: QueuedJob, claimed: Claimed, *, protocol: int) -> JobOrder:
    """The `job` message: v1's fields for a v1 worker; a v2 worker also gets the job's priority,
    its account's key and, when it has a stored checkpoint, `resume` (a checkpoint that cannot be
    read, or is over the wire's size, is left out: the job restarts from step 0). The params carry
    the init_image as submitted, read from the storage (OSError when it cannot be)."""
    params = claimed.params
    if claimed.init_image:
        params = {**params, INIT_IMAGE: init_image_text(claimed.init_image)}
    if protocol < PROTOCOL_V2:
        return JobOrder(job.job_id, claimed.attempts, job.model_id, params)
    return JobOrder(job.job_id, claimed.attempts, job.model_id, params, priority=job.priority,
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
    claimed_ids: list[str] = []

    def claim(assignment: Assignment) -> bool:
        job = assignment.job
        claimed = _claim(job_id=job.job_id, worker_id=assignment.worker_id, turn_us=job.turn_us, now=now)
        if claimed is None:
            return False
        claimed_ids.append(job.job_id)
        # from its submission (a job dispatched again after a preemption counts from it too)
        metrics.job_dispatched(wait_seconds=(to_microseconds(now) - job.submitted_us) / 1e6)
        worker = current.connection(assignment.worker_id)  # plan() holds the dispatcher's lock
        if worker is not None:
            orders.append((worker.channel_name, worker.protocol, job, claimed))
        return True

    try:
        assignments = current.plan(claim, at_us=to_microseconds(now))
        _send_moves(current)
        return assignments
    finally:
        # Built once plan() let go of the dispatcher's lock: a resume reads its checkpoint from the
        # storage. Every job claimed is sent, even when the plan stopped half way.
        lost = _send_orders(orders)
        jobs_changed(claimed_ids, now=now)  # dispatched
        for job_id in lost:
            _fail_without_image(job_id, now=now)


def _send_orders(orders: list[tuple[str, int, QueuedJob, Claimed]]) -> list[str]:
    """Send each claimed job its order; the ids of those whose init_image could not be read."""
    lost: list[str] = []
    for channel_name, protocol, job, claimed in orders:
        try:
            order = _job_order(job, claimed, protocol=protocol)
        except OSError:
            log.exception("job %s: its init_image %s could not be read", job.job_id, claimed.init_image)
            lost.append(job.job_id)
            continue
        to_socket_after_commit(channel_name, order.to_wire())
    return lost


def _fail_without_image(job_id: str, *, now: datetime) -> None:
    """A job whose init_image the storage cannot give fails (it would run as another job), and
    its worker's place frees."""
    held = Job.objects.filter(id=job_id, state=JobState.DISPATCHED)
    worker_id = held.values_list("worker_id", flat=True).first()
    if not worker_id:
        return
    with transaction.atomic():
        if held.filter(worker_id=worker_id).update(state=JobState.FAILED, finished_at=now,
                                                   error="its init_image could not be read from the storage"):
            webhook_outbox(job_id, now=now)
    jobs_changed([job_id], now=now)
    if dispatcher().release(job_id, worker_id=worker_id):
        jobs_dispatch(now=now)


def jobs_dispatch_or_wake(*, queued: Collection[QueuedJob], now: datetime) -> list[Assignment]:
    """Dispatch; jobs of `queued` (just queued) that no worker of this process took may make room
    for themselves by the priority preemption (`jobs_make_room`), and with a shared queue those
    still waiting wake the other processes, which try the same with their workers (from the
    dispatch's own answer: no queue lookup on the submit path; a job another thread dispatched
    meanwhile only costs a needless wake-up). The dispatch's assignments."""
    assignments = jobs_dispatch(now=now)
    taken = {assignment.job.job_id for assignment in assignments}
    waiting = jobs_make_room([job for job in queued if job.job_id not in taken], now=now)
    for model_id in sorted({job.model_id for job in waiting}):
        work_waiting.send(sender=QueuedJob, model_id=model_id)  # placement may load it somewhere
    if dispatcher().shared and waiting:
        # every process with a worker looks at the shared queue again (`jobs.available`): the events
        # held so far go first (the `queued` that another process's `dispatched` must follow)
        send_pending()
        relay.group_send_others_sync(WORKERS_GROUP, JobsAvailable(tuple(WaitingJob(*job[:5]) for job in waiting))
                                     .to_event())
    return assignments


def jobs_dispatch_for(*, waiting: Collection[QueuedJob], now: datetime) -> None:
    """Another process queued `waiting` and could not place them (`jobs.available`): dispatch here,
    and make room for those still queued on this process's workers."""
    taken = {assignment.job.job_id for assignment in jobs_dispatch(now=now)}
    jobs_make_room([job for job in waiting if job.job_id not in taken], now=now)


def waiting_of(event: JobsAvailable) -> list[QueuedJob]:
    """The waiting jobs a `jobs.available` event names, as the queue keys them."""
    return [QueuedJob(*job) for job in event.waiting]


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


def _send_moves(current: Dispatcher) -> None:
    """The rebalance: a job held behind another job on a busy worker, while a worker that serves
    its model holds nothing, is asked back (`preempt`: at once, as it has not started) and goes to
    the idle worker when its worker answers (policy.plan_moves)."""
    for move, channel in current.moves():
        log.info("job %s asked back from %s, where it waits behind another job, for %s, which is idle",
                 move.job_id, move.worker_id, move.to_worker_id)
        to_socket_after_commit(channel, Preempt(move.job_id).to_wire())


def _send_preempt(current: Dispatcher, preemption: Preemption) -> bool:
    channel = current.preempting(preemption)
    if channel is None:
        return False
    log.info("job %s preempted on %s to make room for job %s of the same account, with a higher priority",
             preemption.job_id, preemption.worker_id, preemption.for_job_id)
    to_socket_after_commit(channel, Preempt(preemption.job_id).to_wire())
    return True
