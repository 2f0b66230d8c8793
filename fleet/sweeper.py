"""The dead-worker sweep of one API process: fleet.lifecycle.dead_workers_sweep every heartbeat
period, in a thread of its own, whether or not a socket is open here. docs/protocol.md, "Dead workers"."""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from fleet.lifecycle import dead_workers_sweep
from potocolom.runtime import Slot
from potocolom.threads import ProcessThread, start_when_served, stop_thread

log = logging.getLogger(__name__)


class DeadWorkerSweeper(ProcessThread):
    """Runs `sweep(now=clock())` every `period()` seconds until stopped; a failed sweep (the database
    is away) is logged and the next one runs all the same."""

    name = "dead-worker-sweep"

    def __init__(self, *, period: Callable[[], float] = lambda: settings.WORKER_HEARTBEAT_SECONDS,
                 clock: Callable[[], datetime] = timezone.now,
                 sweep: Callable[..., None] = dead_workers_sweep) -> None:
        super().__init__()
        self.period, self.clock, self.sweep = period, clock, sweep

    def loop(self) -> None:
        while not self.stopped.wait(self.period()):
            self.tick()

    def tick(self) -> None:
        close_old_connections()  # a connection a database restart broke is replaced, as per request
        try:
            self.sweep(now=self.clock())
        except Exception:  # the database or Redis is away this period: the next sweep tries again
            log.exception("the dead-worker sweep failed")


DEAD_WORKER_SWEEPER = Slot("fleet.dead_worker_sweep", make=DeadWorkerSweeper, start=start_when_served,
                           stop=stop_thread)
