"""A worker's jobs as it connects, drains and leaves (called by fleet.lifecycle): what it holds is
reconciled on its hello, a dead worker's jobs go back to the queue or fail by the retry rule, and
orphans are swept. The story: docs/protocol.md, "Dead workers, reconnects, restarts"."""
from __future__ import annotations

import uuid
from datetime import datetime

from django.conf import settings
from django.db import transaction

from potocolom.protocol.worker import Cancel
from potocolom.transport.notify import to_socket_after_commit
from scheduling.checkpoints import checkpoint_discard
from scheduling.dispatcher import dispatcher
from scheduling.events import jobs_changed
from scheduling.models import HELD_STATES, Job, JobState
from scheduling.policy import HeldJob, QueuedJob, retry_decision
from scheduling.services.dispatch import jobs_dispatch, jobs_dispatch_or_wake
from scheduling.services.job_rows import queued_job, send_back, webhook_outbox
from scheduling.services.requests import job_pause_held
from workers import selectors as worker_rows

WORKER_LOST = "worker_lost"


def jobs_return(*, job_ids: set[str], now: datetime) -> None:
    """The worker holding these jobs died: each goes back to the queue at its old place once,
    and fails with worker_lost the second time."""
    current = dispatcher()
    requeued: list[QueuedJob] = []
    changed: list[str] = []
    for job in Job.objects.filter(id__in=job_ids, state__in=HELD_STATES):
        current.release(str(job.id))
        if retry_decision(attempts=job.attempts) == "requeue":
            # back at its old place, from its latest checkpoint; paused instead when a pause was asked
            back = send_back(Job.objects.filter(id=job.id, state__in=HELD_STATES, attempts=job.attempts), now=now,
                             attempts=job.attempts + 1, progress_step=None, progress_steps=None)
            if back == JobState.QUEUED:
                current.push(queued_job(job))
                requeued.append(queued_job(job))
            if back is not None:
                changed.append(str(job.id))
        elif _fail_lost(job.id, now=now):
            checkpoint_discard(job.checkpoint)
            changed.append(str(job.id))
    jobs_changed(changed, now=now)  # back in the queue (or paused), or failed
    jobs_dispatch_or_wake(queued=requeued, now=now)


def _fail_lost(job_id: uuid.UUID | str, *, now: datetime) -> bool:
    """A job out of retries fails with worker_lost; its webhook's delivery row commits with it."""
    with transaction.atomic():
        failed = Job.objects.filter(id=job_id, state__in=HELD_STATES).update(
            state=JobState.FAILED, error=WORKER_LOST, finished_at=now, pause_requested=False, checkpoint="",
            checkpoint_step=None)
        if failed:
            webhook_outbox(job_id, now=now)
    return bool(failed)


def worker_jobs_connect(*, worker_id: str, channel_name: str, models: list[str], now: datetime,
                        protocol: int = 1, listed: tuple[str, ...] | None = None,
                        rungs: dict[str, str] | None = None) -> str | None:
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
                             protocol=protocol, listed=listed, rungs=rungs)
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
        job_pause_held(job_id=job_id, worker_id=worker_id, now=now)
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


def worker_model_serve(*, worker_id: str, channel_name: str, model_id: str, now: datetime,
                       rung: str | None = None) -> None:
    """The worker loaded `model_id` (placement), on `rung`: its queued jobs may go there, and are
    dispatched now."""
    if dispatcher().serve(worker_id=worker_id, channel_name=channel_name, model_id=model_id, rung=rung):
        jobs_dispatch(now=now)


def worker_model_rung(*, worker_id: str, channel_name: str, model_id: str, rung: str) -> None:
    """The worker runs `model_id` on another rung now (an out-of-memory demotion): no job waiting
    on a faster copy moves there."""
    dispatcher().rung_changed(worker_id=worker_id, channel_name=channel_name, model_id=model_id, rung=rung)


def worker_model_withdraw(*, worker_id: str, channel_name: str, model_id: str) -> bool:
    """Before placement unloads `model_id` there: no new job of it goes to the worker. False when
    the worker holds one (the unload must not be sent)."""
    return dispatcher().withdraw(worker_id=worker_id, channel_name=channel_name, model_id=model_id)
