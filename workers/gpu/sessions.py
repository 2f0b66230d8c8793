"""The worker's side of live drawing sessions: session_start, session_end and frame messages.

A session holds one realtime slot of its model from its `session_accepted` until its
`session_end` (or until the connection to the API drops: the API then sends its sessions back to
the queue, so the worker forgets them all). A session_start is refused, with a reason, when the
model is not served here in realtime, when every slot of the model is taken, or when its params
are not what the model can run (width, height and steps must be integers the model's
params_schema allows; width and height multiples of 8).

Slots were measured at the session defaults (frames.py). A session that asks for a bigger size
or more steps is still accepted when the schema allows it, and takes one slot like any other:
its frames run in their own batches (they share no call with default-size frames) and may take
longer than the frame budget.

Everything here runs on the event loop; frames go to the FrameRunner's queue, and `wake` tells
the denoising thread there is something to run.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workers.gpu.frames import Frame, FramePipeline, FrameRunner, RealtimeCapacity, SessionParams
from workers.gpu.pipelines import DEFAULT_GUIDANCE_SCALE, DEFAULT_STRENGTH, MAX_SEED, RUNG_FULL, InvalidParams

log = logging.getLogger(__name__)

SESSION_PARAM_KEYS = ("width", "height", "steps", "seed", "guidance_scale")
PROMPT_CHARS = 1000  # the manifests' maxLength for prompts; a longer one is cut, not refused


class BadFrame(ValueError):
    """A frame message with a missing field or one of the wrong type."""


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

    def remove(self, session_id: str) -> LiveSession | None:
        return self._live.pop(session_id, None)

    def of_model(self, model_id: str) -> list[LiveSession]:
        return [session for session in self._live.values() if session.model_id == model_id]

    def clear(self) -> list[LiveSession]:
        live, self._live = list(self._live.values()), {}
        return live


def session_params(raw: Any, capacity: RealtimeCapacity, pipeline: FramePipeline,
                   rng: random.Random | None = None) -> SessionParams:
    """session_start.params with the session defaults filled in; raises InvalidParams."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidParams(f"params must be a JSON object, got {type(raw).__name__}")
    for key in ("width", "height", "steps"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidParams(f"{key} must be an integer, got {value!r}"[:200])
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


def parse_frame(message: dict[str, Any], session: LiveSession, received: float) -> Frame:
    """A frame message as a Frame of its session; raises BadFrame."""
    seq, image, params = message.get("seq"), message.get("image"), message.get("params")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise BadFrame(f"seq must be an integer, got {seq!r}"[:200])
    if not isinstance(image, str) or not image:
        raise BadFrame("image must be a non-empty base64 string")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadFrame(f"params must be a JSON object, got {type(params).__name__}")
    prompt = params.get("prompt", "")
    if not isinstance(prompt, str):
        raise BadFrame(f"params.prompt must be a string, got {type(prompt).__name__}")
    strength = params.get("strength", DEFAULT_STRENGTH)
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1:
        raise BadFrame(f"params.strength must be a number from 0 to 1, got {strength!r}"[:200])
    return Frame(session_id=session.session_id, seq=seq, model_id=session.model_id, params=session.params,
                 prompt=prompt[:PROMPT_CHARS], strength=float(strength), image=image, received=received)


class SessionDesk:
    """Answers session_start, frees slots on session_end, and queues frames of live sessions."""

    def __init__(self, pipelines: Mapping[str, FramePipeline], capacities: Mapping[str, RealtimeCapacity],
                 runner: FrameRunner, wake: Callable[[], None], *, clock: Callable[[], float],
                 rng: random.Random | None = None):
        # Realtime only on the full-residency rung, and only with a slot to give.
        self.capacities = {model_id: capacity for model_id, capacity in capacities.items()
                           if model_id in pipelines and pipelines[model_id].rung == RUNG_FULL}
        self.table = SessionTable({m: c.slots for m, c in self.capacities.items()})
        self._pipelines = pipelines
        self._runner = runner
        self._wake = wake
        self._clock = clock
        self._rng = rng

    def hello_entry(self, model_id: str, rung: str) -> dict[str, Any]:
        """The model's entry in hello.models."""
        capacity = self.capacities.get(model_id)
        realtime = capacity is not None and capacity.realtime
        return {"model_id": model_id, "rung": rung, "realtime": realtime,
                "frame_ms_p95": capacity.frame_ms_p95 if capacity is not None else None,
                "realtime_slots": capacity.slots if capacity is not None and realtime else 0}

    def holds(self, session_id: str) -> bool:
        return self.table.get(session_id) is not None

    def start(self, session_id: str, model_id: str, raw_params: Any) -> dict[str, Any]:
        """The answer to a session_start: session_accepted, or session_refused with a reason."""
        held = self.table.get(session_id)
        if held is not None and held.model_id == model_id:
            return {"type": "session_accepted", "session_id": session_id}  # a repeated start
        params: SessionParams | None = None
        reason = self._refusal(session_id, model_id)
        if reason is None:  # bad params first: they are refused everywhere, a full worker only here
            try:
                params = session_params(raw_params, self.capacities[model_id], self._pipelines[model_id], self._rng)
            except InvalidParams as exc:
                reason = f"bad params: {exc}"
        if reason is None and self.table.free(model_id) < 1:
            reason = f"no free realtime slot for model {model_id} ({self.table.slots[model_id]} in use)"
        if reason is not None or params is None:
            log.info("session %s (%s) refused: %s", session_id, model_id, reason)
            return {"type": "session_refused", "session_id": session_id, "reason": reason}
        self.table.add(LiveSession(session_id, model_id, params))
        log.info("session %s (%s) live at %dx%d, %d steps; %d of %d slot(s) in use", session_id, model_id,
                 params.width, params.height, params.steps, self.table.in_use(model_id),
                 self.table.slots[model_id])
        return {"type": "session_accepted", "session_id": session_id}

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
        by the client (`holds` turns false)."""
        session = self.table.remove(session_id)
        self._runner.drop_session(session_id)
        if session is not None:
            log.info("session %s (%s) ended; %d of %d slot(s) in use", session_id, session.model_id,
                     self.table.in_use(session.model_id), self.table.slots[session.model_id])

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

    def frame(self, session_id: str, message: dict[str, Any]) -> None:
        """Queue a frame of a live session (a frame of any other session is ignored)."""
        session = self.table.get(session_id)
        if session is None:
            log.debug("ignoring a frame of session %s, which is not live here", session_id)
            return
        if self._runner.queue.put(parse_frame(message, session, self._clock())):
            self._wake()

    def clear(self) -> None:
        """The connection dropped: the API sends these sessions back to its queue."""
        dropped = self.table.clear()
        self._runner.queue.clear()
        if dropped:
            log.info("connection lost: %d realtime session(s) dropped", len(dropped))
