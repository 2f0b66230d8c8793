"""What placement keeps on a worker row (Worker.placement), as plain data: the loads and unloads
sent and not answered, failed loads, when the API loaded each model and the memory it took. Read
and written by workers.services (the rows' writer) and read by fleet.placement.driver (the driver)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

LOAD: Literal["load"] = "load"
UNLOAD: Literal["unload"] = "unload"


@dataclass(frozen=True)
class PlacementAction:
    """One thing to ask a worker: `load_model` (with its rung) or `unload_model` (rung None), and
    why, in words for the placement log."""

    kind: Literal["load", "unload"]
    worker_id: str
    model_id: str
    rung: str | None
    reason: str


@dataclass
class Waiting:
    """What placement waits for on one worker (Worker.placement), plain data: loads sent and not
    answered (model_id -> rung), unloads sent and not answered, when loads failed and when the API
    loaded models (epoch seconds), and the memory each API-loaded model took (MiB, measured as the
    drop of its worker's free memory)."""

    loading: dict[str, str]
    unloading: list[str]
    failed: dict[str, float]
    loaded_at: dict[str, float]
    held_mib: dict[str, int]

    @classmethod
    def of(cls, raw: Any) -> Waiting:
        raw = raw if isinstance(raw, dict) else {}
        return cls(dict(raw.get("loading") or {}), list(raw.get("unloading") or []), dict(raw.get("failed") or {}),
                   dict(raw.get("loaded_at") or {}), dict(raw.get("held_mib") or {}))

    def to_json(self) -> dict[str, Any]:
        return {"loading": self.loading, "unloading": self.unloading, "failed": self.failed,
                "loaded_at": self.loaded_at, "held_mib": self.held_mib}

    def keep_only(self, loaded: set[str]) -> None:
        """A new connection: what was sent on the old one is not waited for any more (an answer that
        still comes is taken all the same), and what was loaded is known by its hello."""
        self.loading, self.unloading = {}, []
        self.loaded_at = {m: t for m, t in self.loaded_at.items() if m in loaded}
        self.held_mib = {m: n for m, n in self.held_mib.items() if m in loaded}


def epoch(moment: datetime) -> float:
    return moment.timestamp()


def free_mib(gpu: Any) -> int | None:
    if isinstance(gpu, dict) and isinstance(gpu.get("free_mib"), int) and not isinstance(gpu["free_mib"], bool):
        return int(gpu["free_mib"])
    return None
