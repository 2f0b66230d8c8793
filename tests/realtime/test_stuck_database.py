"""A stuck database (on PostgreSQL: a row another connection holds locked) stops the admission that
waits for it, and only that: live sessions keep relaying frames, since neither the frame path nor
the board's lock ever waits on the database."""
from __future__ import annotations

import asyncio
import base64

import pytest
from channels.db import database_sync_to_async
from django.db import connection

from tests.helpers import eventually, tiny_png

pytestmark = pytest.mark.django_db(transaction=True)
PNG = "data:image/png;base64," + base64.b64encode(tiny_png(2, 2)).decode()


@database_sync_to_async
def queued_session_id() -> str:
    from realtime.models import RealtimeSession

    return str(RealtimeSession.objects.get(state="queued").id)


def another_client(params: dict, **options):
    import psycopg

    return psycopg.connect(dbname=params["NAME"], user=params.get("USER") or None,
                           password=params.get("PASSWORD") or None, host=params.get("HOST") or None,
                           port=params.get("PORT") or None, **options)


@database_sync_to_async
def lock_row(session_id: str):
    """Another client of the database holds the session's row locked (SELECT ... FOR UPDATE)."""
    params = dict(connection.settings_dict)
    other = another_client(params)
    other.execute("SELECT id FROM realtime_realtimesession WHERE id = %s FOR UPDATE", [session_id])
    return other, params


def someone_waits_on_a_lock(params: dict) -> bool:
    with another_client(params, autocommit=True) as probe:
        row = probe.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                            "AND wait_event_type = 'Lock'").fetchone()
        return bool(row and row[0])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks of another connection: PostgreSQL")
async def test_live_sessions_relay_frames_while_an_admission_waits_on_a_locked_row(models, sockets, alice, bob):
    browser, worker = sockets
    host = await worker("host-a:0", slots=1)
    live = await browser(alice)
    start = await host.receive()
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})
    await live.expect_state("live")
    waiting = await browser(bob)
    await waiting.expect_state("queued", position=1)
    other, params = await lock_row(await queued_session_id())
    try:
        # A second worker's hello runs admission, whose claim of bob's row waits on the lock.
        second = asyncio.create_task(worker("host-b:0", slots=1))
        await eventually(lambda: asyncio.to_thread(someone_waits_on_a_lock, params))
        for seq in range(1, 4):
            await live.send({"type": "frame", "seq": seq, "image": PNG, "params": {"prompt": "on"}})
            assert (await host.receive())["seq"] == seq
            await host.send({"type": "frame_result", "session_id": start["session_id"], "seq": seq,
                             "image": base64.b64encode(tiny_png(2, 2)).decode(), "gpu_ms": 1.0, "batch_size": 1})
            assert (await live.expect("frame"))["seq"] == seq
    finally:
        await asyncio.to_thread(other.close)  # the lock goes with its connection
    late = await second
    assert (await late.receive(timeout=10))["type"] == "session_start"
