"""A scripted worker socket for browser tests: the `websockets` package in a thread and event loop
of its own, so a sync Playwright test can drive the page while the worker answers the API."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Self


class WorkerThread(threading.Thread):
    """Runs `serve()` (a subclass's script) on /ws/worker/ with `token`; what the API sent lands in
    `received`; `welcomed` is set once the API answered its hello, or when it failed (then `error`)."""

    def __init__(self, ws_url: str, token: str, *, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.url = f"{ws_url}/ws/worker/?token={token}"
        self.received: list[dict[str, Any]] = []
        self.welcomed = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self.serve())
        except BaseException as exc:  # reported by the test through `error`
            self.error = exc
            self.welcomed.set()

    def __enter__(self) -> Self:
        """Start it and wait for the API's welcome (a failure to connect fails the test here)."""
        self.start()
        assert self.welcomed.wait(30) and self.error is None, self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def serve(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError
