"""REST for realtime metering: /api/v1/usage/."""
from __future__ import annotations

from django.contrib.auth.models import User
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from realtime import selectors


class UsageView(APIView):
    """The account's metered realtime seconds per model; a slot held now counts up to now."""

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        return Response(selectors.usage_of(account=request.user, now=timezone.now()))
