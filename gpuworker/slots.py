"""Realtime slots, measured at load: frames of the session defaults timed at batch sizes 1, 2, 4, ...
(`measure_capacity`), and the slots the timings give within the frame budget
(`slots_from_measurements`, pure). Why so: docs/design/frame-batching.md."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuworker.frames import FramePipeline
from gpuworker.pipelines import DEFAULT_GUIDANCE_SCALE, SIZE_MULTIPLE, FrameRequest

FRAME_BUDGET_MS = 500.0  # the contract's default per-frame p95 budget
SESSION_STEPS = 2  # a session's steps when session_start names none (and what slots are measured at)
MEASURE_STRENGTH = 1.0  # every step runs: the heaviest frame of a default session
BATCH_CAP = 16  # the largest batch measured, so the most slots a model advertises
MEASURE_REPEATS = 4  # timed calls per batch size (after one untimed warm-up call of that size)
MEASURE_SECONDS = 10.0  # no larger batch size is tried once measuring a model took this long


def frame_budget_ms_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """FRAME_BUDGET_MS from the environment, default 500; a bad value fails loudly."""
    text = environ.get("FRAME_BUDGET_MS", "").strip()
    if not text:
        return FRAME_BUDGET_MS
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"FRAME_BUDGET_MS must be a number of milliseconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"FRAME_BUDGET_MS must be above 0, got {text!r}")
    return value


def p95(samples: Sequence[float]) -> float:
    """The nearest-rank 95th percentile (the slowest sample when there are 20 or fewer)."""
    if not samples:
        raise ValueError("p95 of no samples")
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def batch_sizes(cap: int = BATCH_CAP) -> list[int]:
    """1, 2, 4, ... up to cap (cap itself included when it is not a power of two)."""
    sizes, size = [], 1
    while size < cap:
        sizes.append(size)
        size *= 2
    return [*sizes, cap] if cap >= 1 else []


def slots_from_measurements(measured: Mapping[int, Sequence[float]], budget_ms: float) -> tuple[float | None, int]:
    """(frame_ms_p95, realtime_slots) from {batch_size: [ms per call, ...]}.

    frame_ms_p95 is batch 1's p95 (None when batch 1 was not measured); realtime_slots is the
    largest batch size whose p95 is within budget_ms, counting up from the smallest and stopping
    at the first size over budget (or with no samples).
    """
    frame_ms = p95(measured[1]) if measured.get(1) else None
    slots = 0
    for size in sorted(measured):
        samples = measured[size]
        if size < 1 or not samples or p95(samples) > budget_ms:
            break
        slots = size
    return frame_ms, slots


def smallest_size(schema: Mapping[str, Any], key: str, default: int) -> int:
    """The smallest width (or height) a params_schema allows that the pipeline can run."""
    spec = schema.get("properties", {}).get(key, {}) if isinstance(schema, Mapping) else {}
    if isinstance(spec.get("enum"), list):
        allowed = [v for v in spec["enum"] if isinstance(v, int) and v > 0 and v % SIZE_MULTIPLE == 0]
        if allowed:
            return min(allowed)
    low = spec.get("minimum")
    if isinstance(low, (int, float)) and low > 0:
        return max(SIZE_MULTIPLE, math.ceil(low / SIZE_MULTIPLE) * SIZE_MULTIPLE)
    return default


# --- measuring ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealtimeCapacity:
    """What one model can do in realtime on this worker, as measured at load."""

    frame_ms_p95: float | None
    slots: int
    width: int  # the session defaults the slots were measured at
    height: int
    steps: int
    measured: Mapping[int, Sequence[float]]  # {batch_size: [ms, ...]}

    @property
    def realtime(self) -> bool:
        return self.slots > 0


def measure_batches(run_batch: Callable[[int], object], budget_ms: float, *, cap: int = BATCH_CAP,
                    repeats: int = MEASURE_REPEATS, max_seconds: float = MEASURE_SECONDS,
                    clock: Callable[[], float] = time.perf_counter) -> dict[int, list[float]]:
    """Time run_batch(n) at n = 1, 2, 4, ... up to cap: {n: [ms, ...]}, each size after one untimed
    warm-up call of that size (on CUDA a new batch shape's first call picks its kernels: it took
    6x a warm call on an H200, enough to cost a model most of its slots).

    A batch size stops at its first call over budget (its p95 is over then), and no larger size
    is tried after one over budget or once max_seconds have gone by.
    """
    started = clock()
    measured: dict[int, list[float]] = {}
    for size in batch_sizes(cap):
        samples = measured.setdefault(size, [])
        run_batch(size)  # warm-up: the first call of each shape pays for lazy setup (kernel choice on CUDA)
        for _ in range(repeats):
            before = clock()
            run_batch(size)
            samples.append((clock() - before) * 1000)
            if samples[-1] > budget_ms:
                break
        if p95(samples) > budget_ms or clock() - started > max_seconds:
            break
    return measured


def measure_capacity(pipeline: FramePipeline, schema: Mapping[str, Any], default_size: int, budget_ms: float,
                     **measure: Any) -> RealtimeCapacity:
    """Measure one model's frames at the session defaults (see the module docstring)."""
    from PIL import Image as PILImage

    width = smallest_size(schema, "width", default_size)
    height = smallest_size(schema, "height", default_size)
    image = PILImage.new("RGB", (width, height), (128, 128, 128))

    def run_batch(size: int) -> None:
        pipeline.generate_frames(FrameRequest(
            prompts=["a quick sketch"] * size, images=[image] * size, seeds=list(range(size)), width=width,
            height=height, steps=SESSION_STEPS, guidance_scale=DEFAULT_GUIDANCE_SCALE, strength=MEASURE_STRENGTH))

    measured = measure_batches(run_batch, budget_ms, **measure)
    frame_ms, slots = slots_from_measurements(measured, budget_ms)
    return RealtimeCapacity(frame_ms_p95=None if frame_ms is None else round(frame_ms, 1), slots=slots,
                            width=width, height=height, steps=SESSION_STEPS, measured=measured)


def describe(model_id: str, capacity: RealtimeCapacity, budget_ms: float) -> str:
    """One log line about a model's measured frames."""
    p95s = ", ".join(f"{size}: {p95(ms):.0f}" for size, ms in sorted(capacity.measured.items()) if ms)
    return (f"{model_id}: frame p95 {capacity.frame_ms_p95} ms at {capacity.width}x{capacity.height}, "
            f"{capacity.steps} steps; {capacity.slots} realtime slot(s) within {budget_ms:g} ms "
            f"(batch p95 ms {{{p95s}}})")
