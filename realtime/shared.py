"""One admission for several API processes (REDIS_URL set, PostgreSQL): the database is the truth.

With one API process the session board (state.py) holds the queue and the slots. With several,
a browser on one process must get a slot on a worker connected to another, so the queue, the slots
and the positions told live in PostgreSQL rows:

- a RealtimeSession row carries its browser socket's channel, the key of the process holding that
  socket (presence.py), the workers that refused it, the position it was last told, and the count
  of its placements;
- a Worker row carries its socket's channel and the hello's model entries (slots per model); a
  worker counts while it was seen within the dead-worker window (scheduling.services.worker_seen).

`admit` runs in one transaction holding an advisory lock, so admissions of all processes follow one
another: it reads the queued sessions, the held slots and the capacities, applies the pure first fit
(admission.py), moves the chosen rows to placing, and after the commit sends `session_start` to each
worker's channel (with the browser's channel, for frame_result routing) and the new positions to the
browsers. The process holding a browser socket keeps the rest (the newest pending frame, the live
worker's channel, idleness) in its own board, told by `session.live` and `session.back` events.
The channel layer carries messages between processes; relay.send keeps local ones in memory.

When a process dies, its sessions close (at their account's next join, or by the sweep), and each
browser's reconnect to another process takes back the place of its session (`place_to_resume`).
"""
from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from potocolom.database import server_started_at, silence_cutoff, up_for_less_than
from realtime import admission
from realtime import services as common
from realtime.admission import Placement, QueuedSession, SlotKey
from realtime.errors import SessionLimitReached
from realtime.models import HOLDING_STATES, OPEN_STATES, RealtimeSession, SessionState, UsageRecord
from realtime.presence import admission_lock, alive_processes, get_presence
from realtime.state import SessionEntry
from scheduling.services import send_to_channel, send_to_worker
from workers.models import Worker

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Admission is shared when the job queue is (REDIS_URL) and the database is PostgreSQL (its
    advisory locks serialize admission). Otherwise each process admits alone, as with one process."""
    return bool(settings.JOB_QUEUE == "redis") and connection.vendor == "postgresql"


# --- workers and their slots ---------------------------------------------------------------------

def worker_window(now: datetime) -> datetime:
    """A worker seen before this is dead (3 silent heartbeat periods, noticed within 4), counted
    while the database could hear it: just after a restart of PostgreSQL, no one is."""
    return silence_cutoff(now, 4 * settings.WORKER_HEARTBEAT_SECONDS)


def presence_grace() -> float:
    """Seconds after a PostgreSQL restart during which no process counts as dead for lacking its
    presence lock: the restart took every process's lock, and each takes it again at its next
    sweep tick (every SESSION_SWEEP_SECONDS) or browser join."""
    return 2 * settings.SESSION_SWEEP_SECONDS


def capacities(now: datetime) -> tuple[dict[SlotKey, int], dict[str, str]]:
    """The realtime slots of every connected worker of every process, and each worker's channel."""
    budget = settings.FRAME_BUDGET_MS
    capacity: dict[SlotKey, int] = {}
    channels: dict[str, str] = {}
    for worker_id, channel, served in Worker.objects.filter(
            connected=True, last_seen__gte=worker_window(now)).exclude(channel_name="").values_list(
            "worker_id", "channel_name", "served_models"):
        channels[worker_id] = channel
        for entry in served or ():
            capacity[(worker_id, entry["model_id"])] = admission.model_slots(
                realtime=bool(entry.get("realtime")), frame_ms_p95=entry.get("frame_ms_p95"),
                realtime_slots=int(entry.get("realtime_slots") or 0), frame_budget_ms=budget)
    return capacity, channels


def worker_channel(worker_id: str | None) -> str | None:
    if not worker_id:
        return None
    return Worker.objects.filter(worker_id=worker_id).exclude(channel_name="") \
        .values_list("channel_name", flat=True).first()


def end_on_worker(worker_id: str | None, session_id: str, channel: str | None = None) -> None:
    channel = channel or worker_channel(worker_id)
    if channel:
        send_to_worker(channel, {"type": "session_end", "session_id": session_id})


# --- admission -----------------------------------------------------------------------------------

def admit() -> list[Placement]:
    """First fit over the global queue under the admission lock; session_start and positions go
    out after the commit."""
    starts: list[tuple[str, dict[str, Any]]] = []
    told: list[tuple[str, int]] = []
    now = timezone.now()
    with transaction.atomic():
        admission_lock()
        rows = {str(row[0]): row for row in RealtimeSession.objects.filter(
            state__in=(SessionState.QUEUED, *HOLDING_STATES)).values_list(
            "id", "state", "model_id", "joined_at", "worker_id", "refused_by", "told_position", "channel_name",
            "params")}
        queued = [QueuedSession(sid, row[2], common.to_microseconds(row[3]), frozenset(row[5] or ()))
                  for sid, row in rows.items() if row[1] == SessionState.QUEUED]
        held = [(row[4], row[2]) for row in rows.values() if row[1] in HOLDING_STATES and row[4]]
        capacity, channels = capacities(now)
        placed = []
        for placement in admission.first_fit(queued, admission.free_slots(capacity, held)):
            if RealtimeSession.objects.filter(id=placement.session_id, state=SessionState.QUEUED).update(
                    state=SessionState.PLACING, worker_id=placement.worker_id, told_position=None,
                    placements=F("placements") + 1) != 1:
                continue  # closed meanwhile
            placed.append(placement)
            row = rows[placement.session_id]
            starts.append((channels[placement.worker_id], {
                "type": "worker.send", "browser": row[7],
                "message": {"type": "session_start", "session_id": placement.session_id,
                            "model_id": placement.model_id, "params": dict(row[8] or {})}}))
        taken = {p.session_id for p in placed}
        changed = []
        for sid, place in admission.positions(q for q in queued if q.session_id not in taken).items():
            if rows[sid][6] != place:
                changed.append(RealtimeSession(id=sid, told_position=place))
                told.append((rows[sid][7], place))
        if changed:
            RealtimeSession.objects.bulk_update(changed, ["told_position"])
    for channel, event in starts:
        send_to_channel(channel, event)
    for channel, position in told:
        if channel:
            common.to_browser(channel, {"type": "state", "state": "queued", "position": position})
    return placed


# --- joining and leaving -------------------------------------------------------------------------

def join(*, account: User, model_id: str, params: dict[str, int], channel_name: str) -> RealtimeSession:
    """Open a session in the global queue unless the account holds ACCOUNT_SESSION_LIMIT open
    sessions on any process. Sessions whose process died first close (their sockets are gone); a
    browser coming back from one of them takes its place (`resume_place`)."""
    key = get_presence().ensure()
    now = timezone.now()
    session_id = uuid.uuid4()
    with transaction.atomic():
        User.objects.select_for_update().filter(pk=account.pk).values_list("pk", flat=True).first()
        orphans = close_orphans(RealtimeSession.objects.filter(account=account))
        held = RealtimeSession.objects.filter(account=account, state__in=OPEN_STATES).count()
        if held >= settings.ACCOUNT_SESSION_LIMIT:
            raise SessionLimitReached(f"the account already holds {held} sessions")
        joined = resume_place(account=account, model_id=model_id, params=params, session_id=session_id,
                              now=now) or now
        session = RealtimeSession.objects.create(id=session_id, account=account, model_id=model_id, params=params,
                                                 joined_at=joined, channel_name=channel_name, api_process=key)
    for worker_id, ended_id in orphans:
        end_on_worker(worker_id, ended_id)
    common.board().add(SessionEntry(str(session.id), account.pk, model_id, common.to_microseconds(joined),
                                    channel_name, params))
    admit()
    return session


def resume_window() -> timedelta:
    """How long after its process was found gone a session keeps its place for its browser: the
    contract's dead-worker window (4 heartbeat periods), which a worker whose API process died also
    gets to come back and keep its jobs (scheduling.services)."""
    return timedelta(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS)


def resume_place(*, account: User, model_id: str, params: dict[str, int], session_id: uuid.UUID,
                 now: datetime) -> datetime | None:
    """Inside the join's transaction (the account's row locked): the place (first join time) that
    the new session `session_id` takes from a session of the account that died with its process
    (the pure rule, admission.place_to_resume), which is marked resumed by it; None when there is
    none."""
    window = resume_window()
    gone = [admission.GoneSession(str(sid), account.pk, model, dict(old or {}), joined, orphaned)
            for sid, model, old, joined, orphaned in RealtimeSession.objects.filter(
                account=account, model_id=model_id, state=SessionState.CLOSED, resumed_by__isnull=True,
                orphaned_at__gte=now - window).values_list("id", "model_id", "params", "joined_at", "orphaned_at")
            if orphaned is not None]
    while (chosen := admission.place_to_resume(gone, account_id=account.pk, model_id=model_id, params=params,
                                               now=now, window=window)) is not None:
        if RealtimeSession.objects.filter(id=chosen.session_id, resumed_by__isnull=True).update(
                resumed_by=session_id) == 1:
            log.info("session %s takes the place of session %s, whose API process died", session_id,
                     chosen.session_id)
            return chosen.joined_at
        gone = [g for g in gone if g.session_id != chosen.session_id]
    return None


def close_orphans(sessions: Any, *, resumable: bool = True) -> list[tuple[str | None, str]]:
    """Close the open sessions (of the queryset `sessions`) whose process is gone, noting when (their
    browsers' reconnects may take their places, unless not `resumable`); the (worker, session) pairs
    that held a slot, whose workers must get session_end after the commit."""
    now = timezone.now()
    if up_for_less_than(now, presence_grace(), server_started_at()):
        return []  # the processes are taking their presence locks back after a restart of the database
    alive = alive_processes()
    ended = []
    for session_id, state, worker_id in sessions.filter(state__in=OPEN_STATES).exclude(
            api_process__in=alive).values_list("id", "state", "worker_id"):
        if resumable:
            RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).update(orphaned_at=now)
        common.close_row(str(session_id), now)
        if state in HOLDING_STATES:
            ended.append((worker_id, str(session_id)))
    if ended:
        log.info("closed %d sessions of API processes that are gone", len(ended))
    return ended


def close(*, session_id: str, channel: str | None) -> None:
    """The browser socket closed: the row closes; a worker holding it gets session_end."""
    now = timezone.now()
    with transaction.atomic():
        row = RealtimeSession.objects.select_for_update().filter(id=session_id, state__in=OPEN_STATES) \
            .values_list("state", "worker_id").first()
        common.close_row(session_id, now)
    if row is not None and row[0] in HOLDING_STATES:
        end_on_worker(row[1], session_id, channel)
    admit()


def end(*, session_id: str) -> bool:
    """Operators: end a session. Its socket's process closes it; a session whose process is gone
    closes at once."""
    row = RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES) \
        .values_list("channel_name", "api_process").first()
    if row is None:
        return False
    if row[0] and row[1] in alive_processes():
        send_to_channel(row[0], {"type": "session.end"})
        return True
    with transaction.atomic():
        ended = close_orphans(RealtimeSession.objects.filter(id=session_id), resumable=False)
        common.close_row(session_id, timezone.now())
    for worker_id, sid in ended:
        end_on_worker(worker_id, sid)
    admit()
    return True


# --- on the worker's side ------------------------------------------------------------------------

def accept(*, worker_id: str, session_id: str, channel_name: str | None) -> bool:
    """The worker took the session: live, metering starts, and the browser's process is told
    (`session.live`, with this worker's channel and the placement's number). A stale accept gets
    session_end."""
    moment = timezone.now()
    with transaction.atomic():
        row = RealtimeSession.objects.select_for_update().filter(
            id=session_id, worker_id=worker_id, state=SessionState.PLACING).values_list(
            "account_id", "model_id", "channel_name", "placements").first()
        if row is not None:
            RealtimeSession.objects.filter(id=session_id).update(state=SessionState.LIVE, live_since=moment)
            UsageRecord.objects.create(account_id=row[0], model_id=row[1], session_id=session_id,
                                       worker_id=worker_id, started_at=moment)
    channel = channel_name or worker_channel(worker_id)
    if row is None:
        end_on_worker(worker_id, session_id, channel)
        return False
    send_to_channel(row[2], {"type": "session.live", "worker_id": worker_id, "worker_channel": channel,
                             "placement": row[3], "message": {"type": "state", "state": "live",
                                                              "model_id": row[1], "worker_id": worker_id}})
    return True


def refuse(*, worker_id: str, session_id: str) -> bool:
    """That placement failed: the session waits at its old place, not offered to that worker again."""
    with transaction.atomic():
        refused = RealtimeSession.objects.select_for_update().filter(
            id=session_id, worker_id=worker_id, state=SessionState.PLACING).values_list("refused_by", flat=True).first()
        if refused is None:
            return False
        RealtimeSession.objects.filter(id=session_id).update(
            state=SessionState.QUEUED, worker_id=None, refused_by=sorted({*refused, worker_id}))
    admit()
    return True


def send_back(*, end_on: str | None = None, **which: Any) -> None:
    """The sessions (filtered by `which`) that hold a slot go back to the queue at their old places;
    metering stops; each browser's process hears `session.back`; admission runs."""
    now = timezone.now()
    with transaction.atomic():
        rows = list(RealtimeSession.objects.select_for_update().filter(state__in=HOLDING_STATES, **which)
                    .values_list("id", "channel_name", "placements"))
        RealtimeSession.objects.filter(id__in=[row[0] for row in rows]).update(
            state=SessionState.QUEUED, worker_id=None, live_since=None, told_position=None)
        for row in rows:
            common.usage_close(str(row[0]), now)
    for session_id, channel, placement in rows:
        if channel:
            send_to_channel(channel, {"type": "session.back", "placement": placement})
        if end_on:
            send_to_worker(end_on, {"type": "session_end", "session_id": str(session_id)})
    admit()


def worker_hello(*, worker_id: str, channel_name: str) -> None:
    """A worker's hello (its Worker row already holds its model entries): its channel is recorded,
    its earlier refusals are forgotten, sessions an earlier connection of it held go back to the
    queue (a new connection starts afresh), and admission runs."""
    with transaction.atomic():
        before = Worker.objects.select_for_update().filter(worker_id=worker_id) \
            .values_list("channel_name", flat=True).first()
        Worker.objects.filter(worker_id=worker_id).update(channel_name=channel_name)
        for session_id, refused in RealtimeSession.objects.filter(
                state=SessionState.QUEUED, refused_by__contains=[worker_id]).values_list("id", "refused_by"):
            RealtimeSession.objects.filter(id=session_id).update(refused_by=[w for w in refused if w != worker_id])
    if before and before != channel_name:
        send_back(worker_id=worker_id)
    else:
        admit()


def worker_dead(*, worker_id: str, channel_name: str) -> None:
    """A worker connection closed: unless a newer one took over (on any process), its sessions go
    back to the queue."""
    if Worker.objects.filter(worker_id=worker_id, channel_name=channel_name).update(channel_name="") == 1:
        send_back(worker_id=worker_id)


def rung_changed(*, worker_id: str, model_id: str, slots: int, channel_name: str | None) -> None:
    """After a demotion to no slots, the model's sessions on that worker go back and get session_end."""
    if slots > 0:
        admit()
        return
    send_back(end_on=channel_name or worker_channel(worker_id), worker_id=worker_id, model_id=model_id)


# --- the sweep, in one process at a time ---------------------------------------------------------

def sweep() -> None:
    """The deployment's sweep: refusals are forgotten, sessions of dead processes close, sessions
    held by workers no process has seen within the dead-worker window go back, and admission runs."""
    now = timezone.now()
    RealtimeSession.objects.filter(state=SessionState.QUEUED).exclude(refused_by=[]).update(refused_by=[])
    with transaction.atomic():
        ended = close_orphans(RealtimeSession.objects.all())
    for worker_id, session_id in ended:
        end_on_worker(worker_id, session_id)
    stale = list(Worker.objects.filter(last_seen__lt=worker_window(now)).values_list("worker_id", flat=True))
    if stale and RealtimeSession.objects.filter(state__in=HOLDING_STATES, worker_id__in=stale).exists():
        send_back(worker_id__in=stale)
    else:
        admit()


# --- what operators see --------------------------------------------------------------------------

def positions() -> dict[str, int]:
    queued = [QueuedSession(str(sid), model_id, common.to_microseconds(joined))
              for sid, model_id, joined in RealtimeSession.objects.filter(state=SessionState.QUEUED)
              .values_list("id", "model_id", "joined_at")]
    return admission.positions(queued)


def free() -> dict[SlotKey, int]:
    capacity, _ = capacities(timezone.now())
    held = RealtimeSession.objects.filter(state__in=HOLDING_STATES).values_list("worker_id", "model_id")
    return admission.free_slots(capacity, [(w, m) for w, m in held if w])


def snapshot() -> dict[str, Any]:
    """The global queue in order with positions; per connected worker its slots and sessions."""
    places = positions()
    rows = list(RealtimeSession.objects.filter(state__in=(SessionState.QUEUED, *HOLDING_STATES))
                .values_list("id", "model_id", "account_id", "state", "worker_id"))
    queued = sorted((places[str(sid)], str(sid), model_id, account_id) for sid, model_id, account_id, state, _ in rows
                    if state == SessionState.QUEUED)
    queue = [{"session_id": sid, "model_id": model_id, "position": place, "account_id": account_id}
             for place, sid, model_id, account_id in queued]
    capacity, _ = capacities(timezone.now())
    free_now = admission.free_slots(capacity, [(w, m) for _, m, _, s, w in rows if s in HOLDING_STATES and w])
    workers: dict[str, Any] = {}
    for (worker_id, model_id), count in sorted(capacity.items()):
        entry = workers.setdefault(worker_id, {"slots": [], "sessions": [
            {"session_id": str(sid), "model_id": m, "state": s} for sid, m, _, s, w in rows
            if w == worker_id and s in HOLDING_STATES]})
        entry["slots"].append({"model_id": model_id, "slots": count, "free": free_now.get((worker_id, model_id), 0)})
    return {"sessions": queue, "workers": workers}
