"""The placement thread (fleet.placement.runner): a wake-up makes one run soon (not periodic),
the period makes periodic runs without any wake-up, and a failed run does not stop the thread."""
from __future__ import annotations

import threading
from datetime import UTC, datetime

from fleet.placement.runner import PlacementRunner

NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


class Runs:
    """What the runner ran, with an event per run for the test to wait on."""

    def __init__(self, fail_first: bool = False) -> None:
        self.calls: list[bool] = []
        self.ran = threading.Semaphore(0)
        self.fail_first = fail_first

    def __call__(self, *, now: datetime, periodic: bool) -> None:
        self.calls.append(periodic)
        self.ran.release()
        if self.fail_first and len(self.calls) == 1:
            raise RuntimeError("the database is away")

    def wait(self) -> bool:
        return self.ran.acquire(timeout=10)


def test_a_wake_up_runs_the_planner_soon_and_not_as_the_periodic_rule():
    runs = Runs()
    runner = PlacementRunner(period=lambda: 3600.0, clock=lambda: NOW, run=runs)
    runner.start()
    try:
        runner.wake()
        assert runs.wait()
        assert runs.calls == [False]
    finally:
        runner.stop()


def test_the_period_runs_the_periodic_rule_without_any_wake_up():
    runs = Runs()
    runner = PlacementRunner(period=lambda: 0.01, clock=lambda: NOW, run=runs)
    runner.min_gap_seconds = 0.0
    runner.start()
    try:
        assert runs.wait() and runs.wait()
        assert runs.calls[:2] == [True, True]
    finally:
        runner.stop()


def test_a_failed_run_is_logged_and_the_next_wake_up_runs_again(caplog):
    runs = Runs(fail_first=True)
    runner = PlacementRunner(period=lambda: 3600.0, clock=lambda: NOW, run=runs)
    runner.min_gap_seconds = 0.0
    runner.start()
    try:
        runner.wake()
        assert runs.wait()
        runner.wake()
        assert runs.wait()
        assert runs.calls == [False, False]
        assert "placement failed" in caplog.text
    finally:
        runner.stop()
