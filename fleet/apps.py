from __future__ import annotations

from django.apps import AppConfig
from django.db import transaction


class FleetConfig(AppConfig):
    name = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        """Started with the process: the dead-worker sweep, placement and retention (jobs and
        sessions). Work that waits (a job no worker here took, a session queued) or ends makes
        placement plan soon."""
        from fleet.placement.runner import PLACEMENT_RUNNER, placement_wake
        from fleet.retention import RETENTION_RUNNER
        from fleet.sweeper import DEAD_WORKER_SWEEPER
        from potocolom.runtime import runtime
        from potocolom.signals import work_ended, work_waiting

        runtime.register(DEAD_WORKER_SWEEPER, PLACEMENT_RUNNER, RETENTION_RUNNER)

        def wake(**_: object) -> None:
            transaction.on_commit(placement_wake)  # it reads what the sender's transaction writes

        work_waiting.connect(wake, weak=False, dispatch_uid="fleet.placement")
        work_ended.connect(wake, weak=False, dispatch_uid="fleet.placement.ended")
