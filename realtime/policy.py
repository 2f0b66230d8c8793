"""The session path's decisions, pure (no Django, time passed in): queue order and positions, first
fit, a model's slots, idleness, a socket unseen, which gone session's place a reconnect takes, which
news of a placement still applies. The shared admission's story: docs/design/shared-admission.md."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

SlotKey = tuple[str, str]  # (worker_id, model_id)


@dataclass(frozen=True)
class QueuedSession:
    session_id: str
    model_id: str
    joined_us: int  # microseconds since the epoch of the first join: the queue order
    refused_by: frozenset[str] = field(default=frozenset(), compare=False)  # workers not to try again


@dataclass(frozen=True)
class Placement:
    session_id: str
    worker_id: str
    model_id: str


def queue_order(queued: Iterable[QueuedSession]) -> list[QueuedSession]:
    """The queue: first joined first; the id breaks exact ties so the order is total."""
    return sorted(queued, key=lambda s: (s.joined_us, s.session_id))


def positions(queued: Iterable[QueuedSession]) -> dict[str, int]:
    """1-based place of each queued session among all queued sessions."""
    return {s.session_id: n for n, s in enumerate(queue_order(queued), start=1)}


@dataclass(frozen=True)
class GoneSession:
    """A session closed because the API process holding its browser socket died (several API
    processes): the browser's reconnect may take its place."""

    session_id: str
    account_id: int
    model_id: str
    params: Mapping[str, Any] = field(hash=False)  # width, height, steps of the socket's query
    joined_at: datetime  # its place: the time it first joined
    gone_at: datetime  # when its process was found gone
    resumed: bool = False  # its place went to a reconnect already


def place_to_resume(gone: Iterable[GoneSession], *, account_id: int, model_id: str, params: Mapping[str, Any],
                    now: datetime, window: timedelta) -> GoneSession | None:
    """The gone session whose place a join of `account_id` for `model_id` with `params` takes: one of
    the same account, model and params, found gone at most `window` before `now`, whose place no
    reconnect took yet; the first joined of those (each reconnect takes one place, oldest first)."""
    fits = [g for g in gone if g.account_id == account_id and g.model_id == model_id
            and dict(g.params) == dict(params) and not g.resumed and now - g.gone_at <= window]
    return min(fits, key=lambda g: (g.joined_at, g.session_id), default=None)


def model_slots(*, realtime: bool, frame_ms_p95: float | None, realtime_slots: int,
                frame_budget_ms: float) -> int:
    """The slots a worker's model entry offers: only with realtime, and a p95 frame time within the
    API's budget (an unknown frame time is not within it)."""
    if not realtime or frame_ms_p95 is None or frame_ms_p95 > frame_budget_ms:
        return 0
    return max(0, realtime_slots)


def free_slots(capacity: Mapping[SlotKey, int], held: Iterable[SlotKey]) -> dict[SlotKey, int]:
    """Free slots per (worker, model): the capacity minus the sessions placing or live there
    (never below zero: a demoted model may hold more than it now offers)."""
    free = dict(capacity)
    for key in held:
        if key in free:
            free[key] = max(0, free[key] - 1)
    return free


def first_fit(queued: Sequence[QueuedSession], free: Mapping[SlotKey, int]) -> list[Placement]:
    """Place queued sessions, in queue order, on the first worker (by worker_id) with a free slot of
    the session's model that has not refused it. Each slot is given at most once."""
    remaining = {key: count for key, count in free.items() if count > 0}
    by_model: dict[str, list[str]] = {}
    for worker_id, model_id in sorted(remaining):
        by_model.setdefault(model_id, []).append(worker_id)
    placements = []
    for session in queue_order(queued):
        for worker_id in by_model.get(session.model_id, ()):
            key = (worker_id, session.model_id)
            if remaining.get(key, 0) > 0 and worker_id not in session.refused_by:
                remaining[key] -= 1
                placements.append(Placement(session.session_id, worker_id, session.model_id))
                break
    return placements


def is_idle(last_input: datetime, now: datetime, idle_seconds: float) -> bool:
    """No canvas input since `last_input` (the last frame, or going live) for idle_seconds."""
    return (now - last_input).total_seconds() >= idle_seconds


def idle_at(last_input: datetime, idle_seconds: float) -> datetime:
    """When a session with no further input goes idle."""
    return last_input + timedelta(seconds=idle_seconds)


UNSEEN_SWEEPS = 3  # sweep periods a socket's process may miss vouching for it before its row is closed


def unseen_before(now: datetime, *, sweep_seconds: float) -> datetime:
    """A session row whose socket's process last vouched for it (at each of its sweep ticks) before
    this moment has lost its socket: UNSEEN_SWEEPS periods, so two missed ticks are not a loss."""
    return now - timedelta(seconds=UNSEEN_SWEEPS * sweep_seconds)


def placement_event_applies(kind: str, *, known: int, placement: int) -> bool:
    """Several API processes: whether news of a session's `placement` (its count of placements)
    changes what the browser's process believes, which last heard of placement `known`. News of
    going `live` counts only for a newer placement than any heard of (a late `live` of a placement
    already ended is stale); news of going `back` to the queue counts for the known one or a newer
    one (a late `back` of an earlier placement must not take a newer live one away)."""
    if kind == "live":
        return placement > known
    if kind == "back":
        return placement >= known
    raise ValueError(f"unknown placement event {kind!r}")


QueueKey = tuple[int, str]  # (joined_us, session_id): a queued session's place in the queue order


def moved_position(position: int, key: QueueKey, *, left: Iterable[QueueKey], joined: Iterable[QueueKey]) -> int:
    """A queued session's position after other sessions left the queue and joined it: one less for
    each that left ahead of it, one more for each that joined ahead of it. Changes commute, so news
    of several admissions may be applied in any order (each once)."""
    return position - sum(1 for other in left if other < key) + sum(1 for other in joined if other < key)
