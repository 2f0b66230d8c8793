"""What a database restart means for "silent since": nothing could be heard while it was down.

Several API processes decide who is dead from the database: a worker by `Worker.last_seen`
(written every heartbeat period by the process holding its socket), an API process by the
advisory lock it holds on a connection of its own. A PostgreSQL restart breaks both at once for
everybody: no `last_seen` can be written while it is down, and every lock goes with the old
server. So silence is counted from the later of the last sign of life and the server's start.
"""
from __future__ import annotations

import weakref
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_started: weakref.WeakKeyDictionary[Any, datetime] = weakref.WeakKeyDictionary()


def silent_before(now: datetime, seconds: float, started_at: datetime | None) -> datetime:
    """The cutoff of "silent for `seconds`": what was last seen before it has been silent that long
    while the database could have heard it. While the server has been up for less than `seconds`,
    nothing has (the cutoff is the epoch)."""
    return EPOCH if up_for_less_than(now, seconds, started_at) else now - timedelta(seconds=seconds)


def up_for_less_than(now: datetime, seconds: float, started_at: datetime | None) -> bool:
    """Whether the server started less than `seconds` before `now`."""
    return started_at is not None and started_at > now - timedelta(seconds=seconds)


def server_started_at() -> datetime | None:
    """When the PostgreSQL server last started (None on other databases). Asked once per
    connection: a server that restarts takes its connections with it."""
    if connection.vendor != "postgresql":
        return None
    connection.ensure_connection()
    raw = connection.connection
    started = _started.get(raw)
    if started is None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_postmaster_start_time()")
            started = cursor.fetchone()[0]
        _started[raw] = started
    return started


def silence_cutoff(now: datetime, seconds: float) -> datetime:
    """`silent_before` for this database."""
    return silent_before(now, seconds, server_started_at())
