"""When a webhook delivery is tried again, decided without I/O: after the n-th failed attempt the
next is due 2**(n-1) seconds later (1, 2, 4 ... s), up to WEBHOOK_ATTEMPTS attempts; a 2xx ends it.
The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal


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
