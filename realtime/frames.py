"""Frame backpressure, the API's side (pure, time passed in): at most one frame of a live session in
flight to its worker, only the newest kept meanwhile. docs/design/frame-batching.md, "Backpressure"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Frame = dict[str, Any]  # a frame order for the worker (potocolom.protocol.worker.FrameOrder.to_wire())


@dataclass
class FrameGate:
    """One session's frames on their way to its worker."""

    wait_seconds: float  # how long an unanswered frame holds back the next: 2 x FRAME_BUDGET_MS
    in_flight: int | None = None  # the seq sent and not yet answered
    sent_at: float = 0.0
    newest: Frame | None = None  # the newest frame not sent yet

    def _send(self, frame: Frame, now: float) -> Frame:
        self.in_flight, self.sent_at, self.newest = int(frame["seq"]), now, None
        return frame

    def _free(self, now: float) -> bool:
        return self.in_flight is None or now - self.sent_at >= self.wait_seconds

    def offer(self, frame: Frame, *, live: bool, now: float) -> Frame | None:
        """A browser frame: the frame to send now, or None when it is kept as the newest (the
        session is not live, or a frame is in flight)."""
        if live and self._free(now):
            return self._send(frame, now)
        self.newest = frame
        return None

    def answered(self, seq: int, *, now: float) -> Frame | None:
        """The worker answered `seq`: when it answers the frame in flight (or a later one), the
        newest kept frame goes next."""
        if self.in_flight is None or seq < self.in_flight:
            return None
        self.in_flight = None
        return self._send(self.newest, now) if self.newest is not None else None

    def due(self, *, now: float) -> Frame | None:
        """The frame in flight waited too long: the newest kept frame goes anyway."""
        if self.newest is None or not self._free(now):
            return None
        return self._send(self.newest, now)

    def deadline(self) -> float | None:
        """When `due` would send the kept frame (None: nothing is held back by a frame in flight)."""
        if self.newest is None or self.in_flight is None:
            return None
        return self.sent_at + self.wait_seconds

    def went_live(self, *, now: float) -> Frame | None:
        """The session is live (again), on a worker that has none of its frames: the newest kept
        frame goes now."""
        self.in_flight = None
        return self._send(self.newest, now) if self.newest is not None else None
