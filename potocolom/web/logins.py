"""Password guessing: LOGIN_FAILURE_LIMIT failed logins for one username (as Django normalises it)
from one address, or LOGIN_ADDRESS_FAILURE_LIMIT from one address whatever the usernames, refuse
(429) for LOGIN_FAILURE_SECONDS. docs/design/http.md, "Password guessing"."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UsernameField
from django.core.cache import BaseCache, cache
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from potocolom.web.middleware import unavailable, unavailable_response


def login_username(raw: str) -> str:
    """The username as Django's login forms hand it to authentication (AuthenticationForm's
    UsernameField: stripped, then NFKC), so `demo`, `demo ` and `ｄｅｍｏ` are one username."""
    model = get_user_model()
    longest = getattr(model._meta.get_field(model.USERNAME_FIELD), "max_length", None) or 254
    # one too long is not normalised (Django's form refuses it): its first `longest` characters count
    return str(UsernameField(max_length=longest).to_python(raw))[:longest]


@dataclass
class LoginLimiter:
    """Failures of each (username, address) pair (`limit`) and of each address (`address_limit`)
    within `seconds`; the limit-th locks that pair or address out for `seconds`. `now` is injected."""

    store: BaseCache
    limit: int
    seconds: int
    address_limit: int = 50

    def _subjects(self, username: str, address: str) -> list[tuple[str, int]]:
        """The counts a failure of `username` from `address` adds to: (key, limit) each."""
        pair = hashlib.sha256(f"{username}\x00{address}".encode("utf-8", "surrogatepass")).hexdigest()
        alone = hashlib.sha256(address.encode("utf-8", "surrogatepass")).hexdigest()
        return [(f"login-pair:{pair}", self.limit), (f"login-address:{alone}", self.address_limit)]

    def refused_until(self, username: str, address: str, *, now: float) -> float | None:
        """When the later lockout of the pair and the address ends, or None when it may try."""
        locks = self.store.get_many([f"{key}:locked" for key, _ in self._subjects(username, address)])
        until = [value for value in locks.values() if isinstance(value, (int, float)) and value > now]
        return max(until) if until else None

    def failed(self, username: str, address: str, *, now: float) -> None:
        """One more failure of the pair and of the address; a limit-th within the window locks out."""
        for key, limit in self._subjects(username, address):
            recent = [t for t in self.store.get(key, []) if now - t < self.seconds][-limit:]
            recent.append(now)
            if len(recent) >= limit:
                self.store.set(f"{key}:locked", now + self.seconds, timeout=self.seconds)
                self.store.delete(key)
            else:
                self.store.set(key, recent, timeout=self.seconds)

    def succeeded(self, username: str, address: str) -> None:
        """A good login starts the pair's count afresh; never the address's (one account of one's
        own would otherwise reset it between guesses at others)."""
        self.store.delete(self._subjects(username, address)[0][0])


def limiter() -> LoginLimiter:
    return LoginLimiter(cache, settings.LOGIN_FAILURE_LIMIT, settings.LOGIN_FAILURE_SECONDS,
                        address_limit=settings.LOGIN_ADDRESS_FAILURE_LIMIT)


class LoginFailureMiddleware:
    """Counts the outcome of every POST to a password login view (a re-shown form is a failure, a
    redirect a success) and refuses a locked-out pair or address before the view checks any password."""

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
        username = login_username(str(request.POST.get("username", "")))
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
