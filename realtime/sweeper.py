"""The periodic session sweep (SESSION_SWEEP_SECONDS), one task per API process, running while at
least one browser socket of this process is open: each socket holds it from its join to its close.
With the last socket the process lets go of the shared admission's locks."""
from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from realtime.services import sessions_let_go, sessions_sweep

log = logging.getLogger(__name__)
_task: asyncio.Task | None = None
_holds = 0


def sweeper_hold() -> None:
    """A browser socket joined: make sure the sweep runs on this event loop."""
    global _task, _holds
    _holds += 1
    loop = asyncio.get_running_loop()
    if _task is None or _task.done() or _task.get_loop() is not loop:
        _task = loop.create_task(_sweep_forever(), name="session-sweep")


async def sweeper_release() -> None:
    """A browser socket closed; the sweep stops with the last one."""
    global _task, _holds
    _holds = max(0, _holds - 1)
    if _holds == 0 and _task is not None:
        _task.cancel()
        _task = None
        await database_sync_to_async(sessions_let_go)()


async def _sweep_forever() -> None:
    while True:
        await asyncio.sleep(settings.SESSION_SWEEP_SECONDS)
        try:
            await database_sync_to_async(sessions_sweep)(now=timezone.now())
        except Exception:  # one failed sweep must not stop the next
            log.exception("the session sweep failed")
