"""Operators' pages for sessions and metering."""
from __future__ import annotations

import pytest
from django.utils import timezone

from realtime.models import RealtimeSession, SessionState, UsageRecord

pytestmark = pytest.mark.django_db


@pytest.fixture
def root_client(client, make_account):
    root = make_account("root", staff=True)
    root.is_superuser = True
    root.save()
    client.force_login(root)
    return client


@pytest.mark.parametrize("query", ["", "?view=queue", "?view=live", "?state=queued"])
def test_it_lists_sessions_for_operators(root_client, alice, query):
    now = timezone.now()
    session = RealtimeSession.objects.create(account=alice, model_id="tiny-a", joined_at=now)
    UsageRecord.objects.create(account=alice, model_id="tiny-a", session=session, started_at=now, ended_at=now,
                               seconds=1.5)

    assert root_client.get(f"/admin/realtime/realtimesession/{query}").status_code == 200
    assert root_client.get("/admin/realtime/usagerecord/").status_code == 200


def test_an_operator_ends_a_session_no_socket_holds(root_client, alice):
    session = RealtimeSession.objects.create(account=alice, model_id="tiny-a", joined_at=timezone.now())

    response = root_client.post("/admin/realtime/realtimesession/", {
        "action": "end_sessions", "_selected_action": [str(session.id)]})

    assert response.status_code == 302
    session.refresh_from_db()
    assert session.state == SessionState.CLOSED
