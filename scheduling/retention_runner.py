"""The retention thread of one API process: JOB_RETENTION_DAYS and PAUSED_CHECKPOINT_DAYS applied every
RETENTION_SECONDS, by one process at a time (a claim in the shared cache; the purge is idempotent
and skips rows another purge holds besides). docs/operations.md, "Retention"."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.core.cache import cache
from django.db import close_old_connections
from django.utils import timezone

from potocolom.runtime import Slot
from potocolom.threads import ProcessThread, start_when_served, stop_thread
from scheduling.services.retention import Purged, retention_run

log = logging.getLogger(__name__)
RETENTION_SECONDS = 3600.0  # how often a run is due (ended jobs are purged by the day: an hour is plenty)
FIRST_RUN_SECONDS = 300.0  # the first run after a start (a process restarted hourly still runs it)
CLAIM_KEY = "potocolom:retention:claim"


class RetentionRunner(ProcessThread):
    """Runs `run(now=clock())` every `period()` seconds (the first after FIRST_RUN_SECONDS), when
    retention is on and this process claims the period: `cache.add` of CLAIM_KEY for the period
    succeeds in one process only (a compare-and-set; the claim lapses with the period, so a process
    that dies holding it holds it no longer). A failed run is logged; the next one tries again."""

    name = "retention"

    def __init__(self, *, period: Callable[[], float] = lambda: RETENTION_SECONDS,
                 first: float = FIRST_RUN_SECONDS, clock: Callable[[], datetime] = timezone.now,
                 run: Callable[..., Purged] = retention_run) -> None:
        super().__init__()
        self.period, self.first, self.clock, self.run = period, first, clock, run

    def enabled(self) -> bool:
        return bool(settings.JOB_RETENTION_DAYS or settings.PAUSED_CHECKPOINT_DAYS)

    def loop(self) -> None:
        wait = self.first
        while not self.stopped.wait(wait):
            self.tick()
            wait = self.period()

    def tick(self) -> Purged | None:
        """One period's run, if this process claims it; what it purged (None: another process ran it)."""
        close_old_connections()  # a connection a database restart broke is replaced, as per request
        try:
            if not cache.add(CLAIM_KEY, f"{os.getpid()}", timeout=max(1, int(self.period()) - 1)):
                return None
            return self.run(now=self.clock())
        except Exception:  # the database, the cache or the storage is away: the next period tries again
            log.exception("the retention run failed")
            return None


def retention_runner(run: Callable[..., Purged]) -> Slot:
    """The process's retention thread running `run` (fleet's: jobs, then closed sessions)."""
    return Slot("scheduling.retention", make=lambda: RetentionRunner(run=run), start=start_when_served,
                stop=stop_thread)
