"""The periodic admission and idle sweep (SESSION_SWEEP_SECONDS), one task per API process.

It runs while at least one browser socket is open in this process: each socket takes a hold on
it when its session joins and lets go when it closes.

Several API processes (realtime/shared.py): each one's task applies the idle rule to its own
sessions at once and then every period, and the shared part of the sweep runs only in the process
holding the sweep lock (realtime/presence.py); when that process dies, another takes the lock at
its next tick. With the last socket, the process lets go of its locks.
"""
from __future__ import annotations

import asyncio
import logging
import time

from channels.db import database_sync_to_async
from django.conf import settings

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


def sweeper_release() -> None:
    """A browser socket closed; the sweep stops with the last one."""
    global _task, _holds
    _holds = max(0, _holds - 1)
    if _holds == 0 and _task is not None:
        _task.cancel()
        _task = None
        from realtime.presence import close_presence

        close_presence()


async def _sweep_forever() -> None:
    from realtime.services import sessions_sweep, sessions_tick, shared_sessions

    shared = await database_sync_to_async(shared_sessions)()
    while True:
        if not shared:
            await asyncio.sleep(settings.SESSION_SWEEP_SECONDS)
        try:
            await database_sync_to_async(sessions_tick if shared else sessions_sweep)(now=time.monotonic())
        except Exception:  # one failed sweep must not stop the next
            log.exception("the session sweep failed")
        if shared:
            await asyncio.sleep(settings.SESSION_SWEEP_SECONDS)
