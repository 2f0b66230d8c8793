"""Domain errors and their mapping to HTTP answers, in one place.

Each error's docstring is its message. REST errors answer 400 with the contract's body
`{"error": CODE, "detail": ...}`; nothing a client sends may produce a 500.
"""
from __future__ import annotations

from typing import Any

from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler


class DomainError(Exception):
    """Something the request asked for cannot be done."""

    code = "invalid_request"
    http_status: int = status.HTTP_400_BAD_REQUEST

    def __init__(self, detail: Any = None) -> None:
        self.detail = detail if detail is not None else (self.__doc__ or "").strip()
        super().__init__(str(self.detail))


class UnknownModel(DomainError):
    """No model with that model_id is registered."""

    code = "unknown_model"


class InvalidParams(DomainError):
    """The params do not match the model's params_schema."""

    code = "invalid_params"


class NoMatchingModel(DomainError):
    """No registered model fits the tier, capabilities and params asked for."""

    code = "no_matching_model"


class InvalidRequest(DomainError):
    """The request body is not valid."""

    code = "invalid_request"


class JobAlreadyEnded(DomainError):
    """The job has already ended."""

    code = "job_already_ended"
    http_status = status.HTTP_409_CONFLICT


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's handler, with domain errors and validation errors in the contract's body."""
    if isinstance(exc, DomainError):
        return Response({"error": exc.code, "detail": exc.detail}, status=exc.http_status)
    if isinstance(exc, exceptions.ValidationError):
        detail = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        return Response({"error": InvalidRequest.code, "detail": detail}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, exceptions.ParseError):
        return Response({"error": InvalidRequest.code, "detail": {"non_field_errors": [str(exc.detail)]}},
                        status=status.HTTP_400_BAD_REQUEST)
    return exception_handler(exc, context)
