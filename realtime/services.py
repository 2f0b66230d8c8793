"""Writes of the session path: each state change is a compare-and-set in the database, then the
in-process session board is told, then messages go out to browsers and workers (after the commit).

Services are synchronous; consumers run them with database_sync_to_async. The clock is read by
the callers that face the outside (consumers, the sweeper) and passed in as `now=` (monotonic s).
"""
from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from models_registry.services import registered_manifests
from realtime import admission
from realtime.admission import Placement
from realtime.errors import SessionLimitReached
from realtime.models import HOLDING_STATES, OPEN_STATES, RealtimeSession, SessionState, UsageRecord
from realtime.routing import pick_session_model
from realtime.state import LIVE, PLACING, SessionBoard, SessionEntry, get_board
from scheduling.services import send_to_channel, send_to_worker

# Several API processes share admission through PostgreSQL (realtime/shared.py); the functions below
# hand over to it when `shared_sessions()`. Imported last: shared.py uses this module's helpers.

log = logging.getLogger(__name__)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# One API process: check and insert under one lock; the row lock on the account guards several.
_join_lock = threading.Lock()


def to_microseconds(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def board() -> SessionBoard:
    """This process's board, loaded on first use. A session still open in the database belonged
    to a socket of a process that is gone (sockets do not outlive their process): it is closed
    and its metering stops."""
    current = get_board()
    if not current.loaded:
        with current.lock:
            if not current.loaded and shared_sessions():
                current.loaded = True  # other processes' sessions are alive: the sweep closes orphans
            if not current.loaded:
                now = timezone.now()
                stale = list(RealtimeSession.objects.filter(state__in=OPEN_STATES).values_list("id", flat=True))
                for session_id in stale:
                    close_row(str(session_id), now)
                if stale:
                    log.info("closed %d sessions left open by a previous API process", len(stale))
                current.loaded = True
    return current


def to_browser(channel_name: str, message: dict[str, Any], *, kind: str = "session.send") -> None:
    send_to_channel(channel_name, {"type": kind, "message": message})


# --- joining and leaving -------------------------------------------------------------------------

def session_request(*, query: dict[str, str]) -> tuple[str, dict[str, int]]:
    """The model and params a socket's query asks for (BadQuery, NoModelFits otherwise)."""
    manifest, params = pick_session_model(registered_manifests(), query)
    return manifest.model_id, params


def session_join(*, account: User, model_id: str, params: dict[str, int], channel_name: str) -> RealtimeSession:
    """Open a session in the queue, unless the account already holds ACCOUNT_SESSION_LIMIT open
    sessions (queued ones count): SessionLimitReached. The check and the insert are one step."""
    if shared_sessions():
        return shared.join(account=account, model_id=model_id, params=params, channel_name=channel_name)
    current = board()
    now = timezone.now()
    with _join_lock, transaction.atomic():
        User.objects.select_for_update().filter(pk=account.pk).values_list("pk", flat=True).first()
        held = RealtimeSession.objects.filter(account=account, state__in=OPEN_STATES).count()
        if held >= settings.ACCOUNT_SESSION_LIMIT:
            raise SessionLimitReached(f"the account already holds {held} sessions")
        session = RealtimeSession.objects.create(account=account, model_id=model_id, params=params, joined_at=now,
                                                 channel_name=channel_name)
    current.add(SessionEntry(str(session.id), account.pk, model_id, to_microseconds(now), channel_name, params))
    admit()
    return session


def session_close(*, session_id: str) -> None:
    """The browser socket closed: the session leaves the queue or frees its slot (its worker gets
    session_end), metering stops, and the slot goes to the next session."""
    entry = board().remove(session_id)
    if shared_sessions():
        shared.close(session_id=session_id, channel=entry.worker_channel if entry else None)
        return
    close_row(session_id, timezone.now())
    if entry is not None and entry.state in (PLACING, LIVE):
        _end_on_worker(entry.worker_id, session_id)
    admit()


def close_row(session_id: str, now: datetime) -> None:
    with transaction.atomic():
        RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).update(
            state=SessionState.CLOSED, closed_at=now, worker_id=None)
        usage_close(session_id, now)


def session_end(*, session_id: str) -> bool:
    """Operators: end a session; its browser socket is closed (which frees everything), or the row
    is closed at once when no socket of this process holds it."""
    if shared_sessions():
        return shared.end(session_id=session_id)
    entry = board().get(session_id)
    if entry is not None:
        send_to_channel(entry.channel_name, {"type": "session.end"})
        return True
    closed = RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).exists()
    close_row(session_id, timezone.now())
    return closed


# --- admission -----------------------------------------------------------------------------------

def admit() -> list[Placement]:
    """First fit over the queue; each placement is claimed in the database (queued -> placing) and
    its worker gets session_start. Then every queued browser whose position changed is told."""
    if shared_sessions():
        return shared.admit()
    current = board()
    sent: list[tuple[str, dict[str, Any]]] = []

    def claim(placement: Placement) -> bool:
        channel = current.channel_of(placement.worker_id)
        if channel is None:
            return False
        claimed = RealtimeSession.objects.filter(id=placement.session_id, state=SessionState.QUEUED).update(
            state=SessionState.PLACING, worker_id=placement.worker_id) == 1
        if claimed:
            entry = current.sessions[placement.session_id]
            sent.append((channel, {"type": "session_start", "session_id": placement.session_id,
                                   "model_id": placement.model_id, "params": dict(entry.params)}))
        return claimed

    done = current.plan(claim)
    for channel, message in sent:
        send_to_worker(channel, message)
    tell_positions()
    return [placement for placement, _ in done]


def tell_positions() -> None:
    for channel, position in board().position_changes():
        to_browser(channel, {"type": "state", "state": "queued", "position": position})


def session_accept(*, worker_id: str, session_id: str, now: float, channel_name: str | None = None) -> bool:
    """The worker took the session: live, metering starts, the browser is told, and the newest
    frame kept while it waited goes to the worker. A stale accept gets session_end."""
    if shared_sessions():
        return shared.accept(worker_id=worker_id, session_id=session_id, channel_name=channel_name)
    moment = timezone.now()
    with transaction.atomic():
        accepted = RealtimeSession.objects.filter(id=session_id, worker_id=worker_id, state=SessionState.PLACING) \
            .update(state=SessionState.LIVE, live_since=moment) == 1
        entry = board().go_live(session_id, worker_id=worker_id, now=now) if accepted else None
        if entry is not None:
            UsageRecord.objects.create(account_id=entry.account_id, model_id=entry.model_id, session_id=session_id,
                                       worker_id=worker_id, started_at=moment)
    if entry is None:
        _end_on_worker(worker_id, session_id)
        return False
    to_browser(entry.channel_name, {"type": "state", "state": "live", "model_id": entry.model_id,
                                    "worker_id": worker_id}, kind="session.live")
    frame = board().take_pending(session_id)
    channel = board().channel_of(worker_id)
    if frame is not None and channel:
        send_to_worker(channel, frame)
    return True


def session_refuse(*, worker_id: str, session_id: str, reason: str) -> bool:
    """That placement failed only: another worker with room is tried, or the session waits in the
    queue at its old place."""
    log.info("worker %s refused session %s: %s", worker_id, session_id, reason)
    if shared_sessions():
        return shared.refuse(worker_id=worker_id, session_id=session_id)
    returned = RealtimeSession.objects.filter(id=session_id, worker_id=worker_id, state=SessionState.PLACING) \
        .update(state=SessionState.QUEUED, worker_id=None) == 1
    if returned:
        board().requeue(session_id, refused_by=worker_id)
        admit()
    return returned


def _send_back(session_ids: list[str], *, end_on: str | None = None) -> None:
    """Sessions that lost their slot go back to the queue at their old places; metering stops."""
    now = timezone.now()
    for session_id in session_ids:
        with transaction.atomic():
            RealtimeSession.objects.filter(id=session_id, state__in=HOLDING_STATES).update(
                state=SessionState.QUEUED, worker_id=None, live_since=None)
            usage_close(session_id, now)
        board().requeue(session_id)
        if end_on:
            _end_on_worker(end_on, session_id)
    admit()


def _end_on_worker(worker_id: str | None, session_id: str, channel: str | None = None) -> None:
    if shared_sessions():
        shared.end_on_worker(worker_id, session_id, channel)
        return
    channel = board().channel_of(worker_id)
    if channel:
        send_to_worker(channel, {"type": "session_end", "session_id": session_id})


def usage_close(session_id: str, now: datetime) -> None:
    for record in UsageRecord.objects.filter(session__id=session_id, ended_at__isnull=True):
        seconds = max(0.0, (now - record.started_at).total_seconds())
        UsageRecord.objects.filter(pk=record.pk, ended_at__isnull=True).update(ended_at=now, seconds=seconds)


# --- frames and idleness -------------------------------------------------------------------------

def session_frame(*, session_id: str, frame: dict[str, Any], now: float) -> tuple[str, str | None]:
    """Canvas input (no database on this path unless the session was idle). ('live', worker
    channel) when the frame goes on at once; otherwise it is kept as the newest pending frame."""
    return get_board().frame(session_id, frame, now=now)


def session_wake(*, session_id: str) -> None:
    """A frame on an idle session: it is placed again, or queued at its old place."""
    if board().wake(session_id):
        RealtimeSession.objects.filter(id=session_id, state=SessionState.IDLE).update(state=SessionState.QUEUED)
        admit()


def session_idle_check(*, session_id: str, now: float) -> float | None:
    """Release the session's slot when it is idle (the pure rule); otherwise the seconds until it
    could be. None once it is not live."""
    entry = board().get(session_id)
    if entry is None or entry.state != LIVE or (start := entry.idle_from()) is None:
        return None
    idle_seconds = settings.SESSION_IDLE_SECONDS
    if not admission.is_idle(start, now, idle_seconds):
        return admission.idle_at(start, idle_seconds) - now
    session_release_idle(session_id=session_id)
    return None


def session_release_idle(*, session_id: str) -> bool:
    """No canvas input for SESSION_IDLE_SECONDS: state idle, metering stops, the slot is freed."""
    now = timezone.now()
    with transaction.atomic():
        released = RealtimeSession.objects.filter(id=session_id, state=SessionState.LIVE).update(
            state=SessionState.IDLE, worker_id=None, live_since=None) == 1
        if released:
            usage_close(session_id, now)
    entry = board().get(session_id)
    worker_id = entry.worker_id if entry else None
    worker_channel = entry.worker_channel if entry else None
    if not released or board().go_idle(session_id) is None:
        return False
    _end_on_worker(worker_id, session_id, worker_channel)
    to_browser(entry.channel_name, {"type": "state", "state": "idle"})  # type: ignore[union-attr]
    admit()
    return True


def sessions_sweep(*, now: float) -> None:
    """The periodic sweep: the idle rule for every live session, refusals forgotten, admission.
    (Several API processes: the idle rule for this process's sessions, then the shared sweep.)"""
    current = board()
    for session_id in current.idle_candidates(now=now, idle_seconds=settings.SESSION_IDLE_SECONDS):
        session_release_idle(session_id=session_id)
    if shared_sessions():
        shared.sweep()
        return
    with current.lock:
        for entry in current.sessions.values():
            entry.refused_by.clear()
    admit()


def sessions_tick(*, now: float) -> None:
    """Several API processes, every SESSION_SWEEP_SECONDS in each process with browser sockets: the
    idle rule for its own sessions (it alone sees their input), and the shared sweep in the one
    process that holds the sweep lock."""
    current = board()
    for session_id in current.idle_candidates(now=now, idle_seconds=settings.SESSION_IDLE_SECONDS):
        session_release_idle(session_id=session_id)
    if get_presence().try_lead():
        shared.sweep()


def session_live_here(*, session_id: str, event: dict[str, Any], now: float) -> tuple[bool, dict[str, Any] | None]:
    """Several API processes, in the browser's process: news of going live. (applies?, the newest
    frame kept while it waited, for the worker)."""
    current = get_board()
    entry = current.live_here(session_id, worker_id=event["worker_id"], worker_channel=event["worker_channel"],
                              placement=event["placement"], now=now)
    if entry is None:
        return False, None
    return True, current.take_pending(session_id)


def session_back_here(*, session_id: str, placement: int) -> bool:
    """Several API processes, in the browser's process: its slot was lost; frames wait again."""
    return get_board().back_here(session_id, placement=placement)


def frame_result_route(*, worker_id: str, session_id: str) -> str | None:
    """The browser channel a worker's frame_result goes to (only from the worker holding it)."""
    entry = get_board().get(session_id)
    if entry is None or entry.worker_id != worker_id or entry.state not in (PLACING, LIVE):
        return None
    return entry.channel_name


# --- workers -------------------------------------------------------------------------------------

def worker_slots_set(*, worker_id: str, channel_name: str, models: list[dict[str, Any]]) -> None:
    """A worker's hello: the realtime slots of each model it serves; admission runs."""
    if shared_sessions():
        shared.worker_hello(worker_id=worker_id, channel_name=channel_name)
        return
    budget = settings.FRAME_BUDGET_MS
    slots = {m["model_id"]: admission.model_slots(realtime=m.get("realtime", False), frame_ms_p95=m.get("frame_ms_p95"),
                                                  realtime_slots=m.get("realtime_slots", 0), frame_budget_ms=budget)
             for m in models}
    board().set_worker(worker_id=worker_id, channel_name=channel_name, slots=slots,
                       frame_ms={m["model_id"]: m.get("frame_ms_p95") for m in models})
    admit()


def worker_sessions_return(*, worker_id: str, channel_name: str) -> None:
    """A dead worker: its sessions go back to the queue at their old places."""
    if shared_sessions():
        shared.worker_dead(worker_id=worker_id, channel_name=channel_name)
        return
    held = board().drop_worker(worker_id=worker_id, channel_name=channel_name)
    if held is not None:
        _send_back(held)


def worker_rung_changed(*, worker_id: str, model_id: str, realtime: bool, realtime_slots: int,
                        frame_ms_p95: float | None, channel_name: str | None = None) -> None:
    """After a demotion: a model without realtime sends its sessions on that worker back to the
    queue, and the worker gets session_end for each."""
    current = board()
    if shared_sessions():
        # The worker's row holds the new entry by now (workers.services.worker_rung_set): admission
        # reads the slots from there; a realtime entry without a frame time offers none.
        slots = admission.model_slots(realtime=realtime, frame_ms_p95=frame_ms_p95, realtime_slots=realtime_slots,
                                      frame_budget_ms=settings.FRAME_BUDGET_MS)
        shared.rung_changed(worker_id=worker_id, model_id=model_id, slots=slots, channel_name=channel_name)
        return
    worker = current.workers.get(worker_id)
    if worker is None:
        return
    frame_ms = frame_ms_p95 if frame_ms_p95 is not None else worker.frame_ms.get(model_id)
    slots = admission.model_slots(realtime=realtime, frame_ms_p95=frame_ms, realtime_slots=realtime_slots,
                                  frame_budget_ms=settings.FRAME_BUDGET_MS)
    lost = current.set_model_slots(worker_id=worker_id, model_id=model_id, slots=slots)
    _send_back(lost, end_on=worker_id)


def shared_sessions() -> bool:
    """Whether admission is shared by several API processes (realtime/shared.py)."""
    return shared.enabled()


def queue_positions() -> dict[str, int]:
    """1-based places of the queued sessions (operators)."""
    if shared_sessions():
        return shared.positions()
    entries, _, _ = board().snapshot()
    return admission.positions(e.queued() for e in entries if e.state == SessionState.QUEUED)


def slots_free() -> dict[admission.SlotKey, int]:
    """Free slots per (worker, model) (operators)."""
    return shared.free() if shared_sessions() else board().free()


def session_account(*, user: Any, token: str | None) -> User | None:
    """The account behind a browser socket: its Django session, or an API token in the query."""
    if isinstance(user, User) and user.is_authenticated and user.is_active:
        return user
    if not token or len(token) > 200:
        return None
    from rest_framework.authtoken.models import Token

    found = Token.objects.select_related("user").filter(key=token).first()
    return found.user if found is not None and found.user.is_active else None


from realtime import shared  # noqa: E402  (see the note at the imports)
from realtime.presence import get_presence  # noqa: E402
