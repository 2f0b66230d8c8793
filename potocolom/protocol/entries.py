"""The model entries of the worker socket: what a worker serves (`ModelEntry`, in its hello,
rung_changed and model_loaded). Pure: no Django, no I/O; docs/protocol.md, "Worker socket"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from potocolom.protocol.errors import MessageError
from potocolom.protocol.fields import number_or_none, string_field
from potocolom.protocol.rungs import RUNG_FULL, RUNGS


@dataclass(frozen=True)
class ModelEntry:
    """A model a worker serves, in its hello (and its rung_changed): realtime only on rung full."""

    model_id: str
    rung: str
    realtime: bool = False
    frame_ms_p95: float | None = None
    realtime_slots: int = 0

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def parse(cls, entry: Any) -> ModelEntry:
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
        realtime = realtime and rung == RUNG_FULL
        return cls(string_field(entry, "model_id"), rung, realtime, number_or_none(entry, "frame_ms_p95"),
                   slots if realtime else 0)
