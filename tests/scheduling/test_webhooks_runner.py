"""The webhook delivery thread (scheduling/webhooks/runner.py): a job's delivery written (the
webhook_due signal after the commit) makes a pass soon, a full pass is followed by another at once,
and a failed pass does not stop the thread."""
from __future__ import annotations

import threading
from datetime import UTC, datetime

from scheduling.models import WebhookDelivery
from scheduling.signals import webhook_due
from scheduling.webhooks.runner import WebhookRunner

NOW = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


class Passes:
    """What the runner ran, with a semaphore per pass for the test to wait on."""

    def __init__(self, results: list[int | Exception]) -> None:
        self.results = list(results)
        self.limits: list[int] = []
        self.ran = threading.Semaphore(0)

    def __call__(self, *, now: datetime, mapper: object, limit: int) -> int:
        self.limits.append(limit)
        self.ran.release()
        result = self.results.pop(0) if self.results else 0
        if isinstance(result, Exception):
            raise result
        return result

    def wait(self) -> bool:
        return self.ran.acquire(timeout=10)


def runner_of(passes: Passes) -> WebhookRunner:
    return WebhookRunner(clock=lambda: NOW, deliver=passes, next_due=lambda: None)


def test_a_written_delivery_wakes_the_runner_for_a_pass(settings):
    settings.WEBHOOK_SENDERS = 2
    passes = Passes([0, 0])
    runner = runner_of(passes)
    runner.start()
    try:
        assert passes.wait()  # the pass at start
        webhook_due.send(sender=WebhookDelivery)
        assert passes.wait()  # woken, well before its POLL_SECONDS
        assert passes.limits[:2] == [2, 2]
    finally:
        runner.stop()


def test_a_full_pass_is_followed_by_another_at_once(settings):
    settings.WEBHOOK_SENDERS = 2
    passes = Passes([2, 2, 1])
    runner = runner_of(passes)
    runner.start()
    try:
        assert passes.wait() and passes.wait() and passes.wait()
    finally:
        runner.stop()


def test_a_failed_pass_is_logged_and_the_next_wake_up_runs_again(caplog):
    passes = Passes([RuntimeError("the database is away"), 0])
    runner = runner_of(passes)
    runner.start()
    try:
        assert passes.wait()
        webhook_due.send(sender=WebhookDelivery)
        assert passes.wait()
        assert "webhook delivery failed" in caplog.text
    finally:
        runner.stop()
