"""The local admission: one API process admits alone. The queue, the slots and every session's route
live in its board; the database rows follow each change by compare-and-set."""
from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from potocolom.protocol.browser import Live, Queued
from potocolom.protocol.events import SessionEnd as SessionEndEvent
from potocolom.protocol.events import SessionLive
from potocolom.protocol.worker import ModelEntry, SessionEnd, SessionStart
from potocolom.transport.notify import notify_after_commit, to_socket_after_commit
from realtime import policy
from realtime.board import LIVE, PLACING, QUEUED, SessionBoard, SessionEntry
from realtime.errors import SessionLimitReached
from realtime.models import HOLDING_STATES, OPEN_STATES, RealtimeSession, SessionState
from realtime.policy import Placement, QueueKey, SlotKey
from realtime.records import Unseen, session_row_close, sessions_unseen_close, to_microseconds, usage_close, usage_open

log = logging.getLogger(__name__)


class LocalAdmission:
    """SessionAdmission for one API process."""

    def __init__(self) -> None:
        self.board = SessionBoard()
        self._join_lock = threading.Lock()  # the check and the insert of a join are one step
        self._admit_lock = threading.RLock()  # one admission at a time (not the board's lock)
        self._load_lock = threading.Lock()
        self._loaded = False

    def load(self, *, now: datetime) -> None:
        """Once: a session still open in the database belonged to a socket of a process that is gone
        (sockets do not outlive their process): it is closed and its metering stops."""
        if self._loaded:
            return
        with self._load_lock:
            if self._loaded:
                return
            stale = list(RealtimeSession.objects.filter(state__in=OPEN_STATES).values_list("id", flat=True))
            for session_id in stale:
                session_row_close(session_id=str(session_id), now=now)
            if stale:
                log.info("closed %d sessions left open by a previous API process", len(stale))
            self._loaded = True

    # joining and leaving

    def join(self, *, account: User, model_id: str, params: dict[str, int], channel_name: str,
             now: datetime) -> RealtimeSession:
        with self._join_lock, transaction.atomic():
            User.objects.select_for_update().filter(pk=account.pk).values_list("pk", flat=True).first()
            unseen = self._close_unseen(RealtimeSession.objects.filter(account=account), now=now)
            held = RealtimeSession.objects.filter(account=account, state__in=OPEN_STATES).count()
            if held >= settings.ACCOUNT_SESSION_LIMIT:
                raise SessionLimitReached(f"the account already holds {held} sessions")
            session = RealtimeSession.objects.create(account=account, model_id=model_id, params=params,
                                                     joined_at=now, channel_name=channel_name, seen_at=now)
        self._ended_unseen(unseen)
        self.board.add(SessionEntry(str(session.id), account.pk, model_id, to_microseconds(now), params),
                       browser=channel_name)
        self.admit(now=now)
        return session

    def forget(self, *, session_id: str) -> None:
        self.board.remove(session_id)

    def close(self, *, session_id: str, now: datetime) -> None:
        entry, route = self.board.remove(session_id)
        session_row_close(session_id=session_id, now=now)
        if entry is not None and route is not None and entry.state in (PLACING, LIVE):
            self.end_on_worker(route.worker_id, session_id, route.worker)
        self.admit(now=now)

    def end(self, *, session_id: str, now: datetime) -> bool:
        browser = self.board.browser_of(session_id)
        if browser is not None:
            notify_after_commit(browser, SessionEndEvent().to_event())
            return True
        closed = RealtimeSession.objects.filter(id=session_id, state__in=OPEN_STATES).exists()
        session_row_close(session_id=session_id, now=now)
        return closed

    # admission

    def admit(self, *, now: datetime, joined: Collection[str] = (), left: Collection[QueueKey] = ()) -> list[Placement]:
        """First fit, each placement claimed by compare-and-set. The board's lock is never held
        across the database: the frame path takes it on the event loop. Admissions follow one
        another under a lock of their own instead. (`joined`, `left`: one process sees every change
        in its board, so positions are read there.)"""
        board = self.board
        done: list[Placement] = []
        skipped: set[str] = set()
        with self._admit_lock:
            while planned := board.plan(skip=skipped):
                for placement in planned:
                    channel = board.channel_of(placement.worker_id)
                    claimed = channel is not None and RealtimeSession.objects.filter(
                        id=placement.session_id, state=SessionState.QUEUED).update(
                        state=SessionState.PLACING, worker_id=placement.worker_id) == 1
                    entry = board.place(placement) if claimed else None
                    if entry is None or channel is None:
                        skipped.add(placement.session_id)
                        continue
                    to_socket_after_commit(channel, SessionStart(placement.session_id, placement.model_id,
                                                                 dict(entry.params)).to_wire())
                    done.append(placement)
            for browser, position in board.position_changes():
                to_socket_after_commit(browser, Queued(position).to_wire())
        return done

    def accept(self, *, worker_id: str, session_id: str, channel_name: str, now: datetime) -> bool:
        with transaction.atomic():
            accepted = RealtimeSession.objects.filter(id=session_id, worker_id=worker_id,
                                                      state=SessionState.PLACING).update(
                state=SessionState.LIVE, live_since=now) == 1
            entry = self.board.go_live(session_id, worker_id=worker_id, now=now) if accepted else None
            if entry is not None:
                usage_open(account_id=entry.account_id, model_id=entry.model_id, session_id=session_id,
                           worker_id=worker_id, now=now)
        if entry is None:
            if not accepted and self.board.worker_of(session_id) == worker_id and RealtimeSession.objects.filter(
                    id=session_id, worker_id=worker_id, state=SessionState.LIVE).exists():
                return True  # a repeated accept (of a session_start sent again): the worker holds it
            self.end_on_worker(worker_id, session_id, channel_name)
            return False
        route = self.board.route(session_id)
        if route.browser:  # its consumer sends the newest frame it kept meanwhile
            notify_after_commit(route.browser, SessionLive(channel_name, Live(entry.model_id, worker_id).to_wire())
                                .to_event())
        return True

    def refuse(self, *, worker_id: str, session_id: str, now: datetime) -> bool:
        returned = RealtimeSession.objects.filter(id=session_id, worker_id=worker_id, state=SessionState.PLACING) \
            .update(state=SessionState.QUEUED, worker_id=None) == 1
        if returned:
            self.board.requeue(session_id, refused_by=worker_id)
            self.admit(now=now)
        return returned

    def end_on_worker(self, worker_id: str | None, session_id: str, channel: str | None = None) -> None:
        channel = channel or self.board.channel_of(worker_id)
        if channel:
            to_socket_after_commit(channel, SessionEnd(session_id).to_wire())

    def _send_back(self, session_ids: list[str], *, now: datetime, end_on: str | None = None) -> None:
        """Sessions that lost their slot go back to the queue at their old places; metering stops."""
        for session_id in session_ids:
            with transaction.atomic():
                RealtimeSession.objects.filter(id=session_id, state__in=HOLDING_STATES).update(
                    state=SessionState.QUEUED, worker_id=None, live_since=None)
                usage_close(session_id=session_id, now=now)
            self.board.requeue(session_id)
            if end_on:
                self.end_on_worker(end_on, session_id)
        self.admit(now=now)

    def sweep(self, *, now: datetime) -> None:
        """Refusals are forgotten, rows whose sockets are gone close, and admission runs."""
        self.board.forget_refusals()
        self._ended_unseen(self._close_unseen(RealtimeSession.objects.all(), now=now))
        self.admit(now=now)

    def _close_unseen(self, sessions: Any, *, now: datetime) -> list[Unseen]:
        """Close the open rows (of the queryset `sessions`) no socket of this process holds and
        none has vouched for within the bound: their sockets closed, but not their rows."""
        seen_before = policy.unseen_before(now, sweep_seconds=settings.SESSION_SWEEP_SECONDS)
        closed = sessions_unseen_close(sessions.exclude(id__in=self.board.own_sessions()), seen_before=seen_before,
                                       now=now)
        if closed:
            log.warning("closed %d sessions whose browser sockets are gone", len(closed))
        return closed

    def _ended_unseen(self, closed: list[Unseen]) -> None:
        """After the commit, the workers holding sessions closed as unseen get session_end."""
        for gone in closed:
            if gone.state in HOLDING_STATES:
                self.end_on_worker(gone.worker_id, gone.session_id)

    # workers

    def worker_joined(self, *, worker_id: str, channel_name: str, models: list[ModelEntry], previous_channel: str,
                      now: datetime) -> None:
        budget = settings.FRAME_BUDGET_MS
        slots = {m.model_id: policy.model_slots(realtime=m.realtime, frame_ms_p95=m.frame_ms_p95,
                                                realtime_slots=m.realtime_slots, frame_budget_ms=budget)
                 for m in models}
        self.board.set_worker(worker_id=worker_id, channel_name=channel_name, slots=slots,
                              frame_ms={m.model_id: m.frame_ms_p95 for m in models})
        self.admit(now=now)

    def worker_lost(self, *, worker_id: str, channel_name: str, still_current: bool, now: datetime) -> None:
        # the board knows this process's connections: a newer one took over when it holds another channel
        held = self.board.drop_worker(worker_id=worker_id, channel_name=channel_name)
        if held is not None:
            self._send_back(held, now=now)

    def worker_rung_changed(self, *, worker_id: str, entry: ModelEntry, channel_name: str, now: datetime) -> None:
        worker = self.board.workers.get(worker_id)
        if worker is None:
            return
        frame_ms = entry.frame_ms_p95 if entry.frame_ms_p95 is not None else worker.frame_ms.get(entry.model_id)
        slots = policy.model_slots(realtime=entry.realtime, frame_ms_p95=frame_ms,
                                   realtime_slots=entry.realtime_slots, frame_budget_ms=settings.FRAME_BUDGET_MS)
        lost = self.board.set_model_slots(worker_id=worker_id, model_id=entry.model_id, slots=slots)
        self._send_back(lost, now=now, end_on=worker_id)

    # what operators see

    def positions(self) -> dict[str, int]:
        sessions, _, _ = self.board.snapshot()
        return policy.positions(e.queued() for e, _ in sessions if e.state == QUEUED)

    def free(self) -> dict[SlotKey, int]:
        return self.board.free()

    def snapshot(self) -> dict[str, Any]:
        sessions, workers, free = self.board.snapshot()
        queued = [e for e, _ in sessions if e.state == QUEUED]
        places = policy.positions(e.queued() for e in queued)
        queue = [{"session_id": e.session_id, "model_id": e.model_id, "position": places[e.session_id],
                  "account_id": e.account_id} for e in sorted(queued, key=lambda e: places[e.session_id])]
        per_worker = {}
        for worker in workers:
            per_worker[worker.worker_id] = {
                "slots": [{"model_id": model_id, "slots": count, "free": free.get((worker.worker_id, model_id), 0)}
                          for model_id, count in sorted(worker.slots.items())],
                "sessions": [{"session_id": e.session_id, "model_id": e.model_id, "state": e.state}
                             for e, holder in sessions if holder == worker.worker_id and e.state in (PLACING, LIVE)]}
        return {"sessions": queue, "workers": per_worker}

    def release(self) -> None:
        """Nothing to let go of: one process holds no lock of others."""
