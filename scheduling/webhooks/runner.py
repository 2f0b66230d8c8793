"""The webhook delivery thread of one API process: it starts each due delivery on a pool of senders as
room allows (WEBHOOK_CONCURRENCY per account, WEBHOOK_SENDERS in all) and records each as it ends,
never waiting for another. docs/operations.md, "Webhooks"."""
from __future__ import annotations

import logging
import queue
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from potocolom.runtime import Slot
from potocolom.threads import ProcessThread, start_when_served, stop_thread
from scheduling.models import WebhookDelivery
from scheduling.signals import webhook_due
from scheduling.webhooks import services
from scheduling.webhooks.delivery import (
    Attempt,
    lease_seconds,
    webhook_attempt_prepare,
    webhook_attempt_record,
    webhook_attempt_send,
)
from scheduling.webhooks.policy import deliveries_to_start
from scheduling.webhooks.sending import AttemptResult

log = logging.getLogger(__name__)
POLL_SECONDS = 5.0  # deliveries written by other processes are found at least this often


@dataclass(frozen=True)
class Sent:
    """An attempt whose network part ended, waiting to be recorded by the runner's thread."""

    delivery: WebhookDelivery
    at: datetime
    outcome: Future[AttemptResult]


class WebhookRunner(ProcessThread):
    """Starts due deliveries on its pool while there is room, records each attempt as its sender
    ends it (the sender wakes the thread), and otherwise sleeps until the next due time, a wake-up
    or POLL_SECONDS; a failed step is logged and the next runs all the same. `send` (the network
    part of an attempt) and `record` are test seams; the database is used from this thread only."""

    name = "webhooks"

    def __init__(self, *, clock: Callable[[], datetime] = timezone.now,
                 send: Callable[[Attempt], AttemptResult] = webhook_attempt_send,
                 record: Callable[..., None] = webhook_attempt_record) -> None:
        super().__init__()
        self.clock, self.send, self.record = clock, send, record
        self.in_flight: Counter[int] = Counter()  # attempts under way, by account (this thread's only)
        self.sent: queue.SimpleQueue[Sent] = queue.SimpleQueue()

    def started(self) -> None:
        """A delivery written (after its commit) wakes the thread."""
        webhook_due.connect(self._on_due, weak=False, dispatch_uid=f"webhooks.runner.{id(self)}")

    def stopping(self) -> None:
        webhook_due.disconnect(dispatch_uid=f"webhooks.runner.{id(self)}")

    def _on_due(self, **_: object) -> None:
        self.wake()

    def loop(self) -> None:
        pool = ThreadPoolExecutor(max_workers=settings.WEBHOOK_SENDERS, thread_name_prefix="webhook-send")
        try:
            while not self.stopped.is_set():
                self.woken.clear()
                self.woken.wait(self.tick(pool))
        finally:  # an attempt under way ends by its own timeout; its claim lapses unrecorded
            pool.shutdown(wait=False, cancel_futures=True)

    def tick(self, pool: ThreadPoolExecutor) -> float:
        """Record the attempts that ended, start what is due and has room; seconds to wait then."""
        close_old_connections()
        try:
            self.record_sent()
            while self.start_due(pool):
                self.record_sent()
            if sum(self.in_flight.values()) >= settings.WEBHOOK_SENDERS:
                return POLL_SECONDS  # an attempt ending wakes the thread
            next_due = services.webhook_next_due(skip_accounts=self.full_accounts())
        except Exception:  # the database is away: try again after a while
            log.exception("webhook delivery failed")
            return POLL_SECONDS
        if next_due is None:
            return POLL_SECONDS
        return min(POLL_SECONDS, max(0.0, (next_due - self.clock()).total_seconds()))

    def full_accounts(self) -> list[int]:
        return [account for account, count in self.in_flight.items() if count >= settings.WEBHOOK_CONCURRENCY]

    def start_due(self, pool: ThreadPoolExecutor) -> int:
        """Claim and start the due deliveries policy.deliveries_to_start picks; how many started."""
        free = settings.WEBHOOK_SENDERS - sum(self.in_flight.values())
        if free <= 0:
            return 0
        now, per_account = self.clock(), settings.WEBHOOK_CONCURRENCY
        due = services.webhook_deliveries_due(now=now, per_account=per_account, limit=free,
                                              skip_accounts=self.full_accounts())
        chosen = deliveries_to_start(due, in_flight=self.in_flight, per_account=per_account, free=free)
        claimed = services.webhook_deliveries_claim(due=chosen, now=now, lease_seconds=lease_seconds())
        for delivery in claimed:
            attempt = webhook_attempt_prepare(delivery=delivery, now=now)
            self.in_flight[attempt.account_id] += 1
            pool.submit(self.send, attempt).add_done_callback(partial(self._on_sent, delivery, now))
        return len(claimed)

    def _on_sent(self, delivery: WebhookDelivery, at: datetime, outcome: Future[AttemptResult]) -> None:
        """In the sender's thread: hand the attempt to the runner's thread and wake it."""
        self.sent.put(Sent(delivery, at, outcome))
        self.wake()

    def record_sent(self) -> None:
        """Record every attempt whose sender ended; its account has room again even if the record
        fails (then its claim lapses and the event is attempted again, with the same webhook-id)."""
        while True:
            try:
                sent = self.sent.get_nowait()
            except queue.Empty:
                return
            try:
                try:
                    result = sent.outcome.result()
                except BaseException:  # a sender that raised, or one cancelled as the thread stops
                    result = AttemptResult(None, "internal_error", 0.0)
                self.record(delivery=sent.delivery, result=result, at=sent.at, now=self.clock())
            finally:
                self.in_flight[sent.delivery.job.account_id] -= 1
                if self.in_flight[sent.delivery.job.account_id] <= 0:
                    del self.in_flight[sent.delivery.job.account_id]


# Webhook deliveries due in the database are sent by every served process, whichever wrote them.
WEBHOOK_RUNNER = Slot("scheduling.webhooks.runner", make=WebhookRunner, start=start_when_served, stop=stop_thread)
