"""The session rows' writes both admissions share: closing a session (a socket's own close, or the
sweep's of a row whose socket is gone), vouching for open sockets, metering (one UsageRecord per
slot held, its seconds counted when it ends), and retention (closed sessions deleted, their usage
kept as a tally)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from django.db import transaction
from django.db.models import F, QuerySet

from realtime.models import OPEN_STATES, RealtimeSession, SessionState, UsageRecord, UsageTally

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_microseconds(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def usage_open(*, account_id: int, model_id: str, session_id: str, worker_id: str, now: datetime) -> None:
    UsageRecord.objects.create(account_id=account_id, model_id=model_id, session_id=session_id, worker_id=worker_id,
                               started_at=now)


def usage_close(*, session_id: str, now: datetime) -> None:
    """Metering of the session stops at `now` (never before a record's start)."""
    for record in UsageRecord.objects.filter(session__id=session_id, ended_at__isnull=True):
        ended = max(now, record.started_at)
        UsageRecord.objects.filter(pk=record.pk, ended_at__isnull=True).update(
            ended_at=ended, seconds=(ended - record.started_at).total_seconds())


def session_row_close(*, session_id: str, now: datetime) -> None:
    """The session is over: its row closes and its metering stops."""
    with transaction.atomic():
        RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).update(
            state=SessionState.CLOSED, closed_at=now, worker_id=None)
        usage_close(session_id=session_id, now=now)


def sessions_vouch(*, session_ids: Collection[str], now: datetime) -> list[str]:
    """This process holds these sessions' browser sockets: their open rows are seen now. The ids
    among them whose rows are no longer open (closed without their socket's say-so)."""
    if not session_ids:
        return []
    seen = RealtimeSession.objects.filter(id__in=session_ids, state__in=OPEN_STATES).update(seen_at=now)
    if seen == len(session_ids):
        return []
    still_open = {str(sid) for sid in RealtimeSession.objects.filter(id__in=session_ids, state__in=OPEN_STATES)
                  .values_list("id", flat=True)}
    return [sid for sid in session_ids if sid not in still_open]


class Unseen(NamedTuple):
    """An open row whose socket is gone, as it was when the sweep closed it."""

    session_id: str
    state: str
    worker_id: str | None
    joined_at: datetime


def sessions_unseen_close(sessions: QuerySet[RealtimeSession], *, seen_before: datetime,
                          now: datetime) -> list[Unseen]:
    """Close the open rows of `sessions` whose socket's process last vouched for them before
    `seen_before` (their socket is gone: its close failed); each by compare-and-set on its `seen_at`,
    so a row vouched for meanwhile stays open. Metering stops when it was last seen. A null
    `seen_at` (a row of a version that did not vouch) is left alone."""
    closed: list[Unseen] = []
    for session_id, state, worker_id, joined_at, seen_at in sessions.filter(
            state__in=OPEN_STATES, seen_at__lt=seen_before).values_list(
            "id", "state", "worker_id", "joined_at", "seen_at"):
        with transaction.atomic():
            if RealtimeSession.objects.filter(id=session_id, state=state, seen_at=seen_at).update(
                    state=SessionState.CLOSED, closed_at=now, worker_id=None) != 1:
                continue
            usage_close(session_id=str(session_id), now=seen_at or now)  # (the filter left no null)
        closed.append(Unseen(str(session_id), state, worker_id, joined_at))
    return closed


SESSIONS_PURGE_BATCH = 500  # sessions per transaction


def sessions_purge(*, cutoff: datetime | None, batch: int = SESSIONS_PURGE_BATCH) -> int:
    """Delete the sessions closed before `cutoff` (None: none), oldest first, a batch per
    transaction, with their usage records; each record's seconds go into its account's tally for its
    model first (UsageTally), so the account's usage totals stay what they were. Rows another purge
    holds are skipped (it deletes them). How many sessions went."""
    total = 0
    while cutoff is not None:
        with transaction.atomic():
            ids = list(RealtimeSession.objects.select_for_update(skip_locked=True)
                       .filter(state=SessionState.CLOSED, closed_at__lt=cutoff).order_by("closed_at", "id")
                       .values_list("id", flat=True)[:batch])
            if not ids:
                break
            seconds: dict[tuple[int, str], float] = defaultdict(float)
            records = UsageRecord.objects.filter(session_id__in=ids)
            for account_id, model_id, ended_at, counted in records.values_list(
                    "account_id", "model_id", "ended_at", "seconds"):
                # a closed session's records have ended (its close ends them in the same transaction)
                seconds[(account_id, model_id)] += counted if ended_at is not None else 0.0
            for (account_id, model_id), value in sorted(seconds.items()):
                tally, _ = UsageTally.objects.get_or_create(account_id=account_id, model_id=model_id)
                UsageTally.objects.filter(pk=tally.pk).update(seconds=F("seconds") + value)
            records.delete()
            RealtimeSession.objects.filter(id__in=ids).delete()
        total += len(ids)
        if len(ids) < batch:
            break
    return total
