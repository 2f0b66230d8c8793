"""Why a browser socket is refused, and the close code each answers with (in one place)."""
from __future__ import annotations


class SessionError(Exception):
    """The session cannot be opened."""

    close_code = 4000

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        super().__init__(self.detail)


class BadQuery(SessionError):
    """A query parameter is not valid."""

    close_code = 4000


class NotAuthenticated(SessionError):
    """Log in, or pass an API token as ?token=."""

    close_code = 4001


class SessionLimitReached(SessionError):
    """The account already holds as many sessions as it may."""

    close_code = 4003


class NoModelFits(SessionError):
    """No registered model fits the request."""

    close_code = 4004


CLOSE_MESSAGE_TOO_BIG = 4009  # a browser message over BROWSER_MESSAGE_MAX_BYTES
