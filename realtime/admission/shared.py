"""The shared admission: several API processes (JOB_QUEUE=redis, PostgreSQL) admit as one. The queue,
the slots and the positions told live in the rows; admissions follow one another under an advisory
lock; each process keeps its own browsers' frames and routes in its board. docs/design/shared-admission.md."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from potocolom.protocol.browser import Live, Queued
from potocolom.protocol.events import SessionBack, SessionLive, SessionsMoved
from potocolom.protocol.events import SessionEnd as SessionEndEvent
from potocolom.protocol.worker import ModelEntry, SessionEnd, SessionStart
from potocolom.transport import relay
from potocolom.transport.notify import notify_after_commit, socket_event, to_socket_after_commit
from realtime import policy
from realtime.admission.places import QueuePlaces
from realtime.admission.presence import Presence, admission_lock, alive_processes
from realtime.board import SessionBoard, SessionEntry
from realtime.errors import SessionLimitReached
from realtime.models import HOLDING_STATES, OPEN_STATES, RealtimeSession, SessionState
from realtime.policy import Placement, QueuedSession, QueueKey, SlotKey
from realtime.records import session_row_close, sessions_unseen_close, to_microseconds, usage_close, usage_open
from workers import selectors as worker_rows

log = logging.getLogger(__name__)
HEAD_CHUNK = 64  # queued sessions of one model read at a time by first fit
MOVES_SEQUENCE = "realtime_queue_moves"  # numbers each admission's queue moves (migration 0004)


def worker_window_seconds() -> float:
    """A worker seen longer ago than this is dead (3 silent heartbeat periods, noticed within 4)."""
    return 4 * settings.WORKER_HEARTBEAT_SECONDS


def presence_grace_seconds() -> float:
    """After a PostgreSQL restart, no process counts as dead for lacking its presence lock for this
    long: the restart took every process's lock, and each takes it again at its next sweep tick
    (every SESSION_SWEEP_SECONDS) or browser join."""
    return 2 * settings.SESSION_SWEEP_SECONDS


def resume_window() -> timedelta:
    """How long after its process was found gone a session keeps its place for its browser: the
    contract's dead-worker window (4 heartbeat periods), which a worker whose API process died also
    gets to come back and keep its jobs."""
    return timedelta(seconds=worker_window_seconds())


def capacities(now: datetime) -> tuple[dict[SlotKey, int], dict[str, str]]:
    """The realtime slots of every connected worker of every process, and each worker's channel."""
    budget = settings.FRAME_BUDGET_MS
    capacity: dict[SlotKey, int] = {}
    channels: dict[str, str] = {}
    for worker in worker_rows.connected_workers(seconds=worker_window_seconds(), now=now):
        channels[worker.worker_id] = worker.channel_name
        if worker.draining:
            continue  # a draining worker gives no slot: its sessions went back to the queue
        for entry in worker.models:
            capacity[(worker.worker_id, entry.model_id)] = policy.model_slots(
                realtime=entry.realtime, frame_ms_p95=entry.frame_ms_p95, realtime_slots=entry.realtime_slots,
                frame_budget_ms=budget)
    return capacity, channels


class SharedAdmission:
    """SessionAdmission for several API processes on one PostgreSQL database."""

    def __init__(self) -> None:
        self.board = SessionBoard()
        self.presence = Presence()
        self.places = QueuePlaces(self.board.own_browser)
        relay.listen(SessionsMoved.type, self._moved)

    def load(self, *, now: datetime) -> None:
        """Nothing to load: the other processes' sessions are alive (the sweep closes orphans)."""

    def end_on_worker(self, worker_id: str | None, session_id: str, channel: str | None = None) -> None:
        channel = channel or worker_rows.channel_of(worker_id)
        if channel:
            to_socket_after_commit(channel, SessionEnd(session_id).to_wire())

    # admission

    def admit(self, *, now: datetime, joined: Collection[str] = (), left: Collection[QueueKey] = ()) -> list[Placement]:
        """First fit under the admission lock, reading only the slots and, for a model with a free
        slot, its queue's head; then the queue's moves (`left`: keys of sessions that left the queue,
        `joined`: ids of sessions that entered it, with this round's placements) go out to every
        process as one notice, numbered. session_start and the notice go out after the commit."""
        with transaction.atomic():
            admission_lock()
            placed, placed_keys = self._first_fit(now)
            taken = {p.session_id for p in placed}
            entered: list[tuple[tuple[int, str], int]] = []
            for session_id in [s for s in dict.fromkeys(joined) if s not in taken]:
                row = RealtimeSession.objects.filter(id=session_id, state=SessionState.QUEUED) \
                    .values_list("joined_at", flat=True).first()
                if row is not None:
                    ahead = RealtimeSession.objects.filter(state=SessionState.QUEUED).filter(
                        Q(joined_at__lt=row) | Q(joined_at=row, id__lt=session_id)).count()
                    entered.append(((to_microseconds(row), str(session_id)), ahead + 1))
            gone = [(key[0], key[1]) for key in left] + [(key[0], key[1]) for key in placed_keys
                                                         if key[1] not in set(map(str, joined))]
            if gone or entered:
                with connection.cursor() as cursor:
                    cursor.execute(f"SELECT nextval('{MOVES_SEQUENCE}')")
                    seq = int(cursor.fetchone()[0])
                moves = SessionsMoved(seq, tuple(gone), tuple(entered)).to_event()
                transaction.on_commit(lambda: relay.notify_all_sync(SessionsMoved.type, moves))
        return placed

    def _first_fit(self, now: datetime) -> tuple[list[Placement], list[QueueKey]]:
        """The pure first fit, fed only what it needs: the slots held and offered, and for each model
        with a free slot the head of its queue, read in order a chunk at a time until its slots are
        given (a session refused by every free worker is passed over)."""
        capacity, channels = capacities(now)
        held = RealtimeSession.objects.filter(state__in=HOLDING_STATES, worker_id__isnull=False) \
            .values_list("worker_id", "model_id")
        free = {key: n for key, n in policy.free_slots(capacity, [(w, m) for w, m in held if w]).items() if n > 0}
        placed: list[Placement] = []
        keys: list[QueueKey] = []
        for model_id in sorted({m for _, m in free}):
            room = {key: n for key, n in free.items() if key[1] == model_id}
            start = 0
            while any(room.values()):
                rows = list(RealtimeSession.objects.filter(state=SessionState.QUEUED, model_id=model_id)
                            .order_by("joined_at", "id").values_list("id", "joined_at", "refused_by", "channel_name",
                                                                     "params")[start:start + HEAD_CHUNK])
                if not rows:
                    break
                start += len(rows)
                by_id = {str(row[0]): row for row in rows}
                queued = [QueuedSession(sid, model_id, to_microseconds(row[1]), frozenset(row[2] or ()))
                          for sid, row in by_id.items()]
                for placement in policy.first_fit(queued, room):
                    if RealtimeSession.objects.filter(id=placement.session_id, state=SessionState.QUEUED).update(
                            state=SessionState.PLACING, worker_id=placement.worker_id, told_position=None,
                            placements=F("placements") + 1) != 1:
                        continue  # closed meanwhile
                    room[(placement.worker_id, model_id)] -= 1
                    row = by_id[placement.session_id]
                    placed.append(placement)
                    keys.append((to_microseconds(row[1]), placement.session_id))
                    start -= 1  # it left the queue: the next chunk starts one row earlier
                    start_message = SessionStart(placement.session_id, placement.model_id, dict(row[4] or {}))
                    # the browser's channel goes along: the worker's process routes frame results by it
                    to_socket_after_commit(channels[placement.worker_id], start_message.to_wire(), browser=row[3])
        return placed, keys

    def _moved(self, message: dict[str, Any]) -> None:
        """News of an admission's queue moves (any process's): tell this process's browsers whose
        position changed."""
        relay.deliver_local_many((browser, socket_event(Queued(position).to_wire()))
                                 for browser, position in self.places.moved(SessionsMoved.parse(message)))

    def _resync(self) -> None:
        """The sweep's correction of news lost on the way (the bus is at most once): this process's
        queued sessions' positions read from the queue, as of the latest move (under the lock, so
        no move is half counted)."""
        own = self.board.own_sessions()
        if not own:
            return
        with transaction.atomic():
            admission_lock()
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT last_value, is_called FROM {MOVES_SEQUENCE}")
                last, called = cursor.fetchone()
                cursor.execute("SELECT id, joined_at, place FROM (SELECT id, joined_at, row_number() OVER "
                               "(ORDER BY joined_at, id) AS place FROM realtime_realtimesession WHERE state = %s) q "
                               "WHERE id = ANY(%s)", [SessionState.QUEUED, [uuid.UUID(s) for s in own]])
                rows = cursor.fetchall()
        positions = {str(sid): ((to_microseconds(joined), str(sid)), int(place)) for sid, joined, place in rows}
        told = self.places.resync(positions, as_of=int(last) if called else 0)
        relay.deliver_local_many((browser, socket_event(Queued(position).to_wire())) for browser, position in told)

    # joining and leaving

    def join(self, *, account: User, model_id: str, params: dict[str, int], channel_name: str,
             now: datetime) -> RealtimeSession:
        """Open a session in the global queue unless the account holds ACCOUNT_SESSION_LIMIT open
        sessions on any process. Sessions whose process died first close (their sockets are gone); a
        browser coming back from one of them takes its place (`_resume_place`)."""
        key = self.presence.ensure()
        session_id = uuid.uuid4()
        with transaction.atomic():
            User.objects.select_for_update().filter(pk=account.pk).values_list("pk", flat=True).first()
            orphans, left = self._close_orphans(RealtimeSession.objects.filter(account=account), now=now)
            held = RealtimeSession.objects.filter(account=account, state__in=OPEN_STATES).count()
            if held >= settings.ACCOUNT_SESSION_LIMIT:
                raise SessionLimitReached(f"the account already holds {held} sessions")
            joined = self._resume_place(account=account, model_id=model_id, params=params, session_id=session_id,
                                        now=now) or now
            session = RealtimeSession.objects.create(id=session_id, account=account, model_id=model_id,
                                                     params=params, joined_at=joined, channel_name=channel_name,
                                                     api_process=key, seen_at=now)
        for worker_id, ended_id in orphans:
            self.end_on_worker(worker_id, ended_id)
        self.board.add(SessionEntry(str(session.id), account.pk, model_id, to_microseconds(joined), params),
                       browser=channel_name)
        self.admit(now=now, joined=[str(session.id)], left=left)
        return session

    def _resume_place(self, *, account: User, model_id: str, params: dict[str, int], session_id: uuid.UUID,
                      now: datetime) -> datetime | None:
        """Inside the join's transaction (the account's row locked): the place (first join time) that
        the new session `session_id` takes from a session of the account that died with its process
        (the pure rule, policy.place_to_resume), which is marked resumed by it; None when there is
        none."""
        window = resume_window()
        gone = [policy.GoneSession(str(sid), account.pk, model, dict(old or {}), joined, orphaned)
                for sid, model, old, joined, orphaned in RealtimeSession.objects.filter(
                    account=account, model_id=model_id, state=SessionState.CLOSED, resumed_by__isnull=True,
                    orphaned_at__gte=now - window).values_list("id", "model_id", "params", "joined_at", "orphaned_at")
                if orphaned is not None]
        while (chosen := policy.place_to_resume(gone, account_id=account.pk, model_id=model_id, params=params,
                                                now=now, window=window)) is not None:
            if RealtimeSession.objects.filter(id=chosen.session_id, resumed_by__isnull=True).update(
                    resumed_by=session_id) == 1:
                log.info("session %s takes the place of session %s, whose API process died", session_id,
                         chosen.session_id)
                return chosen.joined_at
            gone = [g for g in gone if g.session_id != chosen.session_id]
        return None

    def _close_orphans(self, sessions: Any, *, now: datetime,
                       resumable: bool = True) -> tuple[list[tuple[str | None, str]], list[QueueKey]]:
        """Close the open sessions (of the queryset `sessions`) whose process is gone, noting when (their
        browsers' reconnects may take their places, unless not `resumable`), then those whose socket is
        gone though their process lives (`_close_unseen`); the (worker, session) pairs that held a slot,
        whose workers must get session_end after the commit, and the queue keys of those that were
        queued."""
        if worker_rows.database_up_for_less_than(seconds=presence_grace_seconds(), now=now):
            return [], []  # the processes are taking their presence locks back after a restart of the database
        alive = alive_processes()
        ended: list[tuple[str | None, str]] = []
        left: list[QueueKey] = []
        for session_id, state, worker_id, joined_at in sessions.filter(state__in=OPEN_STATES).exclude(
                api_process__in=alive).values_list("id", "state", "worker_id", "joined_at"):
            if state == SessionState.QUEUED:
                left.append((to_microseconds(joined_at), str(session_id)))
            if resumable:
                RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).update(orphaned_at=now)
            session_row_close(session_id=str(session_id), now=now)
            if state in HOLDING_STATES:
                ended.append((worker_id, str(session_id)))
        if ended or left:
            log.info("closed %d sessions of API processes that are gone", len(ended) + len(left))
        unseen_ended, unseen_left = self._close_unseen(sessions, now=now)
        return ended + unseen_ended, left + unseen_left

    def _close_unseen(self, sessions: Any, *, now: datetime) -> tuple[list[tuple[str | None, str]], list[QueueKey]]:
        """Close the open sessions (of `sessions`) that no process has vouched for within the bound,
        whichever process holds them: their sockets closed but their rows did not (the close failed).
        A process vouches for its own sockets' rows at each of its sweep ticks, so another live
        process's sessions stay open. As `_close_orphans`, without a place to resume."""
        seen_before = policy.unseen_before(now, sweep_seconds=settings.SESSION_SWEEP_SECONDS)
        closed = sessions_unseen_close(sessions.exclude(id__in=self.board.own_sessions()), seen_before=seen_before,
                                       now=now)
        if closed:
            log.warning("closed %d sessions whose browser sockets are gone", len(closed))
        return ([(gone.worker_id, gone.session_id) for gone in closed if gone.state in HOLDING_STATES],
                [(to_microseconds(gone.joined_at), gone.session_id) for gone in closed
                 if gone.state == SessionState.QUEUED])

    def forget(self, *, session_id: str) -> None:
        self.board.remove(session_id)
        self.places.forget(session_id)

    def close(self, *, session_id: str, now: datetime) -> None:
        """The browser socket closed: the row closes; a worker holding it gets session_end."""
        _, route = self.board.remove(session_id)
        self.places.forget(session_id)
        with transaction.atomic():
            row = RealtimeSession.objects.select_for_update().filter(id=session_id, state__in=OPEN_STATES) \
                .values_list("state", "worker_id", "joined_at").first()
            session_row_close(session_id=session_id, now=now)
        if row is not None and row[0] in HOLDING_STATES:
            self.end_on_worker(row[1], session_id, route.worker if route else None)
        if row is not None and row[0] == SessionState.QUEUED:
            self.admit(now=now, left=[(to_microseconds(row[2]), session_id)])
        elif row is not None and row[0] in HOLDING_STATES:  # (an idle session frees nothing)
            self.admit(now=now)

    def end(self, *, session_id: str, now: datetime) -> bool:
        """Operators: end a session. Its socket's process closes it; a session whose process is gone
        closes at once."""
        row = RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES) \
            .values_list("channel_name", "api_process").first()
        if row is None:
            return False
        if row[0] and row[1] in alive_processes():
            notify_after_commit(row[0], SessionEndEvent().to_event())
            return True
        with transaction.atomic():
            ended, left = self._close_orphans(RealtimeSession.objects.filter(id=session_id), now=now,
                                              resumable=False)
            session_row_close(session_id=session_id, now=now)
        for worker_id, sid in ended:
            self.end_on_worker(worker_id, sid)
        self.admit(now=now, left=left)
        return True

    # on the worker's side

    def accept(self, *, worker_id: str, session_id: str, channel_name: str, now: datetime) -> bool:
        """The worker took the session: live, metering starts, and the browser's process is told
        (`session.live`, with this worker's channel and the placement's number). A stale accept gets
        session_end. An accept of a session already live on this worker changes nothing: the worker
        answered a session_start sent again (placed, sent back by a newer connection's hello and placed
        there again), and it holds the session; a session_end would leave its browser told `live`
        and never answered."""
        with transaction.atomic():
            row = RealtimeSession.objects.select_for_update().filter(
                id=session_id, worker_id=worker_id, state__in=(SessionState.PLACING, SessionState.LIVE)).values_list(
                "account_id", "model_id", "channel_name", "placements", "state").first()
            if row is not None and row[4] == SessionState.PLACING:
                RealtimeSession.objects.filter(id=session_id).update(state=SessionState.LIVE, live_since=now)
                usage_open(account_id=row[0], model_id=row[1], session_id=session_id, worker_id=worker_id, now=now)
        if row is None:
            self.end_on_worker(worker_id, session_id, channel_name)
            return False
        if row[4] == SessionState.LIVE:
            log.info("session %s: a repeated session_accepted from worker %s (already live there)", session_id,
                     worker_id)
            return True
        notify_after_commit(row[2], SessionLive(channel_name, Live(row[1], worker_id).to_wire(), worker_id, row[3])
                            .to_event())
        return True

    def refuse(self, *, worker_id: str, session_id: str, now: datetime) -> bool:
        """That placement failed: the session waits at its old place, not offered to that worker again."""
        with transaction.atomic():
            refused = RealtimeSession.objects.select_for_update().filter(
                id=session_id, worker_id=worker_id, state=SessionState.PLACING).values_list(
                "refused_by", flat=True).first()
            if refused is None:
                return False
            RealtimeSession.objects.filter(id=session_id).update(
                state=SessionState.QUEUED, worker_id=None, refused_by=sorted({*refused, worker_id}))
        self.admit(now=now, joined=[session_id])
        return True

    def _send_back(self, *, now: datetime, end_on: str | None = None, **which: Any) -> None:
        """The sessions (filtered by `which`) that hold a slot go back to the queue at their old places;
        metering stops; each browser's process hears `session.back`; admission runs."""
        with transaction.atomic():
            rows = list(RealtimeSession.objects.select_for_update().filter(state__in=HOLDING_STATES, **which)
                        .values_list("id", "channel_name", "placements"))
            RealtimeSession.objects.filter(id__in=[row[0] for row in rows]).update(
                state=SessionState.QUEUED, worker_id=None, live_since=None, told_position=None)
            for row in rows:
                usage_close(session_id=str(row[0]), now=now)
        for session_id, channel, placement in rows:
            if channel:
                notify_after_commit(channel, SessionBack(placement).to_event())
            if end_on:
                to_socket_after_commit(end_on, SessionEnd(str(session_id)).to_wire())
        self.admit(now=now, joined=[str(row[0]) for row in rows])

    def worker_joined(self, *, worker_id: str, channel_name: str, models: list[ModelEntry], previous_channel: str,
                      now: datetime) -> None:
        """A worker's hello (its row holds its channel and model entries by now): its earlier refusals
        are forgotten, sessions an earlier connection of it held go back to the queue (a new
        connection starts afresh), and admission runs."""
        with transaction.atomic():
            for session_id, refused in RealtimeSession.objects.filter(
                    state=SessionState.QUEUED, refused_by__contains=[worker_id]).values_list("id", "refused_by"):
                RealtimeSession.objects.filter(id=session_id).update(refused_by=[w for w in refused if w != worker_id])
        if previous_channel and previous_channel != channel_name:
            self._send_back(now=now, worker_id=worker_id)
        else:
            self.admit(now=now)

    def worker_lost(self, *, worker_id: str, channel_name: str, still_current: bool, now: datetime) -> None:
        """A worker connection closed: unless a newer one took over (on any process: `still_current`
        is false then), its sessions go back to the queue."""
        if still_current:
            self._send_back(now=now, worker_id=worker_id)

    def worker_rung_changed(self, *, worker_id: str, entry: ModelEntry, channel_name: str, now: datetime) -> None:
        """After a demotion to no slots, the model's sessions on that worker go back and get
        session_end. (The worker's row holds the new entry by now: admission reads the slots there.)"""
        slots = policy.model_slots(realtime=entry.realtime, frame_ms_p95=entry.frame_ms_p95,
                                   realtime_slots=entry.realtime_slots, frame_budget_ms=settings.FRAME_BUDGET_MS)
        if slots > 0:
            self.admit(now=now)
            return
        self._send_back(now=now, end_on=channel_name or worker_rows.channel_of(worker_id), worker_id=worker_id,
                        model_id=entry.model_id)

    # the sweep, in one process at a time

    def sweep(self, *, now: datetime) -> None:
        """In the process holding the sweep lock: refusals are forgotten, sessions of dead processes
        close, sessions held by workers no process has seen within the dead-worker window go back,
        and admission runs."""
        self._resync()
        if not self.presence.try_lead():
            return
        RealtimeSession.objects.filter(state=SessionState.QUEUED).exclude(refused_by=[]).update(refused_by=[])
        with transaction.atomic():
            ended, left = self._close_orphans(RealtimeSession.objects.all(), now=now)
        for worker_id, session_id in ended:
            self.end_on_worker(worker_id, session_id)
        stale = worker_rows.silent_ids(seconds=worker_window_seconds(), now=now)
        if stale and RealtimeSession.objects.filter(state__in=HOLDING_STATES, worker_id__in=stale).exists():
            self._send_back(now=now, worker_id__in=stale)
            if left:
                self.admit(now=now, left=left)
        else:
            self.admit(now=now, left=left)

    # what operators see

    def positions(self) -> dict[str, int]:
        queued = [QueuedSession(str(sid), model_id, to_microseconds(joined))
                  for sid, model_id, joined in RealtimeSession.objects.filter(state=SessionState.QUEUED)
                  .values_list("id", "model_id", "joined_at")]
        return policy.positions(queued)

    def free(self) -> dict[SlotKey, int]:
        capacity, _ = capacities(timezone.now())
        held = RealtimeSession.objects.filter(state__in=HOLDING_STATES).values_list("worker_id", "model_id")
        return policy.free_slots(capacity, [(w, m) for w, m in held if w])

    def snapshot(self) -> dict[str, Any]:
        """The global queue in order with positions; per connected worker its slots and sessions."""
        places = self.positions()
        rows = list(RealtimeSession.objects.filter(state__in=(SessionState.QUEUED, *HOLDING_STATES))
                    .values_list("id", "model_id", "account_id", "state", "worker_id"))
        queued = sorted((places[str(sid)], str(sid), model_id, account_id)
                        for sid, model_id, account_id, state, _ in rows if state == SessionState.QUEUED)
        queue = [{"session_id": sid, "model_id": model_id, "position": place, "account_id": account_id}
                 for place, sid, model_id, account_id in queued]
        capacity, _ = capacities(timezone.now())
        free_now = policy.free_slots(capacity, [(w, m) for _, m, _, s, w in rows if s in HOLDING_STATES and w])
        workers: dict[str, Any] = {}
        for (worker_id, model_id), count in sorted(capacity.items()):
            entry = workers.setdefault(worker_id, {"slots": [], "sessions": [
                {"session_id": str(sid), "model_id": m, "state": s} for sid, m, _, s, w in rows
                if w == worker_id and s in HOLDING_STATES]})
            entry["slots"].append({"model_id": model_id, "slots": count,
                                   "free": free_now.get((worker_id, model_id), 0)})
        return {"sessions": queue, "workers": workers}

    def release(self) -> None:
        """Let go of this process's presence and sweep locks."""
        self.presence.close()
