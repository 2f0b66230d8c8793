"""Silence is counted from the later of the last sign of life and the database server's start."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from potocolom.database import EPOCH, silent_before, up_for_less_than

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
