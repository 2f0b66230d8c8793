"""The in-process owner of admission state: connected sessions, and realtime slots per worker.

Plain data behind one lock, like scheduling/dispatcher.py: services call it after their database
writes, and the decisions it applies are the pure functions of admission.py. Nothing else mutates
this state. One instance lives in each API process (`get_board`), loaded on first use.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from realtime import admission
from realtime.admission import Placement, QueuedSession, SlotKey

QUEUED, PLACING, LIVE, IDLE = "queued", "placing", "live", "idle"


@dataclass
class SessionEntry:
    session_id: str
    account_id: int
    model_id: str
    joined_us: int
    channel_name: str  # the browser socket's channel
    params: dict[str, Any]
    state: str = QUEUED
    worker_id: str | None = None
    refused_by: set[str] = field(default_factory=set)
    last_input: float | None = None  # monotonic seconds of the last frame
    live_since: float | None = None  # monotonic seconds
    pending_frame: dict[str, Any] | None = None  # the newest frame while not live
    told_position: int | None = None
    # Several API processes: the live worker's channel, and the latest placement heard of.
    worker_channel: str | None = None
    placement: int = 0

    def queued(self) -> QueuedSession:
        return QueuedSession(self.session_id, self.model_id, self.joined_us, frozenset(self.refused_by))

    def idle_from(self) -> float | None:
        """The moment idleness counts from: the last frame, or going live if later."""
        moments = [t for t in (self.last_input, self.live_since) if t is not None]
        return max(moments) if moments else None


@dataclass
class WorkerEntry:
    worker_id: str
    channel_name: str
    slots: dict[str, int] = field(default_factory=dict)  # model_id -> realtime slots offered
    frame_ms: dict[str, float | None] = field(default_factory=dict)  # model_id -> the hello's p95


class SessionBoard:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.sessions: dict[str, SessionEntry] = {}
        self.workers: dict[str, WorkerEntry] = {}
        self.loaded = False

    # sessions

    def add(self, entry: SessionEntry) -> None:
        with self.lock:
            self.sessions[entry.session_id] = entry

    def get(self, session_id: str) -> SessionEntry | None:
        with self.lock:
            return self.sessions.get(session_id)

    def remove(self, session_id: str) -> SessionEntry | None:
        with self.lock:
            return self.sessions.pop(session_id, None)

    def requeue(self, session_id: str, *, refused_by: str | None = None) -> SessionEntry | None:
        """Send a session back to the queue at its old place (its joined time is kept)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return None
            if refused_by:
                entry.refused_by.add(refused_by)
            entry.state, entry.worker_id, entry.live_since = QUEUED, None, None
            return entry

    def go_live(self, session_id: str, *, worker_id: str, now: float) -> SessionEntry | None:
        """A placing session was accepted: live from now; its pending frame is taken out."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != PLACING or entry.worker_id != worker_id:
                return None
            entry.state, entry.live_since, entry.refused_by = LIVE, now, set()
            return entry

    def live_here(self, session_id: str, *, worker_id: str, worker_channel: str, placement: int,
                  now: float) -> SessionEntry | None:
        """Several API processes: news that placement `placement` went live on a worker (possibly
        of another process); None when it is stale (admission.placement_event_applies)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or not admission.placement_event_applies("live", known=entry.placement,
                                                                       placement=placement):
                return None
            entry.state, entry.worker_id, entry.worker_channel = LIVE, worker_id, worker_channel
            entry.placement, entry.live_since = placement, now
            return entry

    def back_here(self, session_id: str, *, placement: int) -> bool:
        """Several API processes: news that placement `placement` ended and the session is back in
        the queue; frames wait as pending again. False when it is stale."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or not admission.placement_event_applies("back", known=entry.placement,
                                                                       placement=placement):
                return False
            entry.placement = placement
            if entry.state in (PLACING, LIVE):
                entry.state, entry.worker_id, entry.worker_channel, entry.live_since = QUEUED, None, None, None
            return True

    def take_pending(self, session_id: str) -> dict[str, Any] | None:
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return None
            frame, entry.pending_frame = entry.pending_frame, None
            return frame

    def go_idle(self, session_id: str) -> SessionEntry | None:
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != LIVE:
                return None
            entry.state, entry.worker_id, entry.live_since = IDLE, None, None
            entry.worker_channel = None
            return entry

    def frame(self, session_id: str, frame: dict[str, Any], *, now: float) -> tuple[str, str | None]:
        """Record canvas input. ('live', worker channel) when the frame can go on at once; otherwise
        it is kept as the newest pending frame and the answer is the session's state."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return "gone", None
            entry.last_input = now
            if entry.state == LIVE:
                if entry.worker_channel:
                    return LIVE, entry.worker_channel
                worker = self.workers.get(entry.worker_id or "")
                if worker is not None:
                    return LIVE, worker.channel_name
            entry.pending_frame = frame
            return entry.state, None

    def wake(self, session_id: str) -> bool:
        """An idle session asks for a slot again: back in the queue at its old place."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != IDLE:
                return False
            entry.state = QUEUED
            return True

    def idle_candidates(self, *, now: float, idle_seconds: float) -> list[str]:
        with self.lock:
            return [s.session_id for s in self.sessions.values()
                    if s.state == LIVE and (start := s.idle_from()) is not None
                    and admission.is_idle(start, now, idle_seconds)]

    def position_changes(self) -> list[tuple[str, int]]:
        """(browser channel, position) for each queued session whose position changed since it was
        last told; sessions not queued forget their told position."""
        with self.lock:
            places = admission.positions(s.queued() for s in self.sessions.values() if s.state == QUEUED)
            changes = []
            for entry in self.sessions.values():
                place = places.get(entry.session_id)
                if place is not None and place != entry.told_position:
                    changes.append((entry.channel_name, place))
                entry.told_position = place
            return changes

    # workers and slots

    def set_worker(self, *, worker_id: str, channel_name: str, slots: dict[str, int],
                   frame_ms: dict[str, float | None]) -> None:
        with self.lock:
            self.workers[worker_id] = WorkerEntry(worker_id, channel_name, dict(slots), dict(frame_ms))
            for entry in self.sessions.values():  # a worker that says hello again may serve anew
                entry.refused_by.discard(worker_id)

    def channel_of(self, worker_id: str | None) -> str | None:
        with self.lock:
            worker = self.workers.get(worker_id or "")
            return worker.channel_name if worker else None

    def drop_worker(self, *, worker_id: str, channel_name: str) -> list[str] | None:
        """Forget a worker connection; the sessions it held (None: a newer connection took over)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return None
            del self.workers[worker_id]
            return [s.session_id for s in self.sessions.values()
                    if s.worker_id == worker_id and s.state in (PLACING, LIVE)]

    def set_model_slots(self, *, worker_id: str, model_id: str, slots: int) -> list[str]:
        """A worker's model changed rung; the sessions there that lost their slot (all of them when
        it offers none now)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None:
                return []
            worker.slots[model_id] = slots
            if slots > 0:
                return []
            return [s.session_id for s in self.sessions.values()
                    if s.worker_id == worker_id and s.model_id == model_id and s.state in (PLACING, LIVE)]

    def free(self) -> dict[SlotKey, int]:
        with self.lock:
            capacity = {(w.worker_id, model_id): n for w in self.workers.values() for model_id, n in w.slots.items()}
            held = [(s.worker_id, s.model_id) for s in self.sessions.values()
                    if s.state in (PLACING, LIVE) and s.worker_id]
            return admission.free_slots(capacity, held)  # type: ignore[arg-type]

    def plan(self, claim: Callable[[Placement], bool]) -> list[tuple[Placement, SessionEntry]]:
        """Decide placements by first fit and apply those that `claim` confirms (the database
        compare-and-set); a failed claim drops that session from this round."""
        with self.lock:
            done: list[tuple[Placement, SessionEntry]] = []
            skipped: set[str] = set()
            while True:
                queued = [s.queued() for s in self.sessions.values()
                          if s.state == QUEUED and s.session_id not in skipped]
                planned = admission.first_fit(queued, self.free())
                if not planned:
                    return done
                for placement in planned:
                    entry = self.sessions[placement.session_id]
                    if claim(placement):
                        entry.state, entry.worker_id = PLACING, placement.worker_id
                        done.append((placement, entry))
                    else:
                        skipped.add(placement.session_id)

    def snapshot(self) -> tuple[list[SessionEntry], list[WorkerEntry], dict[SlotKey, int]]:
        with self.lock:
            return list(self.sessions.values()), list(self.workers.values()), self.free()

    def sessions_of(self, ids: Iterable[str]) -> list[SessionEntry]:
        with self.lock:
            return [self.sessions[i] for i in ids if i in self.sessions]


_instance: SessionBoard | None = None
_instance_lock = threading.Lock()


def get_board() -> SessionBoard:
    """This process's session board (services load it from the database on first use)."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = SessionBoard()
        return _instance


def reset_board() -> None:
    """Forget this process's board, as a restart does (tests); let go of its presence locks."""
    global _instance
    from realtime.presence import close_presence

    close_presence()
    with _instance_lock:
        _instance = None
