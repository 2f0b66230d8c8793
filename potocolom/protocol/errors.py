"""The base of every domain error: a code from the contract and a message (its docstring by default).
Apps define their errors on it; potocolom.web maps codes to HTTP statuses and close codes."""
from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """The request cannot be done."""

    code = "invalid_request"
    retry_after_seconds: int | None = None  # answered as Retry-After when set

    def __init__(self, detail: Any = None) -> None:
        self.detail = detail if detail is not None else (self.__doc__ or "").strip()
        super().__init__(str(self.detail))


class MessageError(ValueError):
    """A socket message does not follow the contract."""


class InvalidRequest(DomainError):
    """The request body is not valid."""

    code = "invalid_request"
