"""The worker's side of live drawing sessions: a session holds one realtime slot of its model from
its session_accepted to its session_end (or the connection's drop); its frames go to the frame
queue, and the denoising thread runs them in batches. How and why: docs/design/frame-batching.md."""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuworker.frames import FramePipeline, FrameRunner, QueuedFrame, SessionParams
from gpuworker.inputs import ParamsRefused, checked_image_bytes
from gpuworker.limits import MAX_IMAGE_PIXELS
from gpuworker.pipelines import DEFAULT_GUIDANCE_SCALE, MAX_SEED
from gpuworker.slots import RealtimeCapacity
from potocolom.protocol.browser import frame_params
from potocolom.protocol.rungs import RUNG_FULL
from potocolom.protocol.worker import FrameOrder, ModelEntry, SessionAccepted, SessionRefused

log = logging.getLogger(__name__)

SESSION_PARAM_KEYS = ("width", "height", "steps", "seed", "guidance_scale")
PROMPT_CHARS = 1000  # the manifests' maxLength for prompts; a longer one is cut, not refused


@dataclass(frozen=True)
class LiveSession:
    """A session this worker holds a slot for."""

    session_id: str
    model_id: str
    params: SessionParams


class SessionTable:
    """Live sessions per model against each model's slots (plain data, no threads)."""

    def __init__(self, slots: Mapping[str, int]):
        self.slots = dict(slots)
        self._live: dict[str, LiveSession] = {}

    def get(self, session_id: str) -> LiveSession | None:
        return self._live.get(session_id)

    def in_use(self, model_id: str) -> int:
        return sum(1 for session in self._live.values() if session.model_id == model_id)

    def free(self, model_id: str) -> int:
        return self.slots.get(model_id, 0) - self.in_use(model_id)

    def add(self, session: LiveSession) -> None:
        self._live[session.session_id] = session

    def session_ids(self) -> list[str]:
        """The live sessions, in the order they started (a drain ends them all)."""
        return list(self._live)

    def remove(self, session_id: str) -> LiveSession | None:
        return self._live.pop(session_id, None)

    def of_model(self, model_id: str) -> list[LiveSession]:
        return [session for session in self._live.values() if session.model_id == model_id]

    def clear(self) -> list[LiveSession]:
        live, self._live = list(self._live.values()), {}
        return live


def session_params(raw: Any, capacity: RealtimeCapacity, pipeline: FramePipeline,
                   rng: random.Random | None = None) -> SessionParams:
    """session_start.params with the session defaults filled in; raises ParamsRefused."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsRefused(f"params must be a JSON object, got {type(raw).__name__}")
    for key in ("width", "height", "steps"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ParamsRefused(f"{key} must be an integer, got {value!r}"[:200])
    chosen = {key: raw[key] for key in SESSION_PARAM_KEYS if raw.get(key) is not None}
    chosen.setdefault("width", capacity.width)
    chosen.setdefault("height", capacity.height)
    chosen.setdefault("steps", capacity.steps)
    chosen.setdefault("seed", (rng or random).randint(0, MAX_SEED))
    chosen.setdefault("guidance_scale", DEFAULT_GUIDANCE_SCALE)
    # The pipeline's own checks: the manifest's schema, integers, multiples of 8.
    request = pipeline.check_inputs({"prompt": "", **chosen})
    return SessionParams(width=request.width, height=request.height, steps=request.steps,
                         guidance_scale=request.guidance_scale, seed=request.seed)


def frame_of(message: FrameOrder, session: LiveSession, received: float, *,
             max_image_pixels: int = MAX_IMAGE_PIXELS) -> QueuedFrame:
    """A frame message as a QueuedFrame of its session; MessageError for params off the contract,
    ParamsRefused for an image that is not PNG, JPEG or WebP or declares more than
    `max_image_pixels` pixels (read from its header: microseconds, nothing decoded)."""
    params = frame_params(message.params)
    image = checked_image_bytes(message.image, max_pixels=max_image_pixels, what="frame image")
    return QueuedFrame(session_id=session.session_id, seq=message.seq, model_id=session.model_id, params=session.params,
                 prompt=params.prompt[:PROMPT_CHARS], strength=params.strength, image=image, received=received)


class SessionDesk:
    """Answers session_start, frees slots on session_end, and queues frames of live sessions."""

    def __init__(self, pipelines: Mapping[str, FramePipeline], capacities: Mapping[str, RealtimeCapacity],
                 runner: FrameRunner, wake: Callable[[], None], *, clock: Callable[[], float],
                 rng: random.Random | None = None, step_ms: Mapping[str, float] | None = None):
        # Realtime only on the full-residency rung, and only with a slot to give.
        self.capacities = {model_id: capacity for model_id, capacity in capacities.items()
                           if model_id in pipelines and pipelines[model_id].rung == RUNG_FULL}
        self.table = SessionTable({m: c.slots for m, c in self.capacities.items()})
        self._pipelines = pipelines
        self._runner = runner
        self._wake = wake
        self._clock = clock
        self._rng = rng
        self._step_ms = step_ms if step_ms is not None else {}  # measured on the full rung, by model_id

    def hello_entry(self, model_id: str, rung: str) -> ModelEntry:
        """The model's entry in hello.models (and rung_changed, model_loaded): step_ms only on the
        full rung, where it was measured."""
        capacity = self.capacities.get(model_id)
        realtime = capacity is not None and capacity.realtime
        return ModelEntry(model_id, rung, realtime, capacity.frame_ms_p95 if capacity is not None else None,
                          capacity.slots if capacity is not None and realtime else 0,
                          self._step_ms.get(model_id) if rung == RUNG_FULL else None)

    def add_model(self, model_id: str, rung: str, capacity: RealtimeCapacity | None) -> None:
        """A model loaded on demand (already among the pipelines) takes sessions: on rung full,
        with the slots it was measured to have."""
        if capacity is not None and rung == RUNG_FULL:
            self.capacities[model_id] = capacity
            self.table.slots[model_id] = capacity.slots

    def close_model(self, model_id: str) -> RealtimeCapacity | None:
        """No new session on the model (it is unloaded once its live ones end); its capacity, to
        give back to add_model should the model stay after all."""
        return self.capacities.pop(model_id, None)

    def remove_model(self, model_id: str) -> None:
        """The model is unloaded (it has no live session): it is forgotten here."""
        self.capacities.pop(model_id, None)
        self.table.slots.pop(model_id, None)

    def holds(self, session_id: str) -> bool:
        return self.table.get(session_id) is not None

    def start(self, session_id: str, model_id: str, raw_params: Any) -> SessionAccepted | SessionRefused:
        """The answer to a session_start: session_accepted, or session_refused with a reason."""
        held = self.table.get(session_id)
        if held is not None and held.model_id == model_id:
            return SessionAccepted(session_id)  # a repeated start
        params: SessionParams | None = None
        reason = self._refusal(session_id, model_id)
        if reason is None:  # bad params first: they are refused everywhere, a full worker only here
            try:
                params = session_params(raw_params, self.capacities[model_id], self._pipelines[model_id], self._rng)
            except ParamsRefused as exc:
                reason = f"bad params: {exc}"
        if reason is None and self.table.free(model_id) < 1:
            reason = f"no free realtime slot for model {model_id} ({self.table.slots[model_id]} in use)"
        if reason is not None or params is None:
            log.info("session %s (%s) refused: %s", session_id, model_id, reason)
            return SessionRefused(session_id, reason or "refused")
        self.table.add(LiveSession(session_id, model_id, params))
        log.info("session %s (%s) live at %dx%d, %d steps; %d of %d slot(s) in use", session_id, model_id,
                 params.width, params.height, params.steps, self.table.in_use(model_id),
                 self.table.slots[model_id])
        return SessionAccepted(session_id)

    def _refusal(self, session_id: str, model_id: str) -> str | None:
        if self.table.get(session_id) is not None:
            return f"session {session_id} is already live here on another model"
        if model_id not in self._pipelines:
            return f"model {model_id} is not served by this worker"
        capacity = self.capacities.get(model_id)
        if capacity is None or not capacity.realtime:
            return f"model {model_id} has no realtime slots on this worker"
        return None

    def end(self, session_id: str) -> None:
        """Free the session's slot and drop its pending frame; results still in flight are dropped
        by the worker (`holds` turns false)."""
        session = self.table.remove(session_id)
        self._runner.drop_session(session_id)
        if session is not None:
            log.info("session %s (%s) ended; %d of %d slot(s) in use", session_id, session.model_id,
                     self.table.in_use(session.model_id), self.table.slots.get(session.model_id, 0))

    def demote(self, model_id: str, rung: str) -> None:
        """The model moved to `rung`: below full it serves no sessions here, and its live ones end
        (after rung_changed the API sends them back to its queue, and session_end for each)."""
        if rung == RUNG_FULL:
            return
        self.capacities.pop(model_id, None)
        self.table.slots[model_id] = 0
        ended = self.table.of_model(model_id)
        for session in ended:
            self.end(session.session_id)
        log.info("model %s moved to rung %s: no realtime here any more; %d live session(s) ended", model_id, rung,
                 len(ended))

    def frame(self, message: FrameOrder) -> None:
        """Queue a frame of a live session (a frame of any other session is ignored)."""
        session = self.table.get(message.session_id)
        if session is None:
            log.debug("ignoring a frame of session %s, which is not live here", message.session_id)
            return
        try:
            frame = frame_of(message, session, self._clock(), max_image_pixels=self._runner.max_image_pixels)
        except ParamsRefused as exc:  # refused here, on the event loop: the denoising thread never sees it
            log.warning("session %s: frame %s dropped: %s", message.session_id, message.seq, exc)
            return
        if self._runner.queue.put(frame):
            self._wake()

    def clear(self) -> None:
        """The connection dropped: the API sends these sessions back to its queue."""
        dropped = self.table.clear()
        self._runner.forget_sessions()
        if dropped:
            log.info("connection lost: %d realtime session(s) dropped", len(dropped))
