"""`manage.py make_tiny_model DIR`: write the tiny random-weight pipeline and its manifest; the last
line printed is the manifest's absolute path. No database; diffusers is imported only here."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Write a tiny random-weight diffusers pipeline to DIR and its manifest as DIR/manifest.json."

    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("directory", help="folder to write the pipeline into (created if missing)")

    def handle(self, *args: Any, **options: Any) -> None:
        from workers.gpu.tiny import make_tiny_model

        manifest_path = make_tiny_model(options["directory"])
        self.stdout.write(str(manifest_path))
