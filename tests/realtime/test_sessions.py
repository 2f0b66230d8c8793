"""Live sessions: frames both ways, idle release, worker death, demotion, metering, operators."""
from __future__ import annotations

import base64
import json
import time
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from realtime.models import RealtimeSession
from tests.helpers import api_client, eventually, tiny_png

pytestmark = pytest.mark.django_db(transaction=True)

PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()
RESULT_B64 = base64.b64encode(tiny_png(2, 2, shade=20)).decode()


def frame(seq: int, prompt: str = "a red square") -> dict:
    return {"type": "frame", "seq": seq, "image": f"data:image/png;base64,{PNG_B64}", "params": {"prompt": prompt}}


async def go_live(browser, worker, account, **query):
    """A browser whose session is live on `worker`, and its session_id."""
    session = await browser(account, **query)
    start = await worker.receive()
    assert start["type"] == "session_start", start
    await worker.send({"type": "session_accepted", "session_id": start["session_id"]})
    await session.expect_state("live")
    return session, start["session_id"]


@database_sync_to_async
def session_states() -> list[tuple[str, str | None]]:
    from realtime.models import RealtimeSession

    return list(RealtimeSession.objects.order_by("joined_at").values_list("state", "worker_id"))


@database_sync_to_async
def usage_rows() -> list[dict]:
    from realtime.models import UsageRecord

    return list(UsageRecord.objects.order_by("started_at").values("model_id", "ended_at", "seconds", "worker_id"))


@database_sync_to_async
def get(account, path: str):
    return api_client(account).get(path)


# --- frames --------------------------------------------------------------------------------------

async def test_it_relays_frames_both_ways_and_drops_results_older_than_one_shown(models, sockets, alice, settings):
    settings.FRAME_BUDGET_MS = 50.0  # frame 1 unanswered holds frame 2 back for 0.1 s
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)

    await session.send(frame(1, "a green field"))
    await session.send(frame(2))
    relayed = [await host.receive(), await host.receive()]
    assert relayed[0] == {"type": "frame", "session_id": session_id, "seq": 1, "image": PNG_B64,
                          "params": {"prompt": "a green field"}}
    assert relayed[1]["seq"] == 2
    await host.send(result(session_id, 2))
    await host.send(result(session_id, 1))

    shown = await session.expect("frame")
    assert shown["seq"] == 2 and shown["image"] == f"data:image/png;base64,{RESULT_B64}"
    assert isinstance(shown["ms"], float) and shown["ms"] >= 0
    assert await session.silent()  # seq 1 came back late: dropped, never shown


def result(session_id: str, seq: int) -> dict:
    return {"type": "frame_result", "session_id": session_id, "seq": seq, "image": RESULT_B64, "gpu_ms": 5.0,
            "batch_size": 1}


# --- backpressure: one frame in flight per live session ------------------------------------------

async def test_one_frame_is_in_flight_and_the_newest_goes_after_its_result(models, sockets, alice, settings):
    settings.FRAME_BUDGET_MS = 30_000.0  # no timeout within the test: only the result lets the next go
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)

    for seq in (1, 2, 3, 4):
        await session.send(frame(seq, f"prompt {seq}"))
    assert (await host.receive())["seq"] == 1
    assert await host.silent()  # 2, 3 and 4 wait: only the newest of them is kept

    await host.send(result(session_id, 1))
    assert (await session.expect("frame"))["seq"] == 1
    newest = await host.receive()
    assert (newest["seq"], newest["params"]) == (4, {"prompt": "prompt 4"})
    assert await host.silent()
    await host.send(result(session_id, 4))
    assert (await session.expect("frame"))["seq"] == 4
    await session.send(frame(5))
    assert (await host.receive())["seq"] == 5  # nothing in flight: it goes at once


async def test_an_unanswered_frame_holds_the_next_back_for_twice_the_frame_budget(models, sockets, alice, settings):
    settings.FRAME_BUDGET_MS = 150.0
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)
    await session.send(frame(1))
    assert (await host.receive())["seq"] == 1
    sent = time.monotonic()

    await session.send(frame(2))
    await session.send(frame(3))

    due = await host.receive(timeout=5)
    assert due["seq"] == 3
    assert time.monotonic() - sent >= 2 * settings.FRAME_BUDGET_MS / 1000 - 0.01
    assert await host.silent()


async def test_a_frame_kept_while_live_is_not_sent_after_the_slot_is_lost(models, sockets, alice, settings):
    settings.FRAME_BUDGET_MS = 30_000.0
    browser, worker = sockets
    host = await worker(slots=1)
    session, session_id = await go_live(browser, host, alice)
    await session.send(frame(1))
    assert (await host.receive())["seq"] == 1
    await session.send(frame(2))  # kept: 1 is in flight

    await host.close()
    assert await session.expect_state("queued", position=1)
    replacement = await worker("host-b:0", slots=1)
    start = await replacement.receive()
    await replacement.send({"type": "session_accepted", "session_id": start["session_id"]})
    await session.expect_state("live", worker_id="host-b:0")

    assert (await replacement.receive())["seq"] == 2  # the new worker gets the newest at once


# --- images are checked from their header --------------------------------------------------------

GIF_B64 = base64.b64encode(b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff!\xf9\x04\x00"
                           b"\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;").decode()


@pytest.mark.parametrize(("image", "reason"), [
    (f"data:image/png;base64,{GIF_B64}", "PNG, JPEG or WebP"),
    ("data:image/png;base64,AAAA", "PNG, JPEG or WebP"),
    ("data:image/png;base64,****", "base64"),
    ("data:image/gif;base64," + GIF_B64, "data:image/png"),
    (f"data:image/png;base64,{base64.b64encode(tiny_png(3, 2)).decode()}", "more than 5"),
])
async def test_a_frame_whose_image_is_refused_gets_error_and_reaches_no_worker(models, sockets, alice, settings,
                                                                               image, reason):
    settings.MAX_IMAGE_PIXELS = 5
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)

    await session.send({"type": "frame", "seq": 1, "image": image, "params": {"prompt": "x"}})

    refused = await session.expect("error")
    assert reason in refused["error"], refused
    assert await host.silent()
    await session.send(frame(2))  # 2 x 2: within the cap; the socket stayed open
    assert (await host.receive())["seq"] == 2


async def test_a_webp_frame_goes_to_the_worker(models, sockets, alice):
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buffer, format="WEBP")
    browser, worker = sockets
    host = await worker()
    session, _ = await go_live(browser, host, alice)

    await session.send({"type": "frame", "seq": 1, "params": {"prompt": "x"},
                        "image": "data:image/webp;base64," + base64.b64encode(buffer.getvalue()).decode()})

    assert (await host.receive())["image"] == base64.b64encode(buffer.getvalue()).decode()


async def test_it_labels_a_jpeg_result_as_jpeg(models, sockets, alice):
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)
    await session.send(frame(1))
    await host.receive()
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0fake jpeg").decode()

    await host.send({"type": "frame_result", "session_id": session_id, "seq": 1, "image": jpeg, "gpu_ms": 1.0,
                     "batch_size": 1})

    assert (await session.expect("frame"))["image"] == f"data:image/jpeg;base64,{jpeg}"


async def test_it_ignores_a_result_from_a_worker_that_does_not_hold_the_session(models, sockets, alice):
    browser, worker = sockets
    host = await worker("host-a:0")
    other = await worker("host-b:0", slots=0)
    session, session_id = await go_live(browser, host, alice)

    await other.send({"type": "frame_result", "session_id": session_id, "seq": 1, "image": RESULT_B64,
                      "gpu_ms": 1.0, "batch_size": 1})

    assert await session.silent()


async def test_while_queued_only_the_newest_frame_is_kept_and_sent_once_live(models, sockets, alice):
    browser, worker = sockets
    session = await browser(alice)
    await session.expect_state("queued", position=1)
    for seq in (1, 2, 3):
        await session.send(frame(seq, f"prompt {seq}"))
    host = await worker()
    start = await host.receive()
    assert await host.silent()  # no frame before the session is accepted

    await host.send({"type": "session_accepted", "session_id": start["session_id"]})

    kept = await host.receive()
    assert (kept["type"], kept["seq"], kept["params"]) == ("frame", 3, {"prompt": "prompt 3"})
    assert await host.silent()


@pytest.mark.parametrize("text", ["not json", "[1, 2]", json.dumps({"type": "stroke"}),
                                  json.dumps({"type": "frame", "seq": "one", "image": "data:image/png;base64,AA=="}),
                                  json.dumps({"type": "frame", "seq": 1, "image": "AAAA"}),
                                  json.dumps({"type": "frame", "seq": 1, "image": "data:image/png;base64,AA==",
                                              "params": {"prompt": 5}})])
async def test_it_answers_a_bad_message_with_error_and_stays_open(models, sockets, alice, text):
    browser, worker = sockets
    host = await worker()
    session, session_id = await go_live(browser, host, alice)

    await session.send_text(text)

    assert set(await session.expect("error")) == {"type", "error"}
    await session.send(frame(7))
    assert (await host.receive())["seq"] == 7


async def test_it_closes_with_4009_on_a_message_over_4_mib(models, sockets, alice, settings):
    browser, _ = sockets
    session = await browser(alice)
    await session.expect_state("queued", position=1)
    big = "A" * (settings.BROWSER_MESSAGE_MAX_BYTES + 1)

    await session.send_text(json.dumps({"type": "frame", "seq": 1, "image": f"data:image/png;base64,{big}"}))

    assert await session.expect_close() == 4009
    assert await eventually(lambda: _closed())


async def _closed() -> bool:
    return [state for state, _ in await session_states()] == ["closed"]


# --- losing the slot -----------------------------------------------------------------------------

async def test_a_dead_workers_sessions_go_back_to_the_queue_at_their_old_place(models, sockets, alice, bob):
    browser, worker = sockets
    host = await worker(slots=1)
    live, _ = await go_live(browser, host, alice)
    waiting = await browser(bob)
    await waiting.expect_state("queued", position=1)

    await host.close()

    assert await live.expect_state("queued") == {"type": "state", "state": "queued", "position": 1}
    assert await waiting.expect_state("queued", position=2)
    assert await session_states() == [("queued", None), ("queued", None)]
    assert [row["ended_at"] is not None for row in await usage_rows()] == [True]
    replacement = await worker("host-b:0", slots=1)
    assert (await replacement.receive())["type"] == "session_start"
    assert [state for state, _ in await session_states()] == ["placing", "queued"]


async def test_a_demotion_to_a_rung_without_realtime_sends_sessions_back_and_ends_them(models, sockets, alice):
    browser, worker = sockets
    host = await worker(slots=1)
    session, session_id = await go_live(browser, host, alice)

    await host.send({"type": "rung_changed", "model_id": "tiny-a", "rung": "model_offload", "realtime": False,
                     "realtime_slots": 0})

    assert await host.receive() == {"type": "session_end", "session_id": session_id}
    assert await session.expect_state("queued", position=1)
    assert await session_states() == [("queued", None)]
    assert await host.silent()  # no slot left for it on that worker


async def test_an_idle_session_releases_its_slot_and_a_frame_places_it_again(models, sockets, alice, bob, settings):
    settings.SESSION_IDLE_SECONDS = 0.3
    browser, worker = sockets
    host = await worker(slots=1)
    session, session_id = await go_live(browser, host, alice)

    assert await session.expect_state("idle") == {"type": "state", "state": "idle"}
    assert await host.receive() == {"type": "session_end", "session_id": session_id}
    assert await session_states() == [("idle", None)]
    assert (await usage_rows())[0]["ended_at"] is not None

    await session.send(frame(9))

    again = await host.receive()
    assert again["type"] == "session_start" and again["session_id"] == session_id
    await host.send({"type": "session_accepted", "session_id": session_id})
    await session.expect_state("live")
    assert (await host.receive())["seq"] == 9


async def test_a_freed_idle_slot_goes_to_the_next_session_and_an_idle_frame_waits(models, sockets, alice, bob,
                                                                                   settings):
    settings.SESSION_IDLE_SECONDS = 0.3
    browser, worker = sockets
    host = await worker(slots=1)
    idle, idle_id = await go_live(browser, host, alice)
    waiting = await browser(bob)
    await waiting.expect_state("queued", position=1)

    await idle.expect_state("idle")
    assert await host.receive() == {"type": "session_end", "session_id": idle_id}
    start = await host.receive()
    await host.send({"type": "session_accepted", "session_id": start["session_id"]})
    await waiting.expect_state("live")
    await waiting.send(frame(1))  # keeps bob's slot busy
    await idle.send(frame(2))

    assert await idle.expect_state("queued", position=1)


async def test_the_sweep_applies_the_idle_rule(models, sockets, alice, settings):
    from realtime.services import sessions_sweep

    # within the dead-worker window (4 heartbeat periods): the sweep's moment finds the worker alive
    settings.SESSION_IDLE_SECONDS = 20.0
    browser, worker = sockets
    host = await worker(slots=1)
    session, session_id = await go_live(browser, host, alice)
    live_since = await database_sync_to_async(
        lambda: RealtimeSession.objects.values_list("live_since", flat=True).get(id=session_id))()
    idle = timedelta(seconds=settings.SESSION_IDLE_SECONDS)

    await database_sync_to_async(sessions_sweep)(now=live_since + idle - timedelta(milliseconds=1))
    assert await session_states() == [("live", "host-a:0")]
    # (the browser's process counts from when it heard of going live: a moment after the row's)
    await database_sync_to_async(sessions_sweep)(now=live_since + idle + timedelta(seconds=1))

    assert await session.expect_state("idle")


# --- metering and operators ----------------------------------------------------------------------

async def test_usage_counts_the_seconds_a_slot_is_held_up_to_now(models, sockets, alice, bob):
    browser, worker = sockets
    host = await worker(slots=2)
    session, _ = await go_live(browser, host, alice)

    held = (await get(alice, "/api/v1/usage/")).json()
    assert [m["model_id"] for m in held["models"]] == ["tiny-a"] and held["total_seconds"] > 0
    await session.close()
    await eventually(lambda: _usage_closed())
    done = (await get(alice, "/api/v1/usage/")).json()
    assert done["total_seconds"] >= held["total_seconds"]
    assert done["total_seconds"] == done["models"][0]["seconds"]
    assert done["total_seconds"] == pytest.approx((await usage_rows())[0]["seconds"], abs=0.001)
    assert (await get(bob, "/api/v1/usage/")).json() == {"total_seconds": 0.0, "models": []}
    assert (await get(None, "/api/v1/usage/")).status_code == 401


async def _usage_closed() -> bool:
    return all(row["ended_at"] is not None for row in await usage_rows())


async def test_closing_a_live_socket_ends_the_session_on_its_worker_and_frees_the_slot(models, sockets, alice, bob):
    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)
    waiting = await browser(bob)
    await waiting.expect_state("queued", position=1)

    await live.close()

    assert await host.receive() == {"type": "session_end", "session_id": session_id}
    assert (await host.receive())["type"] == "session_start"


async def test_staff_see_queued_sessions_and_free_slots(models, sockets, alice, bob, make_account):
    browser, worker = sockets
    host = await worker(slots=2)
    await go_live(browser, host, alice)
    waiting = await browser(bob, model_id="tiny-b")
    await waiting.expect_state("queued", position=1)
    root = await database_sync_to_async(make_account)("root", staff=True)

    body = (await get(root, "/api/v1/queues/")).json()

    assert [(s["model_id"], s["position"]) for s in body["sessions"]] == [("tiny-b", 1)]
    (entry,) = body["workers"]
    assert entry["slots"] == [{"model_id": "tiny-a", "slots": 2, "free": 1}]
    assert [s["state"] for s in entry["sessions"]] == ["live"]
    assert (await get(alice, "/api/v1/queues/")).status_code == 403


async def test_an_operator_can_end_a_session(models, sockets, alice):
    from realtime.services import session_end

    browser, worker = sockets
    host = await worker(slots=1)
    live, session_id = await go_live(browser, host, alice)

    assert await database_sync_to_async(session_end)(session_id=session_id, now=timezone.now())

    assert await live.expect_close() == 1000
    await live.close()
    assert await host.receive() == {"type": "session_end", "session_id": session_id}
    assert await session_states() == [("closed", None)]
