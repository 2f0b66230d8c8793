"""The database is down: every request answers 503 until it is back, and the process recovers by
itself (Django drops a broken connection at the end of the request and opens a new one on the next)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connections
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 2


def unavailable(exc: BaseException) -> bool:
    """A lost, refused or locked database connection (a bad query is a DatabaseError of another kind)."""
    return isinstance(exc, (OperationalError, InterfaceError))


class DatabaseUnavailableMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not unavailable(exc):
            return None
        log.warning("database unavailable: %s %s answered 503 (%s)", request.method, request.path,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        for connection in connections.all():
            connection.close_if_unusable_or_obsolete()
        response = JsonResponse({"error": "unavailable", "detail": "the database is unavailable; retry shortly"},
                                status=503)
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response
