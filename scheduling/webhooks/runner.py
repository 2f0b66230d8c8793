"""The webhook delivery thread of one API process: a pass soon after a job with a webhook ends
(scheduling.signals), and whenever the earliest pending delivery falls due, at least every
POLL_SECONDS. docs/operations.md, "Webhooks"."""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from potocolom.runtime import Slot
from potocolom.threads import ProcessThread, start_when_served, stop_thread
from scheduling.signals import webhook_due
from scheduling.webhooks.delivery import webhooks_deliver
from scheduling.webhooks.services import webhook_next_due

log = logging.getLogger(__name__)
POLL_SECONDS = 5.0  # deliveries written by other processes are found at least this often


class WebhookRunner(ProcessThread):
    """Runs `deliver(now=clock(), mapper=...)` until nothing is due, then sleeps until the next due
    time, a wake-up, or POLL_SECONDS; a failed pass is logged and the next runs all the same."""

    name = "webhooks"

    def __init__(self, *, clock: Callable[[], datetime] = timezone.now,
                 deliver: Callable[..., int] = webhooks_deliver,
                 next_due: Callable[[], datetime | None] = webhook_next_due) -> None:
        super().__init__()
        self.clock, self.deliver, self.next_due = clock, deliver, next_due

    def started(self) -> None:
        """A delivery written (after its commit) wakes the thread."""
        webhook_due.connect(self._on_due, weak=False, dispatch_uid=f"webhooks.runner.{id(self)}")

    def stopping(self) -> None:
        webhook_due.disconnect(dispatch_uid=f"webhooks.runner.{id(self)}")

    def _on_due(self, **_: object) -> None:
        self.wake()

    def loop(self) -> None:
        senders = settings.WEBHOOK_SENDERS
        with ThreadPoolExecutor(max_workers=senders, thread_name_prefix="webhook-send") as pool:
            while not self.stopped.is_set():
                self.woken.clear()
                wait = self.tick(pool, limit=senders)
                self.woken.wait(wait)

    def tick(self, pool: ThreadPoolExecutor, *, limit: int) -> float:
        """One pass (more while passes come back full); seconds to wait before the next."""
        close_old_connections()
        try:
            while self.deliver(now=self.clock(), mapper=pool.map, limit=limit) >= limit:
                if self.stopped.is_set():
                    return 0.0
            next_due = self.next_due()
        except Exception:  # the database is away: try again after a while
            log.exception("webhook delivery failed")
            return POLL_SECONDS
        if next_due is None:
            return POLL_SECONDS
        return min(POLL_SECONDS, max(0.0, (next_due - self.clock()).total_seconds()))


# Webhook deliveries due in the database are sent by every served process, whichever wrote them.
WEBHOOK_RUNNER = Slot("scheduling.webhooks.runner", make=WebhookRunner, start=start_when_served, stop=stop_thread)
