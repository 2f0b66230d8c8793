"""Webhook decisions without I/O: which due deliveries start (each account at most WEBHOOK_CONCURRENCY
in flight, accounts taking turns), when one is tried again (1, 2, 4 ... s), and whether a name lookup
may start. The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal
from uuid import UUID


def retry_delay_seconds(attempts_made: int) -> float:
    """Seconds from the failed attempt number `attempts_made` (1-based) to the next one."""
    if attempts_made < 1:
        raise ValueError("attempts_made counts from 1")
    return float(2 ** (attempts_made - 1))


def delivered(status_code: int | None) -> bool:
    """A 2xx answer delivers; anything else (another status, no answer) is a failed attempt."""
    return status_code is not None and 200 <= status_code <= 299


@dataclass(frozen=True)
class Decision:
    state: Literal["pending", "delivered", "failed"]
    due_at: datetime | None  # the next attempt's time while pending


def after_attempt(*, status_code: int | None, attempts_made: int, max_attempts: int, now: datetime) -> Decision:
    """What becomes of a delivery once its attempt number `attempts_made`, made at `now`, answered
    `status_code` (None: no answer)."""
    if delivered(status_code):
        return Decision("delivered", None)
    if attempts_made >= max_attempts:
        return Decision("failed", None)
    return Decision("pending", now + timedelta(seconds=retry_delay_seconds(attempts_made)))


@dataclass(frozen=True)
class DueDelivery:
    """A delivery due now, as the runner reads it: which row, whose, and its due_at (the claim's
    compare-and-set value)."""

    id: UUID
    account_id: int
    due_at: datetime


def deliveries_to_start(due: Sequence[DueDelivery], *, in_flight: Mapping[int, int], per_account: int,
                        free: int) -> list[DueDelivery]:
    """Which of `due` to start now: no account past `per_account` in flight, at most `free` in all,
    and accounts taking turns (every account's earliest before any account's second), each account's
    own deliveries in due order."""
    taken: Counter[int] = Counter()
    turns: list[tuple[int, datetime, int, DueDelivery]] = []
    for index, delivery in enumerate(sorted(due, key=lambda d: d.due_at)):
        turn = in_flight.get(delivery.account_id, 0) + taken[delivery.account_id]
        if turn < per_account:
            taken[delivery.account_id] += 1
            turns.append((turn, delivery.due_at, index, delivery))
    return [delivery for *_, delivery in sorted(turns, key=lambda t: t[:3])[:max(free, 0)]]


Admission = Literal["start", "throttled", "busy"]


def lookup_admission(*, of_account: int, in_all: int, per_account: int, most: int) -> Admission:
    """Whether one more name lookup may start, given those under way (their threads alive) of its
    account and in all: past the account's own cap it is throttled (429), which comes first; past
    the process's bound on lookup threads it is busy (503, not the submitter's doing)."""
    if of_account >= per_account:
        return "throttled"
    if in_all >= most:
        return "busy"
    return "start"
