"""Retention of drawing sessions (realtime/records.py sessions_purge, through `manage.py purge_jobs`
and fleet.retention): sessions closed longer ago than the jobs' retention go with their usage
records, while the account's usage totals stay what they were; recent and open sessions stay."""
from __future__ import annotations

import io
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from realtime.models import RealtimeSession, SessionState, UsageRecord
from realtime.records import session_row_close, usage_open
from tests.helpers import api_client

pytestmark = pytest.mark.django_db(transaction=True)


def metered_session(account, *, model_id: str, seconds: float, closed_ago: timedelta | None) -> str:
    """A session that held a slot for `seconds`, closed `closed_ago` (None: still live)."""
    started = timezone.now() - (closed_ago or timedelta(0)) - timedelta(seconds=seconds)
    session = RealtimeSession.objects.create(account=account, model_id=model_id, state=SessionState.LIVE,
                                             joined_at=started, worker_id="host-a:0", live_since=started)
    usage_open(account_id=account.pk, model_id=model_id, session_id=str(session.id), worker_id="host-a:0",
               now=started)
    if closed_ago is not None:
        session_row_close(session_id=str(session.id), now=started + timedelta(seconds=seconds))
    return str(session.id)


def usage(account) -> dict:
    response = api_client(account).get("/api/v1/usage/")
    assert response.status_code == 200
    return response.json()


def purge(*args: str) -> str:
    out = io.StringIO()
    call_command("purge_jobs", *args, stdout=out)
    return out.getvalue().strip()


def test_sessions_closed_long_ago_go_with_their_records_and_the_usage_totals_stay(alice, bob):
    old = [metered_session(alice, model_id="tiny-a", seconds=30.0, closed_ago=timedelta(days=40)),
           metered_session(alice, model_id="tiny-b", seconds=12.5, closed_ago=timedelta(days=35)),
           metered_session(bob, model_id="tiny-a", seconds=7.0, closed_ago=timedelta(days=50))]
    recent = metered_session(alice, model_id="tiny-a", seconds=5.0, closed_ago=timedelta(days=2))
    live = metered_session(alice, model_id="tiny-a", seconds=1.0, closed_ago=None)
    before = {"alice": usage(alice), "bob": usage(bob)}
    assert before["alice"]["models"][1] == {"model_id": "tiny-b", "seconds": 12.5}

    said = purge("--older-than", "30", "--batch", "2")  # two batches

    assert "and 3 sessions closed before then" in said
    assert sorted(str(i) for i in RealtimeSession.objects.values_list("id", flat=True)) == sorted([recent, live])
    assert not UsageRecord.objects.filter(session_id__in=[uuid.UUID(i) for i in old]).exists()
    after = {"alice": usage(alice), "bob": usage(bob)}
    assert after["bob"] == before["bob"] == {"total_seconds": 7.0, "models": [{"model_id": "tiny-a", "seconds": 7.0}]}
    assert after["alice"]["models"][1] == before["alice"]["models"][1]
    assert after["alice"]["models"][0]["seconds"] >= before["alice"]["models"][0]["seconds"]  # the live one counts on
    assert after["alice"]["models"][0]["seconds"] - before["alice"]["models"][0]["seconds"] < 5.0

    assert "and 0 sessions closed" in purge("--older-than", "30")  # idempotent
    assert usage(bob) == before["bob"]


def test_sessions_stay_without_retention(alice, settings):
    settings.JOB_RETENTION_DAYS = 0
    metered_session(alice, model_id="tiny-a", seconds=3.0, closed_ago=timedelta(days=4000))
    from fleet.retention import retention_run

    assert retention_run(now=timezone.now()).sessions == 0
    assert RealtimeSession.objects.count() == 1
