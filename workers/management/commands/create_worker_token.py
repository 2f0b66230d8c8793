"""`manage.py create_worker_token NAME`: makes a worker credential; prints the token last."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.services import worker_token_create


class Command(BaseCommand):
    help = "Make a worker credential (a GPU worker presents it on /ws/worker/?token=T) and print it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        if not name.strip() or len(name) > 200:
            raise CommandError("NAME must be 1 to 200 characters")
        secret = worker_token_create(name=name)
        self.stdout.write(f"worker token {name} (stored hashed: copy it now)")
        self.stdout.write(secret)
