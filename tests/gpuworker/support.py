"""Helpers shared by the GPU worker's tests: bounded async bodies and a gate inside a job."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

TEST_SECONDS = 90.0  # a bound on any one test's async body, so a hang fails instead of blocking


def run_async(body: Coroutine[Any, Any, Any], timeout: float = TEST_SECONDS) -> Any:
    """Run a test's async body to completion (no asyncio plugin needed)."""
    async def bounded() -> Any:
        return await asyncio.wait_for(body, timeout)
    return asyncio.run(bounded())


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

    def generate(self, params: Any, *, on_step: Any = None, should_stop: Any = None, **boundaries: Any) -> Any:
        """The real call (with the step-boundary arguments as given), parked after each step report
        until the gate opens."""
        def step(index: int, steps: int) -> None:
            if on_step is not None:
                on_step(index, steps)
            self.parked.set()
            if not self.gate.wait(TEST_SECONDS):
                raise TimeoutError("the test never opened the gate")

        return self.inner.generate(params, on_step=step, should_stop=should_stop, **boundaries)

    def __getattr__(self, name: str) -> Any:
        """Everything else (check_inputs, generate_frames for realtime frames) is the real pipeline's."""
        return getattr(self.inner, name)
