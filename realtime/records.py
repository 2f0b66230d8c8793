"""The session rows' writes both admissions share: closing a session, and metering (one UsageRecord
per slot held, its seconds counted when it ends)."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db import transaction

from realtime.models import OPEN_STATES, RealtimeSession, SessionState, UsageRecord

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_microseconds(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def usage_open(*, account_id: int, model_id: str, session_id: str, worker_id: str, now: datetime) -> None:
    UsageRecord.objects.create(account_id=account_id, model_id=model_id, session_id=session_id, worker_id=worker_id,
                               started_at=now)


def usage_close(*, session_id: str, now: datetime) -> None:
    for record in UsageRecord.objects.filter(session__id=session_id, ended_at__isnull=True):
        seconds = max(0.0, (now - record.started_at).total_seconds())
        UsageRecord.objects.filter(pk=record.pk, ended_at__isnull=True).update(ended_at=now, seconds=seconds)


def session_row_close(*, session_id: str, now: datetime) -> None:
    """The session is over: its row closes and its metering stops."""
    with transaction.atomic():
        RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).update(
            state=SessionState.CLOSED, closed_at=now, worker_id=None)
        usage_close(session_id=session_id, now=now)
