"""ASGI guards for the socket routes: a browser-facing socket's Origin is checked before its cookie
counts, a token is taken from the handshake, a path no route serves is refused (403).
docs/design/http.md, "Whose socket"."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from django.conf import settings
from django.contrib.auth.models import AnonymousUser, User
from django.http.request import validate_host
from django.utils.http import is_same_domain
from rest_framework.authtoken.models import Token

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


def origin_allowed(origin: str | None, *, allowed_hosts: Iterable[str], trusted_origins: Iterable[str]) -> bool:
    """Whether a page at `origin` is one of ours (Django's host and CSRF origin rules)."""
    if not origin:
        return False
    try:
        parsed = urlsplit(origin)
        hostname = parsed.hostname
    except ValueError:
        return False
    if parsed.scheme not in ("http", "https") or not hostname:
        return False
    host = f"[{hostname}]" if ":" in hostname else hostname
    if validate_host(host, list(allowed_hosts)):
        return True
    for trusted in trusted_origins:
        wanted = urlsplit(trusted)
        if wanted.scheme != parsed.scheme:
            continue
        if wanted.netloc == parsed.netloc or (
                wanted.netloc.startswith("*.") and is_same_domain(parsed.netloc, wanted.netloc[1:])):
            return True
    return False


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def brings_token(scope: Scope) -> bool:
    """A token in the query (`?token=`) or an Authorization header."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return any(query.get("token", [])) or bool(header(scope, b"authorization"))


async def refuse(scope: Scope, receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[Any]]) -> None:
    """Refuse the handshake: closing before accepting answers HTTP 403."""
    message = await receive()
    if message.get("type") == "websocket.connect":
        await send({"type": "websocket.close", "code": 1000})


class BrowserOriginCheck:
    """Wraps a browser-facing consumer, inside channels' AuthMiddlewareStack (scope["user"] set)."""

    def __init__(self, application: ASGIApp) -> None:
        self.application = application

    async def __call__(self, scope: Scope, receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[Any]]) -> None:
        if scope.get("type") == "websocket" and not origin_allowed(
                header(scope, b"origin"), allowed_hosts=settings.ALLOWED_HOSTS,
                trusted_origins=settings.CSRF_TRUSTED_ORIGINS):
            if brings_token(scope):
                scope = {**scope, "user": AnonymousUser()}  # the token authenticates, not the cookie
            elif getattr(scope.get("user"), "is_authenticated", False):
                await refuse(scope, receive, send)
                return
        await self.application(scope, receive, send)


def presented_token(scope: Scope) -> str | None:
    """The API token a browser-facing socket brings: its `Authorization: Token T` header (which
    keeps the token out of URLs and logs), else `?token=T`; None for neither."""
    kind, _, token = (header(scope, b"authorization") or "").strip().partition(" ")
    if kind.lower() == "token" and token.strip():
        return token.strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (query.get("token") or [None])[-1] or None


def socket_account(*, user: Any, token: str | None) -> User | None:
    """The account behind a browser-facing socket (/ws/session/, /ws/jobs/): its Django session, or
    an API token (query or header); None for neither, or an inactive account. Reads the database."""
    if isinstance(user, User) and user.is_authenticated and user.is_active:
        return user
    if not token or len(token) > 200:
        return None
    found = Token.objects.select_related("user").filter(key=token).first()
    return found.user if found is not None and found.user.is_active else None
