"""A background thread of one API process (the dead-worker sweep, placement, webhook delivery): its
object lives in potocolom.runtime, which asgi.py starts; woken by events, stopped by a reset."""
from __future__ import annotations

import threading

from django.conf import settings
from django.db import connection


class ProcessThread:
    """One daemon thread running `loop()` until `stopped` is set; `wake()` sets `woken` for a loop
    that waits on it. Subclasses name the thread and may refuse to start (`enabled`) or act as it
    starts and stops (`started`, `stopping`)."""

    name = "process-thread"

    def __init__(self) -> None:
        self.woken = threading.Event()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def enabled(self) -> bool:
        """Whether this process runs the thread at all."""
        return True

    def start(self) -> bool:
        """Start the thread; False when it already runs or is not enabled."""
        with self.lock:
            if not self.enabled() or (self.thread is not None and self.thread.is_alive()):
                return False
            self.stopped.clear()
            self.started()
            self.thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self.thread.start()
            return True

    def started(self) -> None:
        """Called as the thread starts (connect the signals that wake it)."""

    def stopping(self) -> None:
        """Called as the thread is stopped (disconnect them)."""

    def wake(self) -> None:
        """Run the loop's next pass soon."""
        self.woken.set()

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop after the pass under way, if any (tests; a served process just exits)."""
        self.stopping()
        self.stopped.set()
        self.woken.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def _main(self) -> None:
        try:
            self.loop()
        finally:
            connection.close()  # this thread's own database connection

    def loop(self) -> None:
        raise NotImplementedError


def start_when_served(thread: ProcessThread) -> None:
    """A runtime slot's start: run the thread in a served process (DEAD_WORKER_SWEEP=0 keeps the
    process's threads off: tests run their loops with their own clocks)."""
    if settings.DEAD_WORKER_SWEEP:
        thread.start()


def stop_thread(thread: ProcessThread) -> None:
    """A runtime slot's stop."""
    thread.stop()
