"""Browser sockets when the channel layer fails (bench/soak.md, a Redis restart): a socket whose feed
fails still closes its session (the row, the worker's slot, the account's place); a Redis outage
leaves live sessions live; and a worker's repeated session_accepted (a session_start sent again)
leaves the session live on it instead of ending it behind its browser's back."""
from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from channels.db import database_sync_to_async
from django.utils import timezone

from realtime.models import RealtimeSession, SessionState
from tests.helpers import eventually
from tests.realtime.test_sessions import PNG_B64, frame, go_live, result
from tests.support.layer_faults import install_layer_fault

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def layer_fault(monkeypatch):
    return install_layer_fault(monkeypatch)


@database_sync_to_async
def session_row(session_id: str) -> RealtimeSession:
    return RealtimeSession.objects.get(id=session_id)


async def test_a_browser_socket_whose_layer_feed_fails_closes_its_session_and_frees_the_slot(
        models, sockets, alice, settings, layer_fault):
    settings.ACCOUNT_SESSION_LIMIT = 1
    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)
    channel = (await session_row(session_id)).channel_name

    layer_fault.break_(RuntimeError("the channel layer broke"), channels=[channel])

    with pytest.raises(RuntimeError):  # the server closes the socket with 1011
        await live.receive(timeout=3)
    live.disconnected = True
    closed = await session_row(session_id)
    assert closed.state == SessionState.CLOSED and closed.worker_id is None
    assert await host.receive() == {"type": "session_end", "session_id": session_id}
    again = await browser(alice)  # the account's one place is free again, and so is the slot
    start = await host.receive()
    assert start["type"] == "session_start" and start["session_id"] != session_id
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})
    await again.expect_state("live")


async def test_a_redis_outage_leaves_a_live_session_live_and_its_frames_flowing(models, sockets, alice, layer_fault):
    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)

    layer_fault.break_(redis.ConnectionError("Connection closed by server."))  # every socket's feed
    await eventually(lambda: _raised(layer_fault, 4))
    layer_fault.mend()

    await live.send(frame(1))
    assert (await host.receive())["seq"] == 1
    await host.send(result(session_id, 1))
    assert (await live.expect("frame"))["seq"] == 1
    assert (await session_row(session_id)).state == SessionState.LIVE


async def _raised(fault, count: int) -> bool:
    return len(fault.raised) >= count


async def test_a_repeated_session_accepted_keeps_the_session_live_with_frames(models, sockets, alice):
    """The worker answers a session_start sent again (the session was placed, sent back by a newer
    connection's hello and placed there again) with session_accepted again: no session_end follows."""
    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)

    await host.send({"type": "session_accepted", "session_id": session_id})

    assert await host.silent(0.3), "a repeated accept ends nothing"
    await live.send(frame(1))
    relayed = await host.receive()
    assert relayed["type"] == "frame" and relayed["seq"] == 1 and relayed["image"] == PNG_B64
    await host.send(result(session_id, 1))
    assert (await live.expect("frame"))["seq"] == 1
    assert (await session_row(session_id)).state == SessionState.LIVE


def test_the_shared_admission_takes_a_repeated_accept_of_a_live_session_as_live(alice, models, monkeypatch):
    """As in the soak: session_start went to a worker's new connection, its hello sent the session
    back and placed it there again, so the worker got session_start twice and accepted twice. The
    first accept made it live; the second must not end it on the worker."""
    from realtime.admission import shared

    ended = []
    monkeypatch.setattr(shared, "to_socket_after_commit", lambda channel, message, **_: ended.append(message))
    monkeypatch.setattr(shared, "notify_after_commit", lambda channel, event: None)
    now = timezone.now()
    session = RealtimeSession.objects.create(account=alice, model_id="tiny-a", params={}, joined_at=now,
                                             channel_name="browser", state=SessionState.PLACING,
                                             worker_id="host-a:0", placements=2, seen_at=now)
    admission = shared.SharedAdmission()

    first = admission.accept(worker_id="host-a:0", session_id=str(session.id), channel_name="w2",
                             now=now)
    again = admission.accept(worker_id="host-a:0", session_id=str(session.id), channel_name="w2",
                             now=now + timedelta(milliseconds=36))

    assert (first, again) == (True, True) and ended == []
    row = RealtimeSession.objects.get(id=session.id)
    assert row.state == SessionState.LIVE and row.live_since == now
    stale = admission.accept(worker_id="host-b:0", session_id=str(session.id), channel_name="w3", now=now)
    assert stale is False and ended == [{"type": "session_end", "session_id": str(session.id)}]
