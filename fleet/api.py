"""GET /api/v1/queues/ (staff only): queued jobs per model, queued sessions, and the workers."""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.lifecycle import queues_snapshot


class QueuesView(APIView):
    """Staff only: queued jobs per model, queued sessions, and connected workers."""

    permission_classes = [IsAdminUser]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        return Response(queues_snapshot())
