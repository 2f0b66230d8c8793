"""The model entries of the worker socket: what a worker serves (`ModelEntry`, in its hello,
rung_changed and model_loaded) and what it could load (`InstalledEntry`, a v2 hello's `installed`).
Pure: no Django, no I/O; docs/protocol.md, "Worker socket" and "Placement"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from potocolom.protocol.errors import MessageError
from potocolom.protocol.fields import int_field, number_or_none, string_field
from potocolom.protocol.rungs import RUNG_FULL, RUNGS


@dataclass(frozen=True)
class ModelEntry:
    """A model a worker serves, in its hello (and its rung_changed, model_loaded): realtime only on
    rung full. `step_ms` (v2, once measured): one denoising step at the model's default size on
    the full rung, in milliseconds; left off the wire when unknown."""

    model_id: str
    rung: str
    realtime: bool = False
    frame_ms_p95: float | None = None
    realtime_slots: int = 0
    step_ms: float | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = dict(self.__dict__)
        if self.step_ms is None:
            del wire["step_ms"]
        return wire

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
                   slots if realtime else 0, number_or_none(entry, "step_ms"))


MAX_NEEDS_MIB = 2**31  # a rung's need in MiB: far above any device (2 PiB)


@dataclass(frozen=True)
class InstalledEntry:
    """A model in a v2 worker's models dir, loaded or not: the device memory (MiB) each rung needs
    at the largest size it allows, and `step_ms` once measured (None before)."""

    model_id: str
    needs_mib: dict[str, int]  # every rung of RUNGS
    step_ms: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "needs_mib": dict(self.needs_mib), "step_ms": self.step_ms}

    @classmethod
    def parse(cls, entry: Any) -> InstalledEntry:
        if not isinstance(entry, dict):
            raise MessageError("each entry of installed must be an object")
        needs = entry.get("needs_mib")
        if not isinstance(needs, dict) or set(needs) != set(RUNGS):
            raise MessageError(f"needs_mib must be an object with exactly {', '.join(RUNGS)}")
        mib = {rung: int_field(needs, rung) for rung in RUNGS}
        if any(value > MAX_NEEDS_MIB for value in mib.values()):
            raise MessageError(f"needs_mib values must be at most {MAX_NEEDS_MIB}")
        return cls(string_field(entry, "model_id"), mib, number_or_none(entry, "step_ms"))
