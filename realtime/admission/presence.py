"""This API process's presence in PostgreSQL (a session-level advisory lock on a connection of its
own, lost with the process) and the lease on the shared sweep (one more lock, one holder). Under
the shared admission only; the story: docs/design/shared-admission.md."""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from typing import Any

from django.db import connection

log = logging.getLogger(__name__)
PRESENCE_LOCKS = 0x706F_0001  # pg_advisory_lock(PRESENCE_LOCKS, process key): one per API process
SWEEP_LOCK = (0x706F_0002, 1)  # pg_advisory_lock(*SWEEP_LOCK): the sweep's single holder
ADMISSION_LOCK = (0x706F_0003, 1)  # pg_advisory_xact_lock(*ADMISSION_LOCK): one admission at a time


class Presence:
    """The dedicated connection and the locks it holds (thread-safe; blocking calls)."""

    def __init__(self) -> None:
        self.key = secrets.randbelow(2**31 - 1) + 1  # positive: pg_locks shows objid as an unsigned oid
        self.lock = threading.Lock()
        self.conn: Any = None
        self.leading = False

    def _connected(self) -> Any:
        """The connection, opened (and the presence lock taken) when there is none or it broke."""
        if self.conn is not None and not self.conn.closed and not self.conn.broken:
            return self.conn
        import psycopg

        self._drop()
        params = connection.settings_dict
        self.conn = psycopg.connect(
            dbname=params["NAME"], user=params.get("USER") or None, password=params.get("PASSWORD") or None,
            host=params.get("HOST") or None, port=params.get("PORT") or None, autocommit=True,
            application_name=f"potocolom-api:{os.getpid()}:{self.key}")
        self.conn.execute("SELECT pg_advisory_lock(%s, %s)", [PRESENCE_LOCKS, self.key])
        return self.conn

    def ensure(self) -> int:
        """Hold this process's presence lock; its key (what session rows of this process carry)."""
        with self.lock:
            self._connected()
            return self.key

    def try_lead(self) -> bool:
        """Whether this process holds the sweep lock now (taking it when it is free). A held lock is
        kept as long as the connection lives; a broken connection lost it."""
        with self.lock:
            try:
                if self.leading and self.conn is not None and not self.conn.closed:
                    self.conn.execute("SELECT 1")  # raises when the connection (and the lock) is gone
                    return True
                conn = self._connected()
                row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)", list(SWEEP_LOCK)).fetchone()
                self.leading = bool(row and row[0])
                if self.leading:
                    log.info("process %s (pid %d) now runs the session sweep", self.key, os.getpid())
                return self.leading
            except Exception as exc:
                log.warning("lost the presence connection (%s); taking the presence lock again", exc)
                self._drop()
                with contextlib.suppress(Exception):  # the database restarted: be present again at once
                    self._connected()
                return False

    def close(self) -> None:
        """Let go of both locks (the last socket of this process closed, or a test ended)."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # a connection already gone is closed all the same
                pass
        self.conn, self.leading = None, False


def alive_processes() -> set[int]:
    """The keys of the API processes holding their presence lock on this database now."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted "
                       "AND classid::bigint = %s AND objsubid = 2 "
                       "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                       [PRESENCE_LOCKS])
        return {int(row[0]) for row in cursor.fetchall()}


def admission_lock() -> None:
    """Inside a transaction: wait for the admission lock (released at commit or rollback)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(ADMISSION_LOCK))
