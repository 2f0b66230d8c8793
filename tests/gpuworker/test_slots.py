"""Realtime slots: the slot rule and the measurement loop, on fakes and on the tiny model."""
from __future__ import annotations

from typing import Any

import pytest

from gpuworker.slots import (
    batch_sizes,
    frame_budget_ms_from_env,
    measure_batches,
    measure_capacity,
    p95,
    slots_from_measurements,
    smallest_size,
)


@pytest.mark.parametrize(("measured", "budget", "expected"), [
    ({1: [100, 120, 110], 2: [180, 190], 4: [390, 410], 8: [900]}, 500, (120, 4)),
    ({1: [100], 2: [180], 4: [501]}, 500, (100, 2)),
    ({1: [100], 2: [180], 4: [500]}, 500, (100, 4)),  # within the budget means at most it
    ({1: [600]}, 500, (600, 0)),  # too slow for even one session: no realtime
    ({1: [100, 100, 100, 700]}, 500, (700, 0)),  # p95 of a few samples is the slowest one
    ({1: [100], 2: [900], 4: [300]}, 500, (100, 1)),  # no size counts after one over budget
    ({1: [100], 2: []}, 500, (100, 1)),
    ({}, 500, (None, 0)),
    ({1: [40], 2: [60], 4: [90], 8: [160], 16: [300]}, 500, (40, 16)),
    ({1: [40], 2: [60], 4: [90]}, 50, (40, 1)),
])
def test_it_counts_slots_as_the_largest_batch_within_the_budget_at_p95(
        measured: dict[int, list[float]], budget: float, expected: tuple[float | None, int]) -> None:
    assert slots_from_measurements(measured, budget) == expected


@pytest.mark.parametrize(("samples", "expected"), [
    ([5.0], 5.0), ([3.0, 1.0, 2.0], 3.0), (list(range(1, 21)), 19), (list(range(1, 101)), 95)])
def test_it_takes_the_nearest_rank_p95(samples: list[float], expected: float) -> None:
    assert p95(samples) == expected


@pytest.mark.parametrize(("cap", "sizes"), [(16, [1, 2, 4, 8, 16]), (1, [1]), (6, [1, 2, 4, 6]), (0, [])])
def test_it_measures_powers_of_two_up_to_the_cap(cap: int, sizes: list[int]) -> None:
    assert batch_sizes(cap) == sizes


class FakeClock:
    """Time moves only when a fake batch runs: `cost(size)` milliseconds."""

    def __init__(self, cost: Any):
        self.now, self.cost = 0.0, cost
        self.calls: list[Any] = []

    def __call__(self) -> float:
        return self.now

    def run(self, size: int) -> None:
        self.calls.append(size)
        self.now += self.cost(size, len(self.calls)) / 1000


def test_it_measures_until_a_batch_is_over_budget_and_stops_that_batch_at_once() -> None:
    clock = FakeClock(lambda size, call: 100 + 120 * size)  # 220, 340, 580 ms
    measured = measure_batches(clock.run, 500, repeats=3, clock=clock)

    assert clock.calls == [1, 1, 1, 1, 2, 2, 2, 2, 4, 4]  # per size a warm-up, then three; one timed of 4
    assert measured == {1: pytest.approx([220] * 3), 2: pytest.approx([340] * 3), 4: pytest.approx([580])}
    assert slots_from_measurements(measured, 500) == (pytest.approx(220), 2)


def test_the_first_call_of_each_batch_size_is_not_timed() -> None:
    """On CUDA the first call at a new batch shape picks its kernels: seen on an H200, an SD-1.5-sized
    model's first batch of 2 took 907 ms against 152 ms after. Timed, it cost the model 7 of its 8 slots."""
    first_of_size: set[int] = set()

    def cost(size: int, call: int) -> float:
        cold = size not in first_of_size
        first_of_size.add(size)
        return 100 * size + (900 if cold else 0)

    clock = FakeClock(cost)
    measured = measure_batches(clock.run, 500, cap=8, repeats=3, clock=clock)

    assert measured == {1: pytest.approx([100] * 3), 2: pytest.approx([200] * 3), 4: pytest.approx([400] * 3),
                        8: pytest.approx([800])}
    assert slots_from_measurements(measured, 500) == (pytest.approx(100), 4)


def test_it_stops_growing_the_batch_when_measuring_took_too_long() -> None:
    clock = FakeClock(lambda size, call: 10 * size)
    measured = measure_batches(clock.run, 500, repeats=2, clock=clock, max_seconds=0.05)

    assert sorted(measured) == [1, 2]  # 3x10 + 3x20 ms > 50 ms after batch 2 (a warm-up each)
    assert measure_batches(FakeClock(lambda s, c: 1.0).run, 500, cap=4, clock=FakeClock(lambda s, c: 0)) \
        .keys() == {1, 2, 4}


@pytest.mark.parametrize(("spec", "expected"), [
    ({"enum": [512, 64, 128]}, 64), ({"enum": [100, 256]}, 256), ({"minimum": 60}, 64), ({"minimum": 0}, 96),
    ({}, 96), ({"enum": []}, 96)])
def test_it_finds_the_smallest_size_the_schema_allows(spec: dict[str, Any], expected: int) -> None:
    assert smallest_size({"properties": {"width": spec}}, "width", 96) == expected


@pytest.mark.parametrize(("text", "expected"), [(None, 500.0), ("", 500.0), ("250", 250.0), (" 80.5 ", 80.5)])
def test_it_reads_the_frame_budget_from_the_environment(text: str | None, expected: float) -> None:
    assert frame_budget_ms_from_env({} if text is None else {"FRAME_BUDGET_MS": text}) == expected


@pytest.mark.parametrize("text", ["fast", "0", "-5"])
def test_it_refuses_a_bad_frame_budget(text: str) -> None:
    with pytest.raises(ValueError, match="FRAME_BUDGET_MS"):
        frame_budget_ms_from_env({"FRAME_BUDGET_MS": text})


def test_it_measures_the_tiny_models_frames_at_the_session_defaults(tiny_pipeline: Any) -> None:
    capacity = measure_capacity(tiny_pipeline, tiny_pipeline.model.params_schema, tiny_pipeline.default_size,
                                budget_ms=60_000, cap=2, repeats=1)

    assert (capacity.width, capacity.height, capacity.steps) == (64, 64, 2)
    assert sorted(capacity.measured) == [1, 2] and capacity.slots == 2
    assert capacity.frame_ms_p95 is not None and capacity.frame_ms_p95 > 0
