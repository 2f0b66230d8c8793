from __future__ import annotations

from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        """Started with the process: the queue's rebuild and webhook delivery (retention: fleet)."""
        from potocolom.runtime import runtime
        from scheduling.dispatcher import DISPATCHER
        from scheduling.webhooks.runner import WEBHOOK_RUNNER

        runtime.register(DISPATCHER, WEBHOOK_RUNNER)
        _forget_tokens_on_change()


def _forget_tokens_on_change() -> None:
    """The accounts' tokens as REST authentication keeps them (potocolom.web.tokens) are read again
    after a token or a user changes in this process."""
    from django.contrib.auth.models import User
    from django.db.models.signals import post_delete, post_save
    from rest_framework.authtoken.models import Token

    from potocolom.web.tokens import tokens_changed

    for model in (Token, User):
        for signal in (post_save, post_delete):
            signal.connect(tokens_changed, sender=model, weak=False,
                           dispatch_uid=f"scheduling.tokens_changed.{model.__name__}.{id(signal)}")
