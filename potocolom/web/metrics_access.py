"""Who may read GET /metrics: a staff account (its API token or its session), or a scraper that
presents `Authorization: Bearer <METRICS_TOKEN>` (only when the setting is set). The story:
docs/operations.md, "Metrics"."""
from __future__ import annotations

import hmac
import json
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission, IsAdminUser
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

METRICS_SCRAPER = "metrics-token"  # request.auth of a request that presented METRICS_TOKEN


class MetricsTokenAuthentication(BaseAuthentication):
    """`Authorization: Bearer <METRICS_TOKEN>`, compared in constant time; a wrong one answers 401.
    With METRICS_TOKEN empty (the default) a bearer is no one's and the request stays anonymous."""

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"bearer" or not settings.METRICS_TOKEN:
            return None
        expected = settings.METRICS_TOKEN.encode()
        if len(parts) != 2 or not hmac.compare_digest(parts[1], expected):
            raise AuthenticationFailed("Invalid metrics token.")
        return AnonymousUser(), METRICS_SCRAPER

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="metrics"'


class StaffOrMetricsScraper(BasePermission):
    """A staff account, or the METRICS_TOKEN bearer (an account that is not staff: 403)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return request.auth == METRICS_SCRAPER or IsAdminUser().has_permission(request, view)


class PlainTextRenderer(BaseRenderer):
    """Lets a scraper that accepts only text/plain be answered; an error body is the usual JSON."""

    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        return data if isinstance(data, bytes) else json.dumps(data).encode()
