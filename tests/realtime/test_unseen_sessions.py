"""Session rows reconciled with the sockets that hold them: a close that failed leaves the row open
until nobody has vouched for it for the bound, then the sweep closes it and stops its metering; a
row another process vouches for stays open; a socket whose row was closed without it is closed (4010)."""
from __future__ import annotations

from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.db import OperationalError, connection
from django.utils import timezone

from realtime import services
from realtime.models import RealtimeSession, SessionState, UsageRecord
from realtime.policy import UNSEEN_SWEEPS
from tests.realtime.test_sessions import go_live

pytestmark = pytest.mark.django_db(transaction=True)


def bound(settings) -> timedelta:
    return timedelta(seconds=UNSEEN_SWEEPS * settings.SESSION_SWEEP_SECONDS)


@database_sync_to_async
def row(session_id: str) -> RealtimeSession:
    return RealtimeSession.objects.get(id=session_id)


@database_sync_to_async
def usage_of(session_id: str) -> list[tuple]:
    return list(UsageRecord.objects.filter(session_id=session_id).values_list("started_at", "ended_at", "seconds"))


sweep = database_sync_to_async(services.sessions_sweep)


async def test_a_session_whose_close_failed_stays_open_until_the_sweep_closes_it(models, sockets, alice, settings,
                                                                                  monkeypatch):
    settings.WORKER_HEARTBEAT_SECONDS = 60.0  # the worker counts as alive at the sweeps' moments
    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)
    failures = []

    def close_fails_once(**kwargs):
        failures.append(kwargs["session_id"])
        monkeypatch.undo()  # the next call reaches the database again
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "session_close", close_fails_once)
    await live.close()

    assert failures == [session_id]
    left = await row(session_id)
    assert left.state == SessionState.LIVE and left.seen_at is not None
    assert [ended for _, ended, _ in await usage_of(session_id)] == [None]  # still metering
    await sweep(now=left.seen_at + bound(settings) - timedelta(seconds=1))
    assert (await row(session_id)).state == SessionState.LIVE  # within the bound: not yet taken for gone

    await sweep(now=left.seen_at + bound(settings) + timedelta(seconds=1))

    closed = await row(session_id)
    assert closed.state == SessionState.CLOSED and closed.worker_id is None and closed.orphaned_at is None
    ((started, ended, seconds),) = await usage_of(session_id)
    assert ended == max(left.seen_at, started)  # metering stops when its socket was last vouched for
    assert seconds == pytest.approx((ended - started).total_seconds())
    assert await host.receive() == {"type": "session_end", "session_id": session_id}


async def test_a_failed_close_does_not_hold_the_accounts_place_past_the_bound(models, sockets, alice, settings,
                                                                             monkeypatch):
    settings.ACCOUNT_SESSION_LIMIT = 1
    browser, _ = sockets
    first = await browser(alice)
    await first.expect_state("queued")
    session_id = str((await database_sync_to_async(lambda: RealtimeSession.objects.get())()).id)

    def close_fails(**kwargs):
        raise OperationalError("the database went away")

    monkeypatch.setattr(services, "session_close", close_fails)
    await first.close()
    monkeypatch.undo()
    await database_sync_to_async(RealtimeSession.objects.filter(id=session_id).update)(
        seen_at=timezone.now() - bound(settings) - timedelta(seconds=1))

    again = await browser(alice)  # the join closes the account's unseen row before counting

    await again.expect_state("queued")
    assert (await row(session_id)).state == SessionState.CLOSED


async def test_a_session_another_process_vouches_for_stays_open(models, sockets, alice, bob, settings):
    browser, _ = sockets
    mine = await browser(alice)
    await mine.expect_state("queued")
    now = timezone.now()
    other_process = None
    if connection.vendor == "postgresql" and settings.JOB_QUEUE == "redis":  # the shared admission
        from realtime.admission.presence import Presence

        other_process = Presence()  # another live API process, holding its presence lock
    key = await database_sync_to_async(other_process.ensure)() if other_process else None
    try:
        theirs = await database_sync_to_async(RealtimeSession.objects.create)(
            account=bob, model_id="tiny-a", joined_at=now, channel_name="specific.elsewhere!1", api_process=key,
            seen_at=now)
        for tick in range(1, 2 * UNSEEN_SWEEPS):  # their process vouches for it at each of its ticks
            moment = now + tick * timedelta(seconds=settings.SESSION_SWEEP_SECONDS)
            await database_sync_to_async(services.sessions_vouch)(session_ids=[str(theirs.id)], now=moment)
            await sweep(now=moment + timedelta(seconds=1))
        assert (await row(str(theirs.id))).state == SessionState.QUEUED
        assert await mine.silent()  # and this process's own socket stays open
    finally:
        if other_process is not None:
            await database_sync_to_async(other_process.close)()


async def test_a_socket_whose_row_was_closed_without_it_is_ended_at_the_next_tick(models, sockets, alice):
    from realtime.records import session_row_close

    browser, _ = sockets
    socket = await browser(alice)
    await socket.expect_state("queued")
    session_id = str((await database_sync_to_async(lambda: RealtimeSession.objects.get())()).id)
    await database_sync_to_async(session_row_close)(session_id=session_id, now=timezone.now())

    await sweep(now=timezone.now())

    assert await socket.expect_close() == 4010  # its page joins again
