"""The periodic session sweep (SESSION_SWEEP_SECONDS), one task per API process, running while at
least one browser socket of this process is open: each socket holds it from its join to its close.
With the last socket the process lets go of the shared admission's locks."""
from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from potocolom.runtime import Slot, runtime
from realtime.services import sessions_let_go, sessions_sweep

log = logging.getLogger(__name__)


class SessionSweep:
    """The sweep's task on this process's event loop, and how many browser sockets hold it."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.holds = 0

    def hold(self) -> None:
        """A browser socket joined: make sure the sweep runs on this event loop."""
        self.holds += 1
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(_sweep_forever(), name="session-sweep")

    async def release(self) -> None:
        """A browser socket closed; the sweep stops with the last one."""
        self.holds = max(0, self.holds - 1)
        if self.holds == 0 and self.task is not None:
            self.task.cancel()
            self.task = None
            await database_sync_to_async(sessions_let_go)()


SESSION_SWEEP = Slot("realtime.session_sweep", make=SessionSweep)


def sweeper_hold() -> None:
    """A browser socket joined: make sure the sweep runs on this event loop."""
    runtime.get(SESSION_SWEEP).hold()


async def sweeper_release() -> None:
    """A browser socket closed; the sweep stops with the last one."""
    await runtime.get(SESSION_SWEEP).release()


async def _sweep_forever() -> None:
    while True:
        await asyncio.sleep(settings.SESSION_SWEEP_SECONDS)
        try:
            await database_sync_to_async(sessions_sweep)(now=timezone.now())
        except Exception:  # one failed sweep must not stop the next
            log.exception("the session sweep failed")
