"""The routes: the REST API under /api/v1/ (its docs page for people at /api/v1/docs/), /metrics, the
admin, Django auth and the pages; and the three sockets (websocket_application)."""
from __future__ import annotations

from typing import Any, cast

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from django.contrib import admin
from django.urls import URLPattern, include, path, re_path
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from fleet.api import QueuesView
from fleet.consumers import WorkerConsumer
from fleet.metrics import MetricsView
from models_registry.api import ModelListView
from potocolom.web.sockets import ASGIApp, BrowserOriginCheck, refuse
from realtime.api import UsageView
from realtime.consumers import SessionConsumer
from realtime.views import drawing_page
from scheduling.api import JobViewSet, WebhookSecretView
from scheduling.consumers import JobEventsConsumer
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


def socket_route(route: str, app: ASGIApp, *, pattern: bool = False) -> URLPattern:
    """A socket route: channels routes ASGI applications with Django's path(), which django-stubs
    types for views only."""
    return (re_path if pattern else path)(route, cast(Any, app))


def websocket_application() -> ASGIApp:
    """The sockets. Browser-facing ones (the session cookie may authenticate them) check the page's
    Origin; the worker socket (tokens only) does not; any other path is refused (403), not a 500."""
    return cast(ASGIApp, AuthMiddlewareStack(URLRouter([
        socket_route("ws/session/", BrowserOriginCheck(SessionConsumer.as_asgi())),
        socket_route("ws/jobs/", BrowserOriginCheck(JobEventsConsumer.as_asgi())),
        socket_route("ws/worker/", WorkerConsumer.as_asgi()),
        socket_route(r"", refuse, pattern=True),
    ])))
