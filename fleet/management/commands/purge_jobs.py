"""`manage.py purge_jobs --older-than DAYS`: deletes the jobs that ended more than DAYS ago with their
files and dependent rows, the sessions closed more than DAYS ago with their usage records (kept as
tallies), and the checkpoints of jobs paused longer than PAUSED_CHECKPOINT_DAYS; idempotent, in
batches. docs/operations.md, "Retention"."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from fleet.retention import retention_run
from scheduling.services.retention import PURGE_BATCH


class Command(BaseCommand):
    help = ("Delete ended jobs older than DAYS (with their files), sessions closed before then, and old "
            "paused jobs' checkpoints.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", type=int, metavar="DAYS", dest="days",
                            help="jobs that ended and sessions closed more than DAYS ago go "
                                 "(default: JOB_RETENTION_DAYS)")
        parser.add_argument("--paused-checkpoints", type=int, metavar="DAYS", dest="checkpoint_days",
                            help="checkpoints of jobs paused more than DAYS ago go; 0: none "
                                 "(default: PAUSED_CHECKPOINT_DAYS)")
        parser.add_argument("--batch", type=int, default=PURGE_BATCH, help="jobs per transaction")

    def handle(self, *args: Any, days: int | None, checkpoint_days: int | None, batch: int, **options: Any) -> None:
        days = settings.JOB_RETENTION_DAYS if days is None else days
        if days < 1:
            raise CommandError("--older-than DAYS must be 1 or more (or set JOB_RETENTION_DAYS)")
        if checkpoint_days is not None and checkpoint_days < 0:
            raise CommandError("--paused-checkpoints DAYS must be 0 or more")
        if batch < 1:
            raise CommandError("--batch must be 1 or more")
        purged = retention_run(now=timezone.now(), job_days=days, checkpoint_days=checkpoint_days, batch=batch)
        self.stdout.write(f"purged {purged.jobs} jobs that ended more than {days} days ago and "
                          f"{purged.sessions} sessions closed before then; "
                          f"dropped {purged.checkpoints} paused jobs' checkpoints")
