"""Job events for their account's /ws/jobs/ sockets, in every API process: each state change sends
the job as read just after its commit (with its position and estimated wait), each job_progress is
relayed as the worker sent it (a preview too, never stored). The story: docs/protocol.md, "Job events"."""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import DateTimeField
from django.utils import timezone

from potocolom.protocol.events import JobChanged, JobProgressed
from potocolom.runtime import Slot, runtime
from potocolom.transport import relay
from scheduling import selectors
from scheduling.models import Job

log = logging.getLogger(__name__)
# A job's row as an event carries it: every column but params (which may hold an init image); the
# params as shown, without it.
_FIELDS = tuple(f.attname for f in Job._meta.concrete_fields)  # params hold no image: they go whole
_DATETIMES = frozenset(f.attname for f in Job._meta.concrete_fields if isinstance(f, DateTimeField))
# Changes are read after their commits, in whichever threads committed them: the read and the send
# go under one lock so that this process sends a job's states in the order it read them (the
# dispatch's "dispatched" never after the worker's "running" that a faster thread read later).
READ_AND_SEND = Slot("scheduling.events.read_and_send", make=threading.Lock)


def account_group(account_id: int | str) -> str:
    """The channel-layer group of one account's job sockets, in every API process."""
    return f"potocolom.jobs.account.{account_id}"


def jobs_changed(job_ids: Iterable[str], *, now: datetime | None = None) -> None:
    """These jobs changed state: once the transaction commits, each is read and sent to its account's
    sockets (two changes close together may both read the later state)."""
    ids = sorted({str(job_id) for job_id in job_ids})
    if ids:
        transaction.on_commit(partial(_publish_read, ids, now=now))


def job_changed_as(job: Job, *, now: datetime | None = None) -> None:
    """`job` changed state and the instance says how (a submission): sent as it is after the commit,
    without reading it again."""
    transaction.on_commit(partial(_publish, [job], now=now))


def job_progressed(*, account_id: int | str, job_id: str, step: int, steps: int, preview: str | None) -> None:
    """A worker's job_progress for the job's account, after the commit; a preview is passed on as
    sent and kept nowhere."""
    event = JobProgressed(str(account_id), job_id, step, steps, preview).to_event()
    transaction.on_commit(partial(relay.group_send_everywhere_sync, account_group(account_id), event))


def _publish_read(ids: list[str], *, now: datetime | None) -> None:
    with runtime.get(READ_AND_SEND):
        _read_and_publish(ids, now=now)


def _read_and_publish(ids: list[str], *, now: datetime | None) -> None:
    try:
        jobs = list(Job.objects.filter(id__in=ids))
    except Exception:  # a notice: the change is in the database, and REST shows it
        log.exception("could not read jobs %s for their events", ids)
        return
    _publish(jobs, now=now)


def _publish(jobs: Sequence[Job], *, now: datetime | None) -> None:
    try:
        positions = selectors.positions_of(jobs)
        etas = selectors.etas_of(jobs, positions=positions, now=now or timezone.now())
    except Exception:
        log.exception("could not place jobs for their events")
        positions, etas = {}, {}
    for job in jobs:
        snapshot = snapshot_of(job, position=positions.get(str(job.id)), eta_seconds=etas.get(str(job.id)))
        relay.group_send_everywhere_sync(account_group(job.account_id), JobChanged(str(job.account_id), snapshot)
                                         .to_event())


def snapshot_of(job: Job, *, position: int | None, eta_seconds: float | None) -> dict[str, Any]:
    """A job as JSON-ready plain data, for a consumer to render as REST does (job_of_snapshot)."""
    fields: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(job, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, uuid.UUID):
            value = str(value)
        fields[name] = value
    return {"fields": fields, "position": position, "eta_seconds": eta_seconds}


def job_of_snapshot(snapshot: dict[str, Any]) -> tuple[Job, int | None, float | None]:
    """The job, its position and its estimated wait, from snapshot_of's data."""
    fields = {name: (datetime.fromisoformat(value) if name in _DATETIMES and isinstance(value, str) else value)
              for name, value in snapshot["fields"].items() if name in _FIELDS}
    job = Job(**fields)
    return job, snapshot.get("position"), snapshot.get("eta_seconds")
