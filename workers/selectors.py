"""Reads of worker rows, for scheduling and realtime alike: who was seen lately, the channel of a
worker's socket, and the model entries of the workers connected now."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import connection

from potocolom.protocol.entries import InstalledEntry, ModelEntry
from potocolom.protocol.errors import MessageError
from potocolom.runtime import Slot, runtime
from workers.liveness import silent_before, up_for_less_than
from workers.models import PlacementRecord, Worker

T = TypeVar("T")

# When the PostgreSQL server started, per connection of this process (a restart takes them with it).
SERVER_STARTS: Slot[weakref.WeakKeyDictionary[Any, datetime]] = Slot("workers.database_started",
                                                                     make=weakref.WeakKeyDictionary)


def database_started_at() -> datetime | None:
    """When the PostgreSQL server last started (None on other databases). Asked once per
    connection: a server that restarts takes its connections with it."""
    if connection.vendor != "postgresql":
        return None
    connection.ensure_connection()
    raw = connection.connection
    starts = runtime.get(SERVER_STARTS)
    started = starts.get(raw)
    if started is None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_postmaster_start_time()")
            started = cursor.fetchone()[0]
        starts[raw] = started
    return started


def database_up_for_less_than(*, seconds: float, now: datetime) -> bool:
    """Whether the database server started less than `seconds` before `now` (never, off PostgreSQL)."""
    return up_for_less_than(now, seconds, database_started_at())


def silence_cutoff(*, seconds: float, now: datetime) -> datetime:
    """A worker last seen before this has been silent for `seconds` while the database could hear it."""
    return silent_before(now, seconds, database_started_at())


def seen_within(worker_ids: list[str], *, seconds: float, now: datetime) -> set[str]:
    """Those of `worker_ids` some API process saw within `seconds` (while the database could hear)."""
    cutoff = silence_cutoff(seconds=seconds, now=now)
    return set(Worker.objects.filter(worker_id__in=worker_ids, last_seen__gte=cutoff)
               .values_list("worker_id", flat=True))


def silent_ids(*, seconds: float, now: datetime) -> list[str]:
    """The workers no API process has seen for `seconds` (while the database could hear)."""
    cutoff = silence_cutoff(seconds=seconds, now=now)
    return list(Worker.objects.filter(last_seen__lt=cutoff).values_list("worker_id", flat=True))


def model_entries(raw: Any) -> tuple[ModelEntry, ...]:
    """A worker row's served models (written from its hello's entries), typed; an entry that no
    longer parses (a row of an older version) is left out."""
    return tuple(_parsed(ModelEntry.parse, raw))


def installed_entries(raw: Any) -> tuple[InstalledEntry, ...]:
    """A worker row's installed models (a v2 hello's `installed`), typed, likewise."""
    return tuple(_parsed(InstalledEntry.parse, raw))


def _parsed(parse: Callable[[Any], T], raw: Any) -> Iterator[T]:
    for entry in raw if isinstance(raw, list) else ():
        try:
            yield parse(entry)
        except MessageError:
            continue


@dataclass(frozen=True)
class WorkerSocket:
    """A worker some API process holds the socket of: where to reach it, and its hello's entries."""

    worker_id: str
    channel_name: str
    models: tuple[ModelEntry, ...]
    draining: bool = False  # it said `draining`: it gets no new session


def connected_workers(*, seconds: float, now: datetime) -> list[WorkerSocket]:
    """The workers connected to any API process and seen within `seconds`."""
    cutoff = silence_cutoff(seconds=seconds, now=now)
    rows = Worker.objects.filter(connected=True, last_seen__gte=cutoff).exclude(channel_name="").values_list(
        "worker_id", "channel_name", "served_models", "draining")
    return [WorkerSocket(worker_id, channel, model_entries(served), draining)
            for worker_id, channel, served, draining in rows]


def connected_count(*, seconds: float, now: datetime) -> int:
    """How many workers are connected to any API process and were seen within `seconds` (one count)."""
    cutoff = silence_cutoff(seconds=seconds, now=now)
    return Worker.objects.filter(connected=True, last_seen__gte=cutoff).exclude(channel_name="").count()


def channel_of(worker_id: str | None) -> str | None:
    """The channel of the worker's socket, on whichever API process holds it."""
    if not worker_id:
        return None
    return Worker.objects.filter(worker_id=worker_id).exclude(channel_name="") \
        .values_list("channel_name", flat=True).first()


def workers_by_id(worker_ids: list[str]) -> list[Worker]:
    return list(Worker.objects.filter(worker_id__in=worker_ids))


SHOWN_RECORDS = timedelta(hours=1)  # what the queues page lists of placement's actions
MAX_SHOWN_RECORDS = 500


def placement_log(*, now: datetime) -> list[dict[str, Any]]:
    """The placement actions of the last hour, newest first, with reason, outcome and duration."""
    rows = PlacementRecord.objects.filter(sent_at__gte=now - SHOWN_RECORDS)[:MAX_SHOWN_RECORDS]
    return [{"at": r.sent_at.isoformat(), "worker_id": r.worker_id, "model_id": r.model_id, "action": r.action,
             "rung": r.rung or None, "reason": r.reason, "outcome": r.outcome or "waiting",
             "error": r.error or None,
             "duration_seconds": None if r.duration_seconds is None else round(r.duration_seconds, 3)}
            for r in rows]
