"""The browser's process's view of its sessions: routes and placements heard of in any order."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from realtime.board import LIVE, QUEUED, SessionBoard, SessionEntry


def at(seconds: int) -> datetime:
    return datetime(2026, 11, 29, 12, 0, tzinfo=UTC) + timedelta(seconds=seconds)


def test_the_browsers_process_follows_placements_in_any_order_of_arrival():
    board = SessionBoard()
    board.add(SessionEntry("s", 1, "tiny-a", 0, {}), browser="browser")
    assert board.frame("s", now=at(0)) == (QUEUED, None)  # its consumer keeps it while queued

    assert board.live_here("s", worker_id="w1", worker_channel="c1", placement=1, now=at(1)) is not None
    assert board.frame("s", now=at(2)) == (LIVE, "c1")
    # Placement 1 ended (its worker died) and placement 2 went live on w2; the live news came first.
    assert board.live_here("s", worker_id="w2", worker_channel="c2", placement=2, now=at(3)) is not None
    assert board.back_here("s", placement=1) is False
    assert board.frame("s", now=at(4)) == (LIVE, "c2")
    # Placement 2 ends; a late live of it changes nothing, and frames wait for the next one.
    assert board.back_here("s", placement=2) is True
    assert board.live_here("s", worker_id="w2", worker_channel="c2", placement=2, now=at(5)) is None
    assert board.frame("s", now=at(6)) == (QUEUED, None)
    assert board.live_worker("s") is None
