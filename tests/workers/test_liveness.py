"""A worker silent for 3 heartbeat periods is dead; silence is counted from the later of the last
sign of life and the database server's start."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workers.liveness import EPOCH, silent_before, up_for_less_than, worker_is_dead

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_without_a_restart_the_cutoff_is_the_window_before_now():
    assert silent_before(NOW, 40, None) == NOW - timedelta(seconds=40)
    assert silent_before(NOW, 40, NOW - timedelta(days=3)) == NOW - timedelta(seconds=40)


def test_a_server_up_for_less_than_the_window_finds_no_one_silent():
    started = NOW - timedelta(seconds=39)
    assert silent_before(NOW, 40, started) == EPOCH
    last_seen = NOW - timedelta(hours=1)  # before the outage: silent for an hour, but unheard only 39 s
    assert not last_seen < silent_before(NOW, 40, started)


def test_once_the_server_has_been_up_for_the_whole_window_silence_counts_again():
    started = NOW - timedelta(seconds=41)
    assert silent_before(NOW, 40, started) == NOW - timedelta(seconds=40)
    assert NOW - timedelta(hours=1) < silent_before(NOW, 40, started)


def test_up_for_less_than():
    assert up_for_less_than(NOW, 60, NOW - timedelta(seconds=59))
    assert not up_for_less_than(NOW, 60, NOW - timedelta(seconds=61))
    assert not up_for_less_than(NOW, 60, None)  # not PostgreSQL: no restart to allow for


@pytest.mark.parametrize(("silent_for", "heartbeat", "dead"), [
    (0.0, 10.0, False),
    (10.0, 10.0, False),
    (29.9, 10.0, False),
    (30.0, 10.0, False),  # exactly 3 periods: not yet
    (30.01, 10.0, True),
    (40.0, 10.0, True),
    (0.61, 0.2, True),
    (0.59, 0.2, False),
])
def test_it_calls_a_worker_dead_after_three_silent_heartbeat_periods(silent_for, heartbeat, dead):
    now = 1_000.0
    assert worker_is_dead(last_seen=now - silent_for, now=now, heartbeat_seconds=heartbeat) is dead
