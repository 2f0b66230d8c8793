"""StepHooks, what a job does at its step boundaries, in the order the pipeline's step callback relies
on: progress with its preview, cancel before and after it, then preempt or a periodic checkpoint."""
from __future__ import annotations

from typing import Any

import pytest

from gpuworker.step_hooks import JobCancelled, PreemptedAtStep, StepBoundary, StepHooks


class Capture:
    """A boundary's capture: counts its calls, hands back a stand-in checkpoint."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        return f"checkpoint {self.calls}"


def boundary(step: int, steps: int = 4, capture: Capture | None = None) -> StepBoundary:
    return StepBoundary(step, steps, f"latents after {step}", capture or Capture())


def test_it_reports_each_step_with_the_preview_made_of_its_latents() -> None:
    reported: list[tuple[int, int, str | None]] = []
    hooks = StepHooks(progress=lambda step, steps, preview: reported.append((step, steps, preview)),
                      preview=lambda step, steps, latents: f"preview of {latents}" if step % 2 == 0 else None)

    for step in (1, 2):
        hooks.step_end(boundary(step))

    assert reported == [(1, 4, None), (2, 4, "preview of latents after 2")]


def test_a_cancel_asked_while_progress_ran_leaves_at_that_boundary_before_preempt_is_asked() -> None:
    cancelled = False
    asked: list[int] = []

    def progress(step: int, steps: int, preview: str | None) -> None:
        nonlocal cancelled
        cancelled = True  # as a cancel arriving while frames ran between two steps

    def preempted() -> bool:
        asked.append(1)
        return False

    hooks = StepHooks(progress=progress, cancelled=lambda: cancelled, preempted=preempted)

    with pytest.raises(JobCancelled):
        hooks.step_end(boundary(1))
    assert asked == []


def test_it_preempts_at_the_step_boundary_with_the_checkpoint_captured_there() -> None:
    capture = Capture()
    hooks = StepHooks(preempted=lambda: True, checkpoint_due=lambda: True, on_checkpoint=lambda c: None)

    with pytest.raises(PreemptedAtStep) as stopped:
        hooks.step_end(boundary(3, 4, capture))

    assert (stopped.value.step, stopped.value.steps, stopped.value.checkpoint) == (3, 4, "checkpoint 1")
    assert capture.calls == 1


def test_it_checkpoints_at_the_step_boundary_when_asked_and_goes_on() -> None:
    due = iter([False, True, False])
    kept: list[Any] = []
    captures = [Capture() for _ in range(3)]
    hooks = StepHooks(checkpoint_due=lambda: next(due), on_checkpoint=kept.append)

    for step, capture in enumerate(captures, 1):
        hooks.step_end(boundary(step, 3, capture))

    assert kept == ["checkpoint 1"] and [c.calls for c in captures] == [0, 1, 0]


def test_before_the_first_step_only_preempt_and_checkpoints_apply() -> None:
    reported: list[int] = []
    hooks = StepHooks(progress=lambda step, steps, preview: reported.append(step), cancelled=lambda: True,
                      preempted=lambda: True)

    with pytest.raises(PreemptedAtStep) as stopped:
        hooks.before_first_step(boundary(0))

    assert stopped.value.step == 0 and reported == []
    assert hooks.captures and not StepHooks(progress=lambda *_: None, cancelled=lambda: False).captures
