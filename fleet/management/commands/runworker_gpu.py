"""`manage.py runworker_gpu --api ws://HOST:PORT --token T ...` (or `--token-file PATH`, or
WORKER_TOKEN): parse the flags and run the worker program (gpuworker), which needs no database;
torch is imported only once it starts."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from potocolom.protocol.rungs import MEMORY_MODES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _positive(unit: str, symbol: str) -> Callable[[str], float]:
    """An argparse type: a number of `unit` above 0."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected more than 0 {symbol}, got {text!r}")
        return value
    return parse


_positive_ms = _positive("milliseconds", "ms")
_positive_seconds = _positive("seconds", "s")


class Command(BaseCommand):
    help = "Run a GPU worker that serves the models installed in --models-dir to the API at --api."

    requires_system_checks: list[str] = []  # a GPU host has no database to check
    requires_migrations_checks = False

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--api", required=True, help="the API, e.g. ws://127.0.0.1:8000")
        parser.add_argument("--token", default=None,
                            help="worker token (visible in the process list: prefer --token-file or $WORKER_TOKEN)")
        parser.add_argument("--token-file", default=None,
                            help="a file holding the worker token (a trailing newline is stripped); "
                                 "used when --token is not given")
        parser.add_argument("--models-dir", default=os.environ.get("MODELS_DIR")
                            or getattr(settings, "MODELS_DIR", None) or str(Path(settings.BASE_DIR) / "models"),
                            help="folder of installed models, DIR/*/manifest.json (default: $MODELS_DIR or models/)")
        parser.add_argument("--models", default=None, help="serve only these model ids, comma-separated")
        parser.add_argument("--preload", default="all",
                            help="load at start: all (default) the models of --models, none (the API has "
                                 "them loaded when it wants them), or these model ids, comma-separated")
        parser.add_argument("--memory-mode", choices=MEMORY_MODES,
                            default=os.environ.get("MEMORY_MODE") or "auto",
                            help="auto: each model on the highest rung that fits, moved down after an "
                                 "out-of-memory error; or pin one rung (default: $MEMORY_MODE or auto)")
        parser.add_argument("--device", default=None,
                            help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")
        parser.add_argument("--vram-mib", type=_positive_int, default=None,
                            help="a VRAM budget in MiB for the memory ladder: pretend VRAM on a machine "
                                 "without CUDA, a cap on CUDA")
        parser.add_argument("--worker-id", default=None, help="default: HOSTNAME:DEVICE_INDEX")
        parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
        parser.add_argument("--frame-budget-ms", type=_positive_ms, default=None,
                            help="per-frame p95 budget that realtime slots are sized to "
                                 "(default: $FRAME_BUDGET_MS or 500)")
        parser.add_argument("--no-realtime", action="store_true",
                            help="skip the frame measurement at load and serve no live sessions")
        parser.add_argument("--max-batch", type=_positive_int, default=None,
                            help="at most N realtime frames per pipeline call (default: the model's slots); "
                                 "1 turns batching off")
        parser.add_argument("--drain-seconds", type=_positive_seconds, default=30.0,
                            help="on SIGTERM: say draining, give back held jobs (with their checkpoints) and "
                                 "sessions, and exit 0 within this many seconds (default 30); exit 1 if the "
                                 "deadline passes first, 2 on a second SIGTERM")

    def handle(self, *args: Any, **options: Any) -> None:
        # Imported here: the worker program is not part of the API process.
        from gpuworker.connection import TokenRefused, resolve_token
        from gpuworker.installed import parse_model_ids
        from gpuworker.main import WorkerOptions, WorkerStartError, parse_preload, run_worker
        from gpuworker.slots import frame_budget_ms_from_env

        try:  # --token, then --token-file, then WORKER_TOKEN
            token = resolve_token(token=options["token"], token_file=options["token_file"], environ=os.environ)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        try:
            preload = parse_preload(options["preload"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        budget_ms = options["frame_budget_ms"]
        if budget_ms is None:
            try:
                budget_ms = frame_budget_ms_from_env()
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        worker_options = WorkerOptions(
            api=options["api"], token=token, models_dir=Path(options["models_dir"]),
            models=parse_model_ids(options["models"]), memory_mode=options["memory_mode"],
            device=options["device"], vram_mib=options["vram_mib"], worker_id=options["worker_id"],
            threads=options["threads"], frame_budget_ms=budget_ms, realtime=not options["no_realtime"],
            max_batch=options["max_batch"], drain_seconds=options["drain_seconds"], preload=preload)
        try:
            status = run_worker(worker_options)
        except (WorkerStartError, TokenRefused) as exc:
            raise CommandError(str(exc)) from exc
        if status:
            raise SystemExit(status)
