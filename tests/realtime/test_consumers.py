"""The browser socket /ws/session/: close codes, the account limit, positions, placement attempts."""
from __future__ import annotations

import asyncio

import pytest
from channels.db import database_sync_to_async

from tests.realtime.conftest import token_of

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def session_rows() -> list[dict]:
    from realtime.models import RealtimeSession

    return list(RealtimeSession.objects.order_by("joined_at").values("id", "state", "worker_id", "model_id", "params"))


async def states() -> list[str]:
    return [row["state"] for row in await session_rows()]


# --- refusals at the door ------------------------------------------------------------------------

@pytest.mark.parametrize("token", [None, "", "not-a-token", "x" * 500])
async def test_it_closes_a_socket_without_a_valid_token_with_4001(models, sockets, token):
    browser, _ = sockets
    socket = await browser(token=token)

    assert await socket.expect_close() == 4001
    assert await session_rows() == []


async def test_it_takes_a_worker_token_for_no_account(models, sockets, worker_token):
    browser, _ = sockets

    assert await (await browser(token=worker_token)).expect_close() == 4001


async def test_it_takes_the_token_from_the_authorization_header(models, sockets, alice):
    browser, _ = sockets
    token = await database_sync_to_async(token_of)(alice)

    socket = await browser(headers=[(b"authorization", f"Token {token}".encode())])

    assert await socket.expect_state("queued", position=1)
    assert await states() == ["queued"]


@pytest.mark.parametrize("value", [b"Token not-a-token", b"Bearer {token}", b"Token"])
async def test_a_header_that_is_no_account_token_is_closed_with_4001(models, sockets, alice, value):
    browser, _ = sockets
    token = await database_sync_to_async(token_of)(alice)

    socket = await browser(headers=[(b"authorization", value.replace(b"{token}", token.encode()))])

    assert await socket.expect_close() == 4001


@pytest.mark.parametrize("query", [{"model_id": "not-registered"}, {"model_id": "tiny-c"},
                                   {"model_id": None, "tier": "premium"}])
async def test_it_closes_with_4004_when_no_model_fits(models, sockets, alice, query):
    browser, _ = sockets

    assert await (await browser(alice, **query)).expect_close() == 4004
    assert await session_rows() == []


@pytest.mark.parametrize("query", [{"width": "100"}, {"width": "abc"}, {"height": "1024"}, {"steps": "0"},
                                   {"steps": "2.5"}, {"model_id": None, "tier": "huge"}])
async def test_it_closes_with_4000_on_a_bad_query_parameter(models, sockets, alice, query):
    browser, _ = sockets

    assert await (await browser(alice, **query)).expect_close() == 4000


async def test_it_picks_the_cheapest_img2img_model_of_a_tier_and_model_id_wins(models, sockets, alice):
    browser, _ = sockets
    by_tier = await browser(alice, model_id=None, tier="draft")
    await by_tier.expect_state("queued", position=1)
    named = await browser(alice, model_id="tiny-b", tier="standard")
    await named.expect_state("queued", position=2)

    assert [row["model_id"] for row in await session_rows()] == ["tiny-a", "tiny-b"]


async def test_it_sends_the_sessions_size_and_steps_to_the_worker_as_integers(models, sockets, alice):
    browser, worker = sockets
    host = await worker()
    await browser(alice, width="128", height="64", steps="4")

    start = await host.receive()

    assert start["type"] == "session_start" and start["model_id"] == "tiny-a"
    assert start["params"] == {"width": 128, "height": 64, "steps": 4}


# --- the account limit ---------------------------------------------------------------------------

async def test_it_closes_a_third_session_of_an_account_with_4003_queued_ones_counting(models, sockets, alice, bob):
    browser, worker = sockets
    host = await worker(slots=1)
    live = await browser(alice)
    start = await host.receive()
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})
    await live.expect_state("live")
    queued = await browser(alice)
    await queued.expect_state("queued", position=1)

    third = await browser(alice)

    assert await third.expect_close() == 4003
    assert await (await browser(bob)).expect_state("queued", position=2)
    await queued.close()
    again = await browser(alice)
    assert await again.expect_state("queued", position=2)
    assert await states() == ["live", "closed", "queued", "queued"]


async def test_two_connections_racing_for_the_last_place_cannot_both_win(models, sockets, alice, settings):
    settings.ACCOUNT_SESSION_LIMIT = 2
    browser, _ = sockets
    first = await browser(alice)
    await first.expect_state("queued", position=1)
    racers = [await browser(alice, connect=False) for _ in range(3)]

    await asyncio.gather(*(racer.connect() for racer in racers))
    outcomes = [(await racer.communicator.receive_output(5)) for racer in racers]

    assert sorted(o["type"] for o in outcomes) == ["websocket.close", "websocket.close", "websocket.send"]
    assert [o["code"] for o in outcomes if o["type"] == "websocket.close"] == [4003, 4003]
    assert await states() == ["queued", "queued"]


# --- positions and placement ---------------------------------------------------------------------

async def test_it_tells_each_queued_browser_its_position_whenever_it_changes(models, sockets, alice, bob):
    browser, _ = sockets
    first = await browser(alice)
    second = await browser(bob, model_id="tiny-b")
    third = await browser(bob)
    assert [await b.expect_state("queued") for b in (first, second, third)] == [
        {"type": "state", "state": "queued", "position": n} for n in (1, 2, 3)]

    await first.close()

    assert await second.expect_state("queued") == {"type": "state", "state": "queued", "position": 1}
    assert await third.expect_state("queued") == {"type": "state", "state": "queued", "position": 2}
    assert await states() == ["closed", "queued", "queued"]


async def test_it_goes_live_only_after_the_workers_session_accepted(models, sockets, alice):
    browser, worker = sockets
    session = await browser(alice)
    assert await session.expect_state("queued", position=1)
    host = await worker(slots=1)

    start = await host.receive()
    assert start["type"] == "session_start"
    assert await session.silent()
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})

    assert await session.expect_state("live") == {"type": "state", "state": "live", "model_id": "tiny-a",
                                                  "worker_id": "host-a:0"}
    assert await states() == ["live"]


async def test_a_session_whose_model_has_no_room_does_not_hold_up_another(models, sockets, alice, bob):
    browser, worker = sockets
    waiting = await browser(alice, model_id="tiny-b")
    await waiting.expect_state("queued", position=1)
    later = await browser(bob)
    await later.expect_state("queued", position=2)

    host = await worker(models=("tiny-a",), slots=1)

    start = await host.receive()
    rows = await session_rows()
    assert start["session_id"] == str(rows[1]["id"]) and start["model_id"] == "tiny-a"
    assert [row["state"] for row in rows] == ["queued", "placing"]
    assert await waiting.silent()  # still first in the queue: its position did not change


async def test_it_gives_no_slots_to_a_model_over_the_frame_budget(models, sockets, alice, settings):
    settings.FRAME_BUDGET_MS = 100.0
    browser, worker = sockets
    session = await browser(alice)
    await session.expect_state("queued", position=1)

    host = await worker(slots=4, frame_ms=150.0)

    assert await host.silent()
    assert await states() == ["queued"]


async def test_a_refused_session_is_offered_to_another_worker_with_room(models, sockets, alice):
    browser, worker = sockets
    first_host = await worker("host-a:0", slots=1)
    second_host = await worker("host-b:0", slots=1)
    session = await browser(alice)
    offer = await first_host.receive()

    await first_host.send({"type": "session_refused", "session_id": offer["session_id"], "reason": "out of memory"})

    retry = await second_host.receive()
    assert retry == {"type": "session_start", "session_id": offer["session_id"], "model_id": "tiny-a", "params": {}}
    await second_host.send({"type": "session_accepted", "session_id": offer["session_id"]})
    assert await session.expect_state("live", worker_id="host-b:0")


async def test_a_refused_session_waits_at_its_old_place(models, sockets, alice, bob, make_account):
    browser, worker = sockets
    early = await browser(alice)
    await early.expect_state("queued", position=1)
    late = await browser(bob)
    await late.expect_state("queued", position=2)
    host = await worker(slots=1)
    offer = await host.receive()
    assert offer["session_id"] == str((await session_rows())[0]["id"])
    assert await late.expect_state("queued", position=1)

    await host.send({"type": "session_refused", "session_id": offer["session_id"], "reason": "busy"})

    # The freed slot goes to the next session; the refused one waits first in line.
    assert (await host.receive())["session_id"] == str((await session_rows())[1]["id"])
    assert await early.expect_state("queued", position=1)
    carol = await database_sync_to_async(make_account)("carol")
    assert await (await browser(carol)).expect_state("queued", position=2)
    assert await states() == ["queued", "placing", "queued"]


async def test_the_periodic_sweep_offers_a_refused_session_again(models, sockets, alice, settings):
    settings.SESSION_SWEEP_SECONDS = 0.2
    browser, worker = sockets
    host = await worker(slots=1)
    session = await browser(alice)
    offer = await host.receive()
    await host.send({"type": "session_refused", "session_id": offer["session_id"], "reason": "warming up"})
    assert await session.expect_state("queued", position=1)

    again = await host.receive(timeout=5)

    assert again == offer
