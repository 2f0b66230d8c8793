"""DRF's token authentication with each token's account kept a second: every API request of an
account otherwise costs a database read of its token and user before it does anything. A token
deleted or a user changed in this process counts at once; in another process within
TOKEN_FRESH_SECONDS. docs/design/http.md, "Tokens"."""
from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from django.conf import settings
from rest_framework.authentication import TokenAuthentication

from potocolom.runtime import Slot, runtime

TOKENS_KEPT = 10_000  # tokens a process keeps at once; the least recently used go first


class KnownTokens:
    """Token key -> (when read, its user and token), at most `kept`, each for `fresh_seconds`."""

    def __init__(self, *, fresh_seconds: float, kept: int = TOKENS_KEPT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_seconds, self.kept, self.clock = fresh_seconds, kept, clock
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[float, tuple[Any, Any]]] = OrderedDict()

    def get(self, key: str) -> tuple[Any, Any] | None:
        with self._lock:
            entry = self._known.get(key)
            if entry is None:
                return None
            if not 0 <= self.clock() - entry[0] < self.fresh_seconds:
                del self._known[key]
                return None
            self._known.move_to_end(key)
            return entry[1]

    def put(self, key: str, found: tuple[Any, Any]) -> None:
        with self._lock:
            self._known[key] = (self.clock(), found)
            self._known.move_to_end(key)
            while len(self._known) > self.kept:
                self._known.popitem(last=False)

    def forget_all(self) -> None:
        """A token or a user changed here."""
        with self._lock:
            self._known.clear()


KNOWN_TOKENS = Slot("potocolom.web.known_tokens", make=lambda: KnownTokens(fresh_seconds=settings.TOKEN_FRESH_SECONDS))


class KeptTokenAuthentication(TokenAuthentication):
    """TokenAuthentication (the same header, errors and checks: a wrong token or an inactive user is
    refused as DRF refuses it, and never kept), with a valid token's account kept TOKEN_FRESH_SECONDS.
    Each request gets its own copy of the user, so one request's changes never reach another."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        known = runtime.get(KNOWN_TOKENS)
        found = known.get(key) if known.fresh_seconds > 0 else None
        if found is None:
            found = super().authenticate_credentials(key)
            known.put(key, found)
        user, token = found
        return copy.copy(user), token


def tokens_changed(**_: object) -> None:
    """post_save/post_delete of a token or a user (potocolom's app config connects it)."""
    runtime.get(KNOWN_TOKENS).forget_all()
