"""URLs: the REST API under /api/v1/ (its docs page for people at /api/v1/docs/), /metrics, the admin,
Django auth, and the drawing page."""
from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from fleet.api import QueuesView
from fleet.metrics import MetricsView
from models_registry.api import ModelListView
from realtime.api import UsageView
from realtime.views import drawing_page
from scheduling.api import JobViewSet, WebhookSecretView
from scheduling.views import jobs_page

router = SimpleRouter(trailing_slash=True)
router.register("jobs", JobViewSet, basename="job")


@extend_schema(responses={200: OpenApiTypes.OBJECT})
@api_view(["GET"])
@permission_classes([AllowAny])
def api_root(request: Request) -> Response:
    """The API's entry points."""
    return Response({"jobs": "/api/v1/jobs/", "models": "/api/v1/models/", "usage": "/api/v1/usage/",
                     "queues": "/api/v1/queues/", "schema": "/api/v1/schema/",
                     "docs": "/api/v1/docs/"})


urlpatterns = [
    path("", drawing_page, name="drawing"),
    path("jobs/", jobs_page, name="jobs"),
    path("api/v1/", api_root, name="api-root"),
    path("api/v1/", include(router.urls)),
    path("api/v1/models/", ModelListView.as_view(), name="models"),
    path("api/v1/queues/", QueuesView.as_view(), name="queues"),
    path("api/v1/usage/", UsageView.as_view(), name="usage"),
    path("api/v1/account/webhook-secret/", WebhookSecretView.as_view(), name="webhook-secret"),
    path("api/v1/schema/", SpectacularAPIView.as_view(permission_classes=[AllowAny]), name="schema"),
    path("api/v1/docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[AllowAny]),
         name="api-docs"),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
]
