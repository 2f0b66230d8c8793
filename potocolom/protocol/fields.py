"""Readers of the worker socket's message fields (each raises MessageError with the field's rule)
and the base of its typed messages; potocolom.protocol.worker builds the messages on them. Pure:
no Django, no I/O."""
from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any, ClassVar

from potocolom.protocol.errors import MessageError

MAX_CHECKPOINT_CHARS = 8 * 2**20  # a checkpoint's base64 text (job_checkpoint, job_preempted, job.resume)
MAX_PREVIEW_CHARS = 512 * 1024  # a job_progress preview's base64 JPEG (at most 256 px on its long side)
MAX_STEPS = 100_000  # job_preempted / job_checkpoint `steps`: far above any real schedule


def string_field(message: dict[str, Any], name: str, *, max_length: int = 200) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise MessageError(f"{name} must be a non-empty string of at most {max_length} characters")
    return value


def int_field(message: dict[str, Any], name: str, *, minimum: int = 0) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MessageError(f"{name} must be an integer of at least {minimum}")
    return value


def number_or_none(message: dict[str, Any], name: str) -> float | None:
    value = message.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MessageError(f"{name} must be a number of at least 0, or null")
    return float(value)


def uuid_field(message: dict[str, Any], name: str) -> str:
    value = string_field(message, name, max_length=64)
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise MessageError(f"{name} must be a UUID string") from None


def step_fields(message: dict[str, Any]) -> tuple[int, int]:
    """`step` and `steps` of a step-boundary message: 0 <= step <= steps, 1 <= steps."""
    step, steps = int_field(message, "step"), int_field(message, "steps", minimum=1)
    if steps > MAX_STEPS or step > steps:
        raise MessageError(f"step must be at most steps, and steps at most {MAX_STEPS}")
    return step, steps


def checkpoint_bytes(text: Any) -> bytes:
    """A checkpoint's bytes from the wire's base64 text (at most MAX_CHECKPOINT_CHARS, standard
    alphabet); MessageError for anything else."""
    if not isinstance(text, str) or not text or len(text) > MAX_CHECKPOINT_CHARS:
        raise MessageError(f"checkpoint must be a non-empty base64 string of at most {MAX_CHECKPOINT_CHARS} "
                           "characters")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MessageError("checkpoint is not valid base64") from None


def checkpoint_field(message: dict[str, Any], *, nullable: bool) -> str | None:
    value = message.get("checkpoint")
    if value is None and nullable:
        return None
    checkpoint_bytes(value)  # checked here; the API decodes it again to store it
    return str(value)


def object_or_none(message: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = message.get(name)
    if value is not None and not isinstance(value, dict):
        raise MessageError(f"{name} must be an object or null")
    return value


class Message:
    """A message of the worker socket: `type` on the wire, the fields of its dataclass beside it."""

    type: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **self.__dict__}
