"""This process's view of realtime sessions: the sessions whose browser sockets it holds, where each
session's messages go (`Route`, the one place a session's routing is kept), and, under the local
admission, every worker's slots. Plain data behind one lock; the admission backends mutate it."""
from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from realtime import policy
from realtime.policy import Placement, QueuedSession, SlotKey

QUEUED, PLACING, LIVE, IDLE = "queued", "placing", "live", "idle"


@dataclass
class SessionEntry:
    """A session whose browser socket this process holds."""

    session_id: str
    account_id: int
    model_id: str
    joined_us: int
    params: dict[str, Any]
    state: str = QUEUED
    refused_by: set[str] = field(default_factory=set)
    last_input: datetime | None = None  # the last frame
    live_since: datetime | None = None
    told_position: int | None = None
    placement: int = 0  # the latest placement heard of (several API processes)

    def queued(self) -> QueuedSession:
        return QueuedSession(self.session_id, self.model_id, self.joined_us, frozenset(self.refused_by))

    def idle_from(self) -> datetime | None:
        """The moment idleness counts from: the last frame, or going live if later."""
        moments = [t for t in (self.last_input, self.live_since) if t is not None]
        return max(moments) if moments else None


@dataclass
class Route:
    """Where a session's messages go: its browser socket's channel (known where that socket is) and,
    while the session holds a slot, its worker and that worker socket's channel."""

    browser: str | None = None
    worker_id: str | None = None
    worker: str | None = None


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
        self.routes: dict[str, Route] = {}
        self.workers: dict[str, WorkerEntry] = {}

    # sessions

    def add(self, entry: SessionEntry, *, browser: str) -> None:
        with self.lock:
            self.sessions[entry.session_id] = entry
            self.routes.setdefault(entry.session_id, Route()).browser = browser

    def get(self, session_id: str) -> SessionEntry | None:
        with self.lock:
            return self.sessions.get(session_id)

    def remove(self, session_id: str) -> tuple[SessionEntry | None, Route | None]:
        """The browser socket closed: forget the session and its route."""
        with self.lock:
            return self.sessions.pop(session_id, None), self.routes.pop(session_id, None)

    def route(self, session_id: str) -> Route:
        """A copy of where the session's messages go now."""
        with self.lock:
            found = self.routes.get(session_id)
            return Route(found.browser, found.worker_id, found.worker) if found else Route()

    def own_sessions(self) -> list[str]:
        """The sessions whose browser sockets this process holds."""
        with self.lock:
            return list(self.sessions)

    def own_browser(self, session_id: str) -> str | None:
        """The browser channel of a session whose socket this process holds (None for another's)."""
        with self.lock:
            found = self.routes.get(session_id)
            return found.browser if found is not None and session_id in self.sessions else None

    def browser_of(self, session_id: str) -> str | None:
        with self.lock:
            found = self.routes.get(session_id)
            return found.browser if found else None

    # routing

    def route_to_worker(self, session_id: str, *, worker_id: str, worker: str | None,
                        browser: str | None = None) -> None:
        """The session holds a slot on `worker_id`, whose socket is at `worker` (and, seen from the
        worker's process, its browser socket at `browser`)."""
        with self.lock:
            found = self.routes.setdefault(session_id, Route())
            found.worker_id, found.worker = worker_id, worker
            if browser:
                found.browser = browser

    def unroute_worker(self, session_id: str, *, worker_id: str | None = None) -> None:
        """The session no longer holds a slot (on `worker_id`, when given)."""
        with self.lock:
            found = self.routes.get(session_id)
            if found is None or (worker_id is not None and found.worker_id != worker_id):
                return
            found.worker_id = found.worker = None
            if session_id not in self.sessions:
                del self.routes[session_id]  # a session of another process's browser: nothing left here

    def unroute_connection(self, *, worker_id: str, channel_name: str) -> None:
        """A worker's socket closed: no session is routed to it any more."""
        with self.lock:
            for session_id in [s for s, r in self.routes.items() if r.worker_id == worker_id
                               and r.worker in (channel_name, None)]:
                self.unroute_worker(session_id)

    def browser_for(self, session_id: str, *, worker_id: str) -> str | None:
        """Where a frame result of `worker_id` for the session goes (only from the worker holding it)."""
        with self.lock:
            found = self.routes.get(session_id)
            if found is None or found.worker_id != worker_id:
                return None
            return found.browser

    def worker_of(self, session_id: str) -> str | None:
        with self.lock:
            found = self.routes.get(session_id)
            return found.worker_id if found else None

    # session state

    def requeue(self, session_id: str, *, refused_by: str | None = None) -> SessionEntry | None:
        """Send a session back to the queue at its old place (its joined time is kept)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return None
            if refused_by:
                entry.refused_by.add(refused_by)
            entry.state, entry.live_since = QUEUED, None
            self.unroute_worker(session_id)
            return entry

    def go_live(self, session_id: str, *, worker_id: str, now: datetime) -> SessionEntry | None:
        """A placing session was accepted: live from now."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != PLACING or self.worker_of(session_id) != worker_id:
                return None
            entry.state, entry.live_since, entry.refused_by = LIVE, now, set()
            return entry

    def live_here(self, session_id: str, *, worker_id: str, worker_channel: str, placement: int,
                  now: datetime) -> SessionEntry | None:
        """Several API processes: news that placement `placement` went live on a worker (possibly
        of another process); None when it is stale (policy.placement_event_applies)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or not policy.placement_event_applies("live", known=entry.placement,
                                                                    placement=placement):
                return None
            entry.state, entry.placement, entry.live_since = LIVE, placement, now
            self.route_to_worker(session_id, worker_id=worker_id, worker=worker_channel)
            return entry

    def back_here(self, session_id: str, *, placement: int) -> bool:
        """Several API processes: news that placement `placement` ended and the session is back in
        the queue; frames wait as pending again. False when it is stale."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or not policy.placement_event_applies("back", known=entry.placement,
                                                                    placement=placement):
                return False
            entry.placement = placement
            if entry.state in (PLACING, LIVE):
                entry.state, entry.live_since = QUEUED, None
                self.unroute_worker(session_id)
            return True

    def go_idle(self, session_id: str) -> SessionEntry | None:
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != LIVE:
                return None
            entry.state, entry.live_since = IDLE, None
            self.unroute_worker(session_id)
            return entry

    def frame(self, session_id: str, *, now: datetime) -> tuple[str, str | None]:
        """Record canvas input: ('live', worker channel) when a frame can go to the worker now;
        otherwise the session's state and None (its consumer keeps the newest frame meanwhile)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None:
                return "gone", None
            entry.last_input = now
            found = self.routes.get(session_id)
            if entry.state == LIVE and found is not None and found.worker:
                return LIVE, found.worker
            return entry.state, None

    def live_worker(self, session_id: str) -> str | None:
        """The worker channel a frame of the session goes to now (None unless it is live)."""
        with self.lock:
            entry = self.sessions.get(session_id)
            found = self.routes.get(session_id)
            return found.worker if entry is not None and entry.state == LIVE and found is not None else None

    def wake(self, session_id: str) -> bool:
        """An idle session asks for a slot again: back in the queue at its old place."""
        with self.lock:
            entry = self.sessions.get(session_id)
            if entry is None or entry.state != IDLE:
                return False
            entry.state = QUEUED
            return True

    def idle_candidates(self, *, now: datetime, idle_seconds: float) -> list[str]:
        with self.lock:
            return [s.session_id for s in self.sessions.values()
                    if s.state == LIVE and (start := s.idle_from()) is not None
                    and policy.is_idle(start, now, idle_seconds)]

    def forget_refusals(self) -> None:
        with self.lock:
            for entry in self.sessions.values():
                entry.refused_by.clear()

    def position_changes(self) -> list[tuple[str, int]]:
        """(browser channel, position) for each queued session whose position changed since it was
        last told; sessions not queued forget their told position."""
        with self.lock:
            places = policy.positions(s.queued() for s in self.sessions.values() if s.state == QUEUED)
            changes = []
            for entry in self.sessions.values():
                place = places.get(entry.session_id)
                browser = self.browser_of(entry.session_id)
                if place is not None and place != entry.told_position and browser:
                    changes.append((browser, place))
                entry.told_position = place
            return changes

    # workers and slots (the local admission)

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

    def holding(self, worker_id: str, model_id: str | None = None) -> list[str]:
        """The sessions placing or live on the worker (of `model_id`, when given)."""
        with self.lock:
            return [s.session_id for s in self.sessions.values()
                    if s.state in (PLACING, LIVE) and self.worker_of(s.session_id) == worker_id
                    and model_id in (None, s.model_id)]

    def drop_worker(self, *, worker_id: str, channel_name: str) -> list[str] | None:
        """Forget a worker connection; the sessions it held (None: a newer connection took over)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return None
            del self.workers[worker_id]
            return self.holding(worker_id)

    def set_model_slots(self, *, worker_id: str, model_id: str, slots: int) -> list[str]:
        """A worker's model changed rung; the sessions there that lost their slot (all of them when
        it offers none now)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None:
                return []
            worker.slots[model_id] = slots
            return [] if slots > 0 else self.holding(worker_id, model_id)

    def free(self) -> dict[SlotKey, int]:
        with self.lock:
            capacity = {(w.worker_id, model_id): n for w in self.workers.values() for model_id, n in w.slots.items()}
            held = [(worker_id, s.model_id) for s in self.sessions.values()
                    if s.state in (PLACING, LIVE) and (worker_id := self.worker_of(s.session_id))]
            return policy.free_slots(capacity, held)

    def plan(self, *, skip: Collection[str] = ()) -> list[Placement]:
        """First fit over the queued sessions (less `skip`) and the free slots, as they stand; nothing
        changes. The caller claims each placement in the database without this lock held (a
        stuck database must not stop the frames of live sessions), then `place`s it."""
        with self.lock:
            queued = [s.queued() for s in self.sessions.values() if s.state == QUEUED and s.session_id not in skip]
            return policy.first_fit(queued, self.free())

    def place(self, placement: Placement) -> SessionEntry | None:
        """A claimed placement: the session is placing on its worker; None when it is no longer
        queued here (it left meanwhile)."""
        with self.lock:
            entry = self.sessions.get(placement.session_id)
            if entry is None or entry.state != QUEUED:
                return None
            entry.state = PLACING
            self.route_to_worker(placement.session_id, worker_id=placement.worker_id,
                                 worker=self.channel_of(placement.worker_id))
            return entry

    def snapshot(self) -> tuple[list[tuple[SessionEntry, str | None]], list[WorkerEntry], dict[SlotKey, int]]:
        """(each session with its worker, the workers, the free slots), for operators."""
        with self.lock:
            sessions = [(s, self.worker_of(s.session_id)) for s in self.sessions.values()]
            return sessions, list(self.workers.values()), self.free()
