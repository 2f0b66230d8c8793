"""`manage.py revoke_worker_token NAME`: revokes a worker credential and ends its worker_id bindings;
its open sockets close (4001) within a heartbeat period. Prints `revoked N` last."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers.models import WorkerToken
from workers.services import worker_tokens_revoke


class Command(BaseCommand):
    help = ("Revoke a worker credential: its workers' sockets close within a heartbeat period and their "
            "jobs follow the dead-worker rule. Prints `revoked N` (0: it was revoked already).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        ids = list(WorkerToken.objects.filter(name=name).values_list("pk", flat=True))
        if not ids:
            raise CommandError(f"no worker token is named {name!r}")
        self.stdout.write(f"revoked {worker_tokens_revoke(token_ids=ids)}")
