"""The database (or Redis) down or too slow: every request answers 503 until it is back, and the
process recovers by itself. docs/design/http.md, "The database away"."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis.exceptions
from django.db import InterfaceError, OperationalError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse

from potocolom.runtime import Slot, runtime

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 2
UNAVAILABLE_BODY = {"error": "unavailable", "detail": "the database is unavailable; retry shortly"}


def unavailable(exc: BaseException) -> bool:
    """A lost, refused, timed-out or locked database connection (a bad query is a DatabaseError of
    another kind), or a Redis that cannot be reached or answers too slowly."""
    return isinstance(exc, (OperationalError, InterfaceError, redis.exceptions.ConnectionError,
                            redis.exceptions.TimeoutError))


class DatabaseFailures:
    """How many database failures this process's requests met (a count only moves on): every other
    thread checks its kept connection before its next request (potocolom.web.http), since one that
    outlived a database restart fails the request that uses it next."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen = 0

    def one_more(self) -> None:
        with self.lock:
            self.seen += 1


DATABASE_FAILURES = Slot("potocolom.web.database_failures", make=DatabaseFailures)


def drop_unusable(request: HttpRequest, exc: BaseException) -> None:
    """Log the 503 and drop the broken database connections (the next request opens new ones);
    the other threads' are checked before their next request."""
    log.warning("database unavailable: %s %s answered 503 (%s)", request.method, request.path,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if isinstance(exc, (OperationalError, InterfaceError)):
        runtime.get(DATABASE_FAILURES).one_more()
    for connection in connections.all():
        connection.close_if_unusable_or_obsolete()


def unavailable_response(request: HttpRequest, exc: BaseException) -> JsonResponse:
    """503 `unavailable` with Retry-After."""
    drop_unusable(request, exc)
    response = JsonResponse(UNAVAILABLE_BODY, status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


class DatabaseUnavailableMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        return unavailable_response(request, exc) if unavailable(exc) else None
