"""ASGI guards for the socket routes: a browser-facing socket's Origin is checked before its cookie
counts, a token is taken from the handshake, a path no route serves is refused (403).
docs/design/http.md, "Whose socket"."""
from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from django.conf import settings
from django.contrib.auth.models import AnonymousUser, User
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.utils.http import is_same_domain
from rest_framework.authtoken.models import Token

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


class Handshake(HttpRequest):
    """A socket's handshake read as Django reads a request (its headers as META, its server), with
    the deployment's scheme: for Django's own host check, `get_host`."""

    def __init__(self, scope: Scope, *, secure: bool) -> None:
        super().__init__()
        for name, value in scope.get("headers", []):
            key = "HTTP_" + bytes(name).decode("latin-1").upper().replace("-", "_")
            text = bytes(value).decode("latin-1")
            self.META[key] = f"{self.META[key]},{text}" if key in self.META else text  # as ASGIRequest
        server, port = scope.get("server") or (None, None)
        self.META["SERVER_NAME"] = str(server or "")
        self.META["SERVER_PORT"] = str(port or (443 if secure else 80))
        self.secure = secure

    @property
    def scheme(self) -> str:
        return "https" if self.secure else "http"


def origin_allowed(scope: Scope, *, secure: bool) -> bool:
    """Whether the handshake's Origin is a page of ours, as Django's CSRF check decides for a POST
    (CsrfViewMiddleware._origin_verified): this socket's own origin (scheme, host and port of its
    Host header, which ALLOWED_HOSTS must allow), or one CSRF_TRUSTED_ORIGINS names (exactly, or a
    subdomain of a `*.` one, over the same scheme)."""
    origin = header(scope, b"origin")
    if not origin:
        return False
    handshake = Handshake(scope, secure=secure)
    with contextlib.suppress(DisallowedHost):
        if origin == f"{handshake.scheme}://{handshake.get_host()}":
            return True
    trusted = CsrfViewMiddleware(_no_view)  # its parsing of CSRF_TRUSTED_ORIGINS, read now
    if origin in trusted.allowed_origins_exact:
        return True
    try:
        parsed = urlsplit(origin)
    except ValueError:
        return False
    return any(is_same_domain(parsed.netloc, host) for host in trusted.allowed_origin_subdomains.get(parsed.scheme, ()))


def _no_view(request: HttpRequest) -> HttpResponse:
    raise NotImplementedError  # CsrfViewMiddleware is used for its settings, never as a middleware


def secure_socket(scope: Scope) -> bool:
    """Whether the deployment's pages are https (HTTPS=true) or this socket came over TLS."""
    return bool(settings.HTTPS) or scope.get("scheme") == "wss"


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
        if scope.get("type") == "websocket" and not origin_allowed(scope, secure=secure_socket(scope)):
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
