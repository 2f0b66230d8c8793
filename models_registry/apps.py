from __future__ import annotations

from django.apps import AppConfig


class ModelsRegistryConfig(AppConfig):
    name = "models_registry"
    verbose_name = "Model registry"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from models_registry.models import ModelManifest
        from models_registry.selectors import manifests_changed

        def changed(**_: object) -> None:
            manifests_changed()

        for signal in (post_save, post_delete):  # weak=False: `changed` lives on after ready() returns
            signal.connect(changed, sender=ModelManifest, weak=False,
                           dispatch_uid=f"models_registry.changed.{id(signal)}")
