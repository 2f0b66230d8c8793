"""The placement thread of one API process: fleet.placement.driver.placement_run every
PLACEMENT_SECONDS, and soon after each event that may change placement (work waiting, a worker's
hello, loss or drain, a load answered). docs/design/placement.md."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from fleet.placement.driver import placement_enabled, placement_run
from potocolom.runtime import Slot, runtime
from potocolom.threads import ProcessThread, start_when_served, stop_thread

log = logging.getLogger(__name__)
MIN_GAP_SECONDS = 0.2  # between two runs of one process's planner


class PlacementRunner(ProcessThread):
    """Runs `run(now=clock(), periodic=...)` soon after each `wake()` (wake-ups during a run make one
    more run, not one each) and every `period()` seconds with `periodic=True`; a failed run is logged
    and the next one runs all the same. One thread per process; the planner's lock keeps the
    processes' runs one at a time."""

    name = "placement"

    def __init__(self, *, period: Callable[[], float] = lambda: settings.PLACEMENT_SECONDS,
                 clock: Callable[[], datetime] = timezone.now, run: Callable[..., object] = placement_run,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.period, self.clock, self.run_once, self.monotonic = period, clock, run, monotonic
        self.min_gap_seconds = MIN_GAP_SECONDS

    def enabled(self) -> bool:
        """Off with PLACEMENT=off."""
        return placement_enabled()

    def loop(self) -> None:
        next_periodic = self.monotonic() + self.period()
        while not self.stopped.is_set():
            self.woken.wait(max(0.0, next_periodic - self.monotonic()))
            if self.stopped.is_set():
                return
            self.woken.clear()
            periodic = self.monotonic() >= next_periodic
            if periodic:
                next_periodic = self.monotonic() + self.period()
            self.tick(periodic=periodic)
            # At most one run per gap: a stream of job ends wakes it often, and each run reads
            # the fleet from the database; what woke it meanwhile is planned after the gap.
            self.stopped.wait(self.min_gap_seconds)

    def tick(self, *, periodic: bool) -> None:
        close_old_connections()
        try:
            self.run_once(now=self.clock(), periodic=periodic)
        except Exception:  # the database is away: the next wake-up or period tries again
            log.exception("placement failed")


PLACEMENT_RUNNER = Slot("fleet.placement", make=PlacementRunner, start=start_when_served, stop=stop_thread)


def placement_wake() -> None:
    """Plan placement soon (an event changed demand or what workers hold); nothing when the thread
    does not run (PLACEMENT=off, or a process that serves no sockets)."""
    runtime.get(PLACEMENT_RUNNER).wake()
