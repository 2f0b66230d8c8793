"""`manage.py make_tiny_model DIR [--family sd|sdxl|sd3]`: write a tiny random-weight pipeline of that
family and its manifest; the last line printed is the manifest's absolute path. No database;
diffusers is imported only here. docs/design/families.md."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = ("Write a tiny random-weight diffusers pipeline (of --family sd, sdxl or sd3) to DIR and its manifest "
            "as DIR/manifest.json.")

    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser: Any) -> None:
        from gpuworker.tiny import TINY_FAMILIES

        parser.add_argument("directory", help="folder to write the pipeline into (created if missing)")
        parser.add_argument("--family", choices=TINY_FAMILIES, default="sd",
                            help="the model family: sd (Stable Diffusion 1/2, the default), sdxl or sd3 "
                                 "(model_id tiny-sd, tiny-sdxl or tiny-sd3)")

    def handle(self, *args: Any, **options: Any) -> None:
        from gpuworker.quiet import quiet_libraries
        from gpuworker.tiny import make_tiny_model

        quiet_libraries()  # no "Writing model shards" bar, no torchvision notice
        manifest_path = make_tiny_model(options["directory"], options["family"])
        self.stdout.write(str(manifest_path))
