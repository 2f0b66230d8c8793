"""Every domain error's answer in one place: its HTTP status (REST, the contract's error body) and
its close code (sockets). docs/design/http.md, "Errors in one place"."""
from __future__ import annotations

import math

from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler, set_rollback

from potocolom.protocol import close_codes
from potocolom.protocol.errors import DomainError, InvalidRequest
from potocolom.web.middleware import RETRY_AFTER_SECONDS, UNAVAILABLE_BODY, drop_unusable, unavailable

HTTP_STATUS = {
    "invalid_request": status.HTTP_400_BAD_REQUEST,
    "unknown_model": status.HTTP_400_BAD_REQUEST,
    "invalid_params": status.HTTP_400_BAD_REQUEST,
    "no_matching_model": status.HTTP_400_BAD_REQUEST,
    "job_already_ended": status.HTTP_409_CONFLICT,
    "job_not_paused": status.HTTP_409_CONFLICT,
    "too_many_jobs": status.HTTP_429_TOO_MANY_REQUESTS,
    "throttled": status.HTTP_429_TOO_MANY_REQUESTS,
    "request_too_large": status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
    "unavailable": status.HTTP_503_SERVICE_UNAVAILABLE,
}
CLOSE_CODE = {
    "bad_query": close_codes.BAD_QUERY,
    "not_authenticated": close_codes.NOT_AUTHENTICATED,
    "session_limit": close_codes.SESSION_LIMIT,
    "socket_limit": close_codes.SOCKET_LIMIT,
    "no_model_fits": close_codes.NO_MODEL_FITS,
    "worker_id_taken": close_codes.WORKER_ID_TAKEN,
}


def status_of(error: DomainError) -> int:
    return HTTP_STATUS.get(error.code, status.HTTP_400_BAD_REQUEST)


def close_code_of(error: DomainError) -> int:
    return CLOSE_CODE.get(error.code, close_codes.BAD_QUERY)


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's handler, with domain errors and validation errors in the contract's body."""
    if isinstance(exc, DomainError):
        retry = {"Retry-After": str(exc.retry_after_seconds)} if exc.retry_after_seconds else None
        return Response({"error": exc.code, "detail": exc.detail}, status=status_of(exc), headers=retry)
    if isinstance(exc, exceptions.ValidationError):
        detail = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        return Response({"error": InvalidRequest.code, "detail": detail}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, exceptions.Throttled):
        seconds = getattr(exc, "wait", None)
        wait = max(1, math.ceil(seconds)) if seconds is not None else 1
        return Response({"error": "throttled", "detail": f"too many requests; retry in {wait} s"},
                        status=status.HTTP_429_TOO_MANY_REQUESTS, headers={"Retry-After": str(wait)})
    if unavailable(exc):
        set_rollback()
        drop_unusable(context["request"], exc)
        return Response(UNAVAILABLE_BODY, status=status.HTTP_503_SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, exceptions.ParseError):
        return Response({"error": InvalidRequest.code, "detail": {"non_field_errors": [str(exc.detail)]}},
                        status=status.HTTP_400_BAD_REQUEST)
    return exception_handler(exc, context)
