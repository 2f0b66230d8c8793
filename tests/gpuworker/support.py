"""Helpers shared by the GPU worker's tests: bounded async bodies and a gate inside a job."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from gpuworker.step_hooks import StepHooks

TEST_SECONDS = 90.0  # a bound on any one test's async body, so a hang fails instead of blocking


def run_async(body: Coroutine[Any, Any, Any], timeout: float = TEST_SECONDS) -> Any:
    """Run a test's async body to completion (no asyncio plugin needed)."""
    async def bounded() -> Any:
        return await asyncio.wait_for(body, timeout)
    return asyncio.run(bounded())


Step = Callable[[int, int], None]  # (step, steps)


def around_progress(hooks: StepHooks | None, *, before: Step | None = None, after: Step | None = None) -> StepHooks:
    """The job's step hooks with `before` and `after` run around each progress report (a test's
    wrapper pipeline parks a job there, or moves its clock)."""
    hooks = hooks or StepHooks()

    def progress(step: int, steps: int, preview: str | None) -> None:
        if before is not None:
            before(step, steps)
        if hooks.progress is not None:
            hooks.progress(step, steps, preview)
        if after is not None:
            after(step, steps)

    return replace(hooks, progress=progress)


class GatedPipeline:
    """The real pipeline, held inside its first step report until the test opens the gate.

    With the worker parked there, a test can send messages (cancel, a duplicate job) and know they
    arrive while a job is running and others wait, without any timing assumption.
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.rung = inner.rung
        self.gate = threading.Event()
        self.parked = threading.Event()  # set once the denoising thread waits at the gate

    def generate(self, params: Any, *, hooks: StepHooks | None = None, resume: Any = None) -> Any:
        """The real call (with the job's step hooks), parked after each step report until the gate opens."""
        def park(step: int, steps: int) -> None:
            self.parked.set()
            if not self.gate.wait(TEST_SECONDS):
                raise TimeoutError("the test never opened the gate")

        return self.inner.generate(params, hooks=around_progress(hooks, after=park), resume=resume)

    def __getattr__(self, name: str) -> Any:
        """Everything else (check_inputs, generate_frames for realtime frames) is the real pipeline's."""
        return getattr(self.inner, name)
