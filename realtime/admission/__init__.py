"""Admission of realtime sessions: one SessionAdmission interface, two backends chosen once at
start: local.py (one API process: the queue and the slots in its board) and shared.py (several API
processes: the queue and the slots in PostgreSQL). The shared story: docs/design/shared-admission.md."""
from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any, Protocol

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone

from potocolom.protocol.worker import ModelEntry
from potocolom.runtime import Slot, runtime
from realtime.admission.local import LocalAdmission
from realtime.admission.shared import SharedAdmission
from realtime.board import SessionBoard
from realtime.models import RealtimeSession
from realtime.policy import Placement, QueueKey, SlotKey


class SessionAdmission(Protocol):
    """Who gets a realtime slot, and what each event does to the queue. `board` is this process's
    view of the sessions whose browser sockets it holds (and of every session's route)."""

    board: SessionBoard

    def load(self, *, now: datetime) -> None: ...

    def join(self, *, account: User, model_id: str, params: dict[str, int], channel_name: str,
             now: datetime) -> RealtimeSession: ...

    def close(self, *, session_id: str, now: datetime) -> None: ...

    def forget(self, *, session_id: str) -> None:
        """This process no longer holds the session's socket (no database: its close failed, and the
        sweep closes its row once nobody vouches for it)."""
        ...

    def end(self, *, session_id: str, now: datetime) -> bool: ...

    def admit(self, *, now: datetime, joined: Collection[str] = (), left: Collection[QueueKey] = ()) -> list[Placement]:
        """First fit; `joined`/`left`: the sessions this event put into the queue or took out of it
        (what positions move by)."""
        ...

    def accept(self, *, worker_id: str, session_id: str, channel_name: str, now: datetime) -> bool: ...

    def refuse(self, *, worker_id: str, session_id: str, now: datetime) -> bool: ...

    def end_on_worker(self, worker_id: str | None, session_id: str, channel: str | None = None) -> None: ...

    def sweep(self, *, now: datetime) -> None: ...

    def worker_joined(self, *, worker_id: str, channel_name: str, models: list[ModelEntry], previous_channel: str,
                      now: datetime) -> None: ...

    def worker_lost(self, *, worker_id: str, channel_name: str, still_current: bool, now: datetime) -> None: ...

    def worker_rung_changed(self, *, worker_id: str, entry: ModelEntry, channel_name: str,
                            now: datetime) -> None: ...

    def positions(self) -> dict[str, int]: ...

    def free(self) -> dict[SlotKey, int]: ...

    def snapshot(self) -> dict[str, Any]: ...

    def release(self) -> None: ...


def shared_admission_configured() -> bool:
    """Admission is shared when the job queue is (JOB_QUEUE=redis) and the database is PostgreSQL (its
    advisory locks serialize admission). Otherwise each process admits alone, as with one process."""
    return bool(settings.JOB_QUEUE == "redis") and connection.vendor == "postgresql"


def _make_admission() -> SessionAdmission:
    return SharedAdmission() if shared_admission_configured() else LocalAdmission()


# Stopping it lets go of its locks (the shared admission's advisory locks).
ADMISSION: Slot[SessionAdmission] = Slot("realtime.admission", make=_make_admission,
                                         stop=lambda current: current.release())


def _current() -> SessionAdmission:
    return runtime.get(ADMISSION)


def admission() -> SessionAdmission:
    """This process's admission, chosen on first use and loaded from the database (sync code only)."""
    current = _current()
    current.load(now=timezone.now())
    return current


def board() -> SessionBoard:
    """This process's board, without touching the database (for the event loop's frame path)."""
    return _current().board
