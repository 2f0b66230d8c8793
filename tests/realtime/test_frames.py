"""The API's frame backpressure, pure: one frame in flight per live session, the newest kept."""
from __future__ import annotations

from realtime.frames import FrameGate


def f(seq: int) -> dict:
    return {"type": "frame", "seq": seq}


def test_while_a_frame_is_in_flight_only_the_newest_is_kept_and_goes_after_the_result():
    gate = FrameGate(wait_seconds=1.0)

    assert gate.offer(f(1), live=True, now=0.0) == f(1)
    assert [gate.offer(f(n), live=True, now=0.1) for n in (2, 3)] == [None, None]
    assert gate.deadline() == 1.0
    assert gate.answered(1, now=0.5) == f(3)
    assert gate.answered(2, now=0.6) is None  # an answer older than the frame in flight frees nothing
    assert gate.answered(3, now=0.7) is None and gate.deadline() is None
    assert gate.offer(f(4), live=True, now=0.8) == f(4)


def test_an_unanswered_frame_lets_the_newest_go_after_the_wait():
    gate = FrameGate(wait_seconds=1.0)
    gate.offer(f(1), live=True, now=0.0)
    gate.offer(f(2), live=True, now=0.2)

    assert gate.due(now=0.99) is None
    assert gate.due(now=1.0) == f(2)
    assert gate.deadline() is None  # nothing kept
    assert gate.offer(f(3), live=True, now=1.5) is None  # 2 is in flight now, since 1.0
    assert gate.offer(f(4), live=True, now=2.0) == f(4)  # its wait ran out: the frame goes at once


def test_frames_wait_while_not_live_and_the_newest_goes_when_live():
    gate = FrameGate(wait_seconds=1.0)
    assert gate.offer(f(1), live=False, now=0.0) is None
    assert gate.offer(f(2), live=False, now=0.1) is None
    assert gate.deadline() is None  # nothing in flight: no timer

    assert gate.went_live(now=5.0) == f(2)
    assert gate.offer(f(3), live=True, now=5.1) is None
    # placed again (a new worker): what was in flight on the old one holds nothing back
    assert gate.went_live(now=5.2) == f(3)
    assert gate.went_live(now=5.3) is None
