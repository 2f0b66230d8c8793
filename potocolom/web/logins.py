"""Password guessing: after LOGIN_FAILURE_LIMIT failed logins for one (username, client address),
that pair is refused (429) for LOGIN_FAILURE_SECONDS. docs/design/http.md, "Password guessing"."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import BaseCache, cache
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from potocolom.web.middleware import unavailable, unavailable_response


@dataclass
class LoginLimiter:
    """The failures of each (username, address) pair; `now` is injected (seconds since the epoch)."""

    store: BaseCache
    limit: int
    seconds: int

    def _key(self, kind: str, username: str, address: str) -> str:
        digest = hashlib.sha256(f"{username}\x00{address}".encode("utf-8", "surrogatepass")).hexdigest()
        return f"login-{kind}:{digest}"

    def refused_until(self, username: str, address: str, *, now: float) -> float | None:
        """When the pair's lockout ends, or None when it may try."""
        until = self.store.get(self._key("locked", username, address))
        return until if isinstance(until, (int, float)) and until > now else None

    def failed(self, username: str, address: str, *, now: float) -> None:
        """One more failure; the limit-th within the window locks the pair out."""
        key = self._key("failures", username, address)
        recent = [t for t in self.store.get(key, []) if now - t < self.seconds][-self.limit:]
        recent.append(now)
        if len(recent) >= self.limit:
            self.store.set(self._key("locked", username, address), now + self.seconds, timeout=self.seconds)
            self.store.delete(key)
        else:
            self.store.set(key, recent, timeout=self.seconds)

    def succeeded(self, username: str, address: str) -> None:
        """A good login starts the count afresh."""
        self.store.delete(self._key("failures", username, address))


def limiter() -> LoginLimiter:
    return LoginLimiter(cache, settings.LOGIN_FAILURE_LIMIT, settings.LOGIN_FAILURE_SECONDS)


class LoginFailureMiddleware:
    """Counts the outcome of every POST to a password login view (a re-shown form is a failure, a
    redirect a success) and refuses a locked-out pair before the view checks any password."""

    clock: Callable[[], float] = staticmethod(time.time)

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method != "POST" or request.path not in (settings.LOGIN_URL, reverse("admin:login")):
            return self.get_response(request)
        try:
            return self.guarded(request)
        except Exception as exc:  # the cache (Redis) is down: 503 like the database, not 500
            if unavailable(exc):
                return unavailable_response(request, exc)
            raise

    def guarded(self, request: HttpRequest) -> HttpResponse:
        username = str(request.POST.get("username", ""))[:150]
        address = str(request.META.get("REMOTE_ADDR", ""))
        logins, now = limiter(), self.clock()
        until = logins.refused_until(username, address, now=now)
        if until is not None:
            wait = max(1, int(until - now))
            response = HttpResponse(f"Too many failed logins; try again in {wait} s.\n", status=429,
                                    content_type="text/plain; charset=utf-8")
            response["Retry-After"] = str(wait)
            return response
        response = self.get_response(request)
        if response.status_code == 200:  # the form came back: wrong username or password
            logins.failed(username, address, now=now)
        elif response.status_code in (301, 302, 303):
            logins.succeeded(username, address)
        return response
