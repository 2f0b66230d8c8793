"""The database (or Redis) down or too slow: every request answers 503 until it is back, and the
process recovers by itself. docs/design/http.md, "The database away"."""
from __future__ import annotations

import logging
from collections.abc import Callable

import redis.exceptions
from django.db import InterfaceError, OperationalError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 2
UNAVAILABLE_BODY = {"error": "unavailable", "detail": "the database is unavailable; retry shortly"}


def unavailable(exc: BaseException) -> bool:
    """A lost, refused, timed-out or locked database connection (a bad query is a DatabaseError of
    another kind), or a Redis that cannot be reached or answers too slowly."""
    return isinstance(exc, (OperationalError, InterfaceError, redis.exceptions.ConnectionError,
                            redis.exceptions.TimeoutError))


def drop_unusable(request: HttpRequest, exc: BaseException) -> None:
    """Log the 503 and drop the broken database connections (the next request opens new ones)."""
    log.warning("database unavailable: %s %s answered 503 (%s)", request.method, request.path,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
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
