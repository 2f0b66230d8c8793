"""SIGTERM's drain: say `draining`, give back every held job and end every live session, then stop
once the API has acknowledged every final message, within `drain_seconds`; docs/protocol.md,
"Drain in `runworker_gpu`" under "Worker → API", and docs/operations.md."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpuworker.outbox import Outgoing
from potocolom.protocol.worker import Draining, SessionEnded

if TYPE_CHECKING:
    from gpuworker.connection import Connection
    from gpuworker.job_desk import JobDesk
    from gpuworker.sessions import SessionDesk

log = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 30.0  # --drain-seconds
EXIT_DRAINED = 0  # run() ended: stopped, or drained with every final message acknowledged
EXIT_DRAIN_TIMED_OUT = 1  # the drain's deadline passed with messages unacknowledged or jobs held
EXIT_STOPPED_AT_ONCE = 2  # a second SIGTERM during a drain


class Drained(Protocol):
    """What a drain needs of the worker (worker.GpuWorker)."""

    connection: Connection
    jobs: JobDesk
    sessions: SessionDesk

    def stop(self) -> None: ...


class Drain:
    """The worker's drain, from the first SIGTERM (`terminate`) until it stops; `exit_status` is
    what the program exits with."""

    def __init__(self, worker: Drained, seconds: float, clock: Callable[[], float]):
        self.seconds = seconds
        self.exit_status = EXIT_DRAINED
        self.active = False
        self._worker = worker
        self._clock = clock
        self._moved: asyncio.Event | None = None  # something the drain waits on moved (once it began)
        self._said_on = 0  # the connection (by its welcome count) that heard our `draining`
        self._task: asyncio.Task[None] | None = None

    def terminate(self) -> None:
        """On the event loop, at each SIGTERM: the first drains; a second one stops at once."""
        worker = self._worker
        if not worker.connection.serving:
            worker.stop()  # stopping already (the drain ended, or it was never started): nothing to cut short
            return
        if self.active:
            log.warning("second SIGTERM: stopping at once; the API sends back what is still held here")
            self.exit_status = EXIT_STOPPED_AT_ONCE
            worker.stop()
            return
        self.active = True
        self._moved = asyncio.Event()
        log.info("SIGTERM: draining (at most %.0f s): giving back %d job(s) and %d session(s)", self.seconds,
                 len(worker.jobs), len(worker.sessions.table.session_ids()))
        self._task = asyncio.ensure_future(self._run())

    def moved(self) -> None:
        """Something a drain waits on moved: a job released, a message sent or acknowledged, a stop."""
        if self._moved is not None:
            self._moved.set()

    def turn(self) -> None:
        """Once on each live connection: `draining`, then every held job given back and every session ended."""
        connection = self._worker.connection
        if not self.active or not connection.live or self._said_on == connection.welcomes:
            return
        self._said_on = connection.welcomes
        if not connection.v2:  # nothing can be given back: the API sends the jobs back as for a dead worker
            log.warning("the API speaks protocol 1, which has no drain: stopping now")
            self._worker.stop()
            return
        message = Draining()
        connection.enqueue(Outgoing(message.type, json.dumps(message.to_wire()), None))
        for job in self._worker.jobs.held():
            if not job.preempt_asked:
                self._worker.jobs.give_back(job)
        sessions = self._worker.sessions
        for session_id in sessions.table.session_ids():
            sessions.end(session_id)
            ended = SessionEnded(session_id)
            connection.enqueue(Outgoing(ended.type, json.dumps(ended.to_wire()), None))
        self.moved()

    async def _run(self) -> None:
        """Wait until everything is back with the API, the worker stops, or the deadline passes."""
        connection = self._worker.connection
        assert self._moved is not None
        deadline = self._clock() + self.seconds
        self.turn()
        while not self._drained() and connection.serving:
            left = deadline - self._clock()
            if left <= 0:
                break
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except TimeoutError:
                break
        if not connection.serving:
            return  # stopped meanwhile (a second SIGTERM, SIGINT, a v1 API): with the status they set
        if self._drained():
            log.info("drained: every job given back and acknowledged; exiting")
        else:
            self.exit_status = EXIT_DRAIN_TIMED_OUT
            log.warning("drain deadline of %.0f s passed: %d job(s) still held, %d answer(s) not acknowledged",
                        self.seconds, len(self._worker.jobs), len(connection.outbox.final_ids))
        self._worker.stop()

    def _drained(self) -> bool:
        """Nothing held, nothing waiting to be sent or acknowledged: the API has everything back."""
        outbox = self._worker.connection.outbox
        return len(self._worker.jobs) == 0 and not outbox.final_ids and len(outbox) == 0
