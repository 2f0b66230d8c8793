"""The positions of this process's queued sessions under the shared admission, moved by each
admission's `sessions.moved` without reading the queue. docs/design/shared-admission.md, "Positions"."""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from potocolom.protocol.events import SessionsMoved
from realtime import policy
from realtime.policy import QueueKey

RECENT_MOVES = 1024


@dataclass
class Place:
    key: QueueKey
    position: int
    base: int  # the position was read (or told) as of this queue move, which it includes with all before it
    applied: set[int] = field(default_factory=set)  # later moves applied since (news comes in any order)

    def includes(self, seq: int) -> bool:
        return seq <= self.base or seq in self.applied

    def apply(self, seq: int) -> None:
        """Note a move applied; the moves applied in a row after `base` fold into it, so the set
        holds only those that came out of order, at most RECENT_MOVES of them (a gap the sweep's
        correction then closes), however long the session waits."""
        self.applied.add(seq)
        if len(self.applied) > RECENT_MOVES:  # a gap in the numbers (a rolled-back admission) never fills
            self.base = min(self.applied)
            self.applied = {s for s in self.applied if s > self.base}
        while self.base + 1 in self.applied:
            self.base += 1
            self.applied.discard(self.base)


def queue_key(joined_us: int, session_id: str) -> QueueKey:
    return (int(joined_us), str(session_id))


class QueuePlaces:
    """Own queued sessions' positions, moved by the news of every admission."""

    def __init__(self, browser_of: Callable[[str], str | None]) -> None:
        self.lock = threading.Lock()
        self.places: dict[str, Place] = {}
        self.browser_of = browser_of  # the browser channel of a session of this process (None: not ours)
        # the latest moves heard (seq -> (left, joined)), for a correction read before they arrived
        self.recent: collections.OrderedDict[int, tuple[list[QueueKey], list[QueueKey]]] = collections.OrderedDict()

    def moved(self, moves: SessionsMoved) -> list[tuple[str, int]]:
        """Apply one admission's moves; (browser channel, position) to tell for each change."""
        seq = moves.seq
        left = [queue_key(*k) for k in moves.left]
        joined = {queue_key(*k): position for k, position in moves.joined}
        tell: list[tuple[str, int]] = []
        with self.lock:
            self.recent[seq] = (left, list(joined))
            while len(self.recent) > RECENT_MOVES:
                self.recent.popitem(last=False)
            for key in left:
                found = self.places.get(key[1])
                if found is not None and not found.includes(seq):
                    del self.places[key[1]]
            for key, position in joined.items():
                found = self.places.get(key[1])
                if (found is None or found.base < seq) and (browser := self.browser_of(key[1])):
                    if found is None or found.position != position:
                        tell.append((browser, position))
                    self.places[key[1]] = Place(key, position, seq)
            for session_id, place in self.places.items():
                if place.includes(seq):
                    continue
                position = policy.moved_position(place.position, place.key, left=left, joined=joined)
                place.apply(seq)
                if position != place.position:
                    place.position = position
                    if browser := self.browser_of(session_id):
                        tell.append((browser, position))
        return tell

    def resync(self, positions: dict[str, tuple[QueueKey, int]], *, as_of: int) -> list[tuple[str, int]]:
        """The positions read from the queue itself as of move `as_of` (the sweep's correction of
        news that was lost): own sessions not among them left the queue."""
        tell = []
        with self.lock:
            for session_id in [s for s, p in self.places.items() if p.base <= as_of and s not in positions]:
                del self.places[session_id]
            for session_id, (key, position) in positions.items():
                found = self.places.get(session_id)
                if found is not None and found.base > as_of:
                    continue
                place = Place(key, position, as_of)
                for seq, (left, joined) in self.recent.items():  # heard already, after the read
                    if seq > as_of:
                        place.position = policy.moved_position(place.position, key, left=left, joined=joined)
                        place.apply(seq)
                browser = self.browser_of(session_id)
                if browser and (found is None or found.position != place.position):
                    tell.append((browser, place.position))
                self.places[session_id] = place
        return tell

    def forget(self, session_id: str) -> None:
        with self.lock:
            self.places.pop(session_id, None)

    def positions(self) -> dict[str, int]:
        with self.lock:
            return {s: p.position for s, p in self.places.items()}
