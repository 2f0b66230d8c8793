"""Who counts as alive (pure): a worker silent for 3 heartbeat periods is dead, and silence is
counted only while the database could hear it (a PostgreSQL restart is nobody's death).
The story of database restarts: docs/design/shared-admission.md."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def worker_is_dead(*, last_seen: float, now: float, heartbeat_seconds: float) -> bool:
    """A worker that sent nothing for 3 heartbeat periods is dead."""
    return now - last_seen > 3 * heartbeat_seconds


def silent_before(now: datetime, seconds: float, started_at: datetime | None) -> datetime:
    """The cutoff of "silent for `seconds`": what was last seen before it has been silent that long
    while the database could have heard it. While the server has been up for less than `seconds`,
    nothing has (the cutoff is the epoch)."""
    return EPOCH if up_for_less_than(now, seconds, started_at) else now - timedelta(seconds=seconds)


def up_for_less_than(now: datetime, seconds: float, started_at: datetime | None) -> bool:
    """Whether the server started less than `seconds` before `now`."""
    return started_at is not None and started_at > now - timedelta(seconds=seconds)
