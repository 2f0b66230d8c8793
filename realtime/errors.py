"""Why a browser socket is refused (potocolom.web maps each code to its close code)."""
from __future__ import annotations

from potocolom.protocol.errors import DomainError


class SessionError(DomainError):
    """The session cannot be opened."""

    code = "bad_query"


class BadQuery(SessionError):
    """A query parameter is not valid."""

    code = "bad_query"


class NotAuthenticated(SessionError):
    """Log in, or pass an API token as ?token=."""

    code = "not_authenticated"


class SessionLimitReached(SessionError):
    """The account already holds as many sessions as it may."""

    code = "session_limit"


class NoModelFits(SessionError):
    """No registered model fits the request."""

    code = "no_model_fits"
