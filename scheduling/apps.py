from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        """Started with the process: the queue's rebuild, webhook delivery and retention."""
        from potocolom.runtime import runtime
        from scheduling.dispatcher import DISPATCHER
        from scheduling.retention_runner import RETENTION_RUNNER
        from scheduling.webhooks.runner import WEBHOOK_RUNNER

        runtime.register(DISPATCHER, WEBHOOK_RUNNER, RETENTION_RUNNER)
