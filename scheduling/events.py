"""Job events for their account's /ws/jobs/ sockets, in every API process: each state change sends
the job as read just after its commit (with its position and estimated wait), each job_progress is
relayed as the worker sent it (a preview too, never stored). The story: docs/protocol.md, "Job events".

Within `batched()` (a submission, a worker's report) the events wait until the end of the call, so
that a worker's next `job` goes out before them, and go together: one read of the rows, one
placement (positions and estimates) for all of them, in the order their changes committed."""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction
from django.db.models import DateTimeField
from django.utils import timezone

from potocolom.protocol.events import JobChanged, JobProgressed
from potocolom.runtime import Slot, runtime
from potocolom.transport import relay
from potocolom.web.socket_limit import socket_seats
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
F = TypeVar("F", bound=Callable[..., Any])


class _Pending(threading.local):
    """This thread's events waiting for the end of a `batched` call (None outside one), and what the
    last flush told of each job as it was announced (`announced`)."""

    def __init__(self) -> None:
        self.changes: list[tuple[list[str], list[tuple[Job, int | None]], datetime | None]] | None = None
        self.announced: dict[str, tuple[int | None, float | None]] = {}


PENDING = Slot("scheduling.events.pending", make=_Pending)  # per thread: a threading.local


def _pending() -> _Pending:
    return runtime.get(PENDING)


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Hold this thread's job events until the block ends (the outermost block, when nested), then
    send them together, in order. An exception in the block still sends those committed before it."""
    pending = _pending()
    if pending.changes is not None:
        yield
        return
    pending.changes = []
    try:
        yield
    finally:
        changes, pending.changes = pending.changes, None
        if changes:
            _flush(changes)


def send_pending() -> None:
    """Send this thread's held events now (before waking another process, whose events about the
    same jobs must come after these)."""
    pending = _pending()
    changes, pending.changes = pending.changes, ([] if pending.changes is not None else None)
    if changes:
        _flush(changes)


def batching(function: F) -> F:
    """A service whose job events go together when it returns (`batched`)."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with batched():
            return function(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def announced(job_id: str) -> tuple[int | None, float | None] | None:
    """The position and estimated wait this thread's last events gave the job as submitted or
    resumed (what the answer to that request says too), or None when they did not announce it."""
    return _pending().announced.get(job_id)


def account_group(account_id: int | str) -> str:
    """The channel-layer group of one account's job sockets, in every API process."""
    return f"potocolom.jobs.account.{account_id}"


def jobs_changed(job_ids: Iterable[str], *, now: datetime | None = None) -> None:
    """These jobs changed state: once the transaction commits, each is read and sent to its account's
    sockets (two changes close together may both read the later state)."""
    ids = sorted({str(job_id) for job_id in job_ids})
    if ids:
        transaction.on_commit(partial(_committed, ids, [], now=now))


def job_changed_as(job: Job, *, now: datetime | None = None) -> None:
    """`job` changed state and the instance says how (a submission): sent as it is after the commit,
    without reading it again, with its position as of the commit."""
    # a copy as it is at the commit: the caller may change the instance before the events go
    transaction.on_commit(lambda: _committed([], [(copy.copy(job), selectors.position_of(job))], now=now))


def _committed(ids: list[str], jobs: list[tuple[Job, int | None]], *, now: datetime | None) -> None:
    """A change committed: its event goes now, or at the end of the thread's batch."""
    changes = _pending().changes
    if changes is not None:
        changes.append((ids, jobs, now))
    else:
        _flush([(ids, jobs, now)])


def job_progressed(*, account_id: int | str, job_id: str, step: int, steps: int, preview: str | None) -> None:
    """A worker's job_progress for the job's account, after the commit; a preview is passed on as
    sent and kept nowhere."""
    event = JobProgressed(str(account_id), job_id, step, steps, preview).to_event()
    transaction.on_commit(partial(relay.group_send_everywhere_sync, account_group(account_id), event))


def _flush(changes: Sequence[tuple[list[str], list[tuple[Job, int | None]], datetime | None]]) -> None:
    """Send the events of these changes, in order: the instances as they are, placed (positions as
    of their commits, estimates) before any lock is taken; the jobs named by id read in one query (a
    job named twice goes once, where it was last named, as read) and sent under the lock that keeps
    this process's reads and sends of a job in one order."""
    now = next((at for _, _, at in reversed(changes) if at is not None), None) or timezone.now()
    listens = _Listeners()
    given = [(job, position) for _, jobs, _ in changes for job, position in jobs if listens(job.account_id)]
    positions = {str(job.id): position for job, position in given if position is not None}
    etas = _estimates([job for job, _ in given], positions, now=now)
    _pending().announced = {str(job.id): (positions.get(str(job.id)), etas.get(str(job.id))) for job, _ in given}
    ids = {job_id for named, _, _ in changes for job_id in named}
    if ids and listens.nobody():
        ids = set()  # with one API process and no job socket open, no row is worth reading
    if not ids:
        _send([job for job, _ in given], positions, etas)
        return
    with runtime.get(READ_AND_SEND):
        try:
            read = {str(job.id): job for job in Job.objects.filter(id__in=ids) if listens(job.account_id)}
        except Exception:  # a notice: the change is in the database, and REST shows it
            log.exception("could not read jobs %s for their events", sorted(ids))
            read = {}
        last = {job_id: n for n, (named, _, _) in enumerate(changes) for job_id in named}
        ordered: list[Job] = []
        for n, (named, jobs, _) in enumerate(changes):
            ordered.extend(job for job, _ in jobs)
            ordered.extend(read[job_id] for job_id in named if job_id in read and last[job_id] == n)
        fresh = list(read.values())
        try:
            placed = selectors.positions_of(fresh)
        except Exception:
            log.exception("could not place jobs for their events")
            placed = {}
        positions.update(placed)
        etas.update(_estimates([job for job in fresh if str(job.id) in placed], placed, now=now))  # rarely any
        _send(ordered, positions, etas)


class _Listeners:
    """Whether an account has a job socket open anywhere, asked once per account: an event for an
    account nobody listens to is neither placed nor sent. Its sockets here say yes at once; with one
    API process (no REDIS_URL) none here is a sure no; else the deployment's socket count (each
    socket takes its place there before it joins its group) says, and a Redis that cannot tell says
    yes."""

    def __init__(self) -> None:
        self.known: dict[str, bool] = {}
        self.none_at_all: bool | None = None

    def nobody(self) -> bool:
        """Surely no account listens: no job socket open in this process, and none in the deployment
        (one API process, or the deployment's count of every account's sockets says none). Asked
        once per call."""
        if self.none_at_all is None:
            self.none_at_all = not relay.has_local_members_in(account_group("")) and (
                not settings.REDIS_URL or not socket_seats().anyone_listens_at_all())
        return self.none_at_all

    def __call__(self, account_id: int | str) -> bool:
        account = str(account_id)
        if self.nobody():
            return False
        if account not in self.known:
            self.known[account] = relay.has_local_members(account_group(account)) or (
                bool(settings.REDIS_URL) and socket_seats().anyone_listens(account))
        return self.known[account]


def _estimates(jobs: list[Job], positions: dict[str, int], *, now: datetime) -> dict[str, float]:
    """The estimated waits of the queued jobs among these (none when they cannot be read: logged)."""
    try:
        return selectors.etas_of(jobs, positions=positions, now=now)
    except Exception:
        log.exception("could not estimate the waits of jobs for their events")
        return {}


def _send(jobs: Sequence[Job], positions: dict[str, int], etas: dict[str, float]) -> None:
    for job in jobs:
        snapshot = snapshot_of(job, position=positions.get(str(job.id)), eta_seconds=etas.get(str(job.id)))
        relay.group_send_everywhere_sync(account_group(job.account_id),
                                         JobChanged(str(job.account_id), snapshot).to_event())


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
