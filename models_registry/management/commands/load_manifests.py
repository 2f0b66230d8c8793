"""`manage.py load_manifests PATH...`: register or update models; prints `loaded N` last."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from models_registry.services import manifests_load
from potocolom.protocol.manifests import ManifestError


class Command(BaseCommand):
    help = "Register or update models from manifest files (JSON: one object or a list)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("paths", nargs="+", type=Path)

    def handle(self, *args: Any, paths: list[Path], **options: Any) -> None:
        try:
            manifests = manifests_load(paths=paths)
        except ManifestError as exc:
            raise CommandError(f"nothing loaded: {exc}") from None
        for manifest in manifests:
            self.stdout.write(f"{manifest.model_id}: {manifest.tier}, cost {manifest.cost:g}, "
                              f"{', '.join(manifest.capabilities)}")
        self.stdout.write(f"loaded {len(manifests)}")
