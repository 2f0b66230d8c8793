"""Typed messages of the worker socket (Worker -> API), parsed from JSON with clear errors."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

RUNGS = ("full", "model_offload", "group_offload")


class MessageError(ValueError):
    """A message does not follow the contract."""


def _str(message: dict[str, Any], name: str, *, max_length: int = 200) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise MessageError(f"{name} must be a non-empty string of at most {max_length} characters")
    return value


def _int(message: dict[str, Any], name: str, *, minimum: int = 0) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MessageError(f"{name} must be an integer of at least {minimum}")
    return value


def _number_or_none(message: dict[str, Any], name: str) -> float | None:
    value = message.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MessageError(f"{name} must be a number of at least 0, or null")
    return float(value)


@dataclass(frozen=True)
class ModelEntry:
    model_id: str
    rung: str
    realtime: bool
    frame_ms_p95: float | None
    realtime_slots: int

    def as_dict(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "rung": self.rung, "realtime": self.realtime,
                "frame_ms_p95": self.frame_ms_p95, "realtime_slots": self.realtime_slots}


@dataclass(frozen=True)
class Hello:
    worker_id: str
    gpu: dict[str, Any] | None
    models: tuple[ModelEntry, ...]


def parse_model_entry(entry: Any) -> ModelEntry:
    if not isinstance(entry, dict):
        raise MessageError("each entry of models must be an object")
    rung = entry.get("rung")
    if rung not in RUNGS:
        raise MessageError(f"rung must be one of {', '.join(RUNGS)}")
    realtime = entry.get("realtime", False)
    if not isinstance(realtime, bool):
        raise MessageError("realtime must be a boolean")
    slots = entry.get("realtime_slots", 0)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise MessageError("realtime_slots must be an integer of at least 0")
    # Only full residency serves realtime sessions.
    realtime = realtime and rung == "full"
    return ModelEntry(_str(entry, "model_id"), rung, realtime, _number_or_none(entry, "frame_ms_p95"),
                      slots if realtime else 0)


def parse_hello(message: dict[str, Any]) -> Hello:
    gpu = message.get("gpu")
    if gpu is not None and not isinstance(gpu, dict):
        raise MessageError("gpu must be an object or null")
    models = message.get("models")
    if not isinstance(models, list) or len(models) > 1000:
        raise MessageError("models must be a list")
    entries = tuple(parse_model_entry(entry) for entry in models)
    if len({e.model_id for e in entries}) != len(entries):
        raise MessageError("a model_id appears twice in models")
    return Hello(_str(message, "worker_id"), gpu, entries)


@dataclass(frozen=True)
class JobResult:
    job_id: str
    images: list[str]
    gpu_ms: float | None
    rung: str


def _uuid(message: dict[str, Any], name: str) -> str:
    value = _str(message, name, max_length=64)
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise MessageError(f"{name} must be a UUID string") from None


def parse_job_id(message: dict[str, Any]) -> str:
    return _uuid(message, "job_id")


def parse_job_progress(message: dict[str, Any]) -> tuple[str, int, int]:
    return parse_job_id(message), _int(message, "step"), _int(message, "steps")


def parse_job_result(message: dict[str, Any]) -> JobResult:
    images = message.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
        raise MessageError("images must be a non-empty list of base64 strings")
    rung = message.get("rung", "")
    if not isinstance(rung, str):
        raise MessageError("rung must be a string")
    return JobResult(parse_job_id(message), images, _number_or_none(message, "gpu_ms"), rung)


def parse_job_failed(message: dict[str, Any]) -> tuple[str, str]:
    error = message.get("error")
    if not isinstance(error, str):
        raise MessageError("error must be a string")
    return parse_job_id(message), error or "failed"


# --- realtime sessions ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FrameResult:
    session_id: str
    seq: int
    image: str  # bare base64 (or a data: URL), PNG or JPEG
    gpu_ms: float | None


@dataclass(frozen=True)
class RungChanged:
    model_id: str
    rung: str
    realtime: bool
    realtime_slots: int
    frame_ms_p95: float | None


def parse_session_id(message: dict[str, Any]) -> str:
    return _uuid(message, "session_id")


def parse_session_refused(message: dict[str, Any]) -> tuple[str, str]:
    reason = message.get("reason", "")
    if not isinstance(reason, str):
        raise MessageError("reason must be a string")
    return parse_session_id(message), reason[:500]


def parse_frame_result(message: dict[str, Any]) -> FrameResult:
    image = message.get("image")
    if not isinstance(image, str) or not image:
        raise MessageError("image must be a base64 string")
    return FrameResult(parse_session_id(message), _int(message, "seq"), image, _number_or_none(message, "gpu_ms"))


def parse_rung_changed(message: dict[str, Any]) -> RungChanged:
    entry = parse_model_entry(message)
    return RungChanged(entry.model_id, entry.rung, entry.realtime, entry.realtime_slots, entry.frame_ms_p95)
