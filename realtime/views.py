"""The drawing page: the canvas, the model picker and the live output, over the session socket."""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from models_registry.models import ModelManifest
from realtime.model_choice import REALTIME_CAPABILITY

SESSION_SOCKET_PATH = "/ws/session/"


def session_models() -> list[ModelManifest]:
    """The models a drawing session can use, cheapest first (the manifests' own order).

    Filtered in Python: SQLite has no JSON `contains` lookup, and the list is short."""
    return [m for m in ModelManifest.objects.all() if REALTIME_CAPABILITY in (m.capabilities or [])]


@login_required
def drawing_page(request: HttpRequest) -> HttpResponse:
    """The page; the browser opens the session socket itself once a model is picked."""
    models = session_models()
    return render(request, "drawing.html", {"models": models, "default_model": models[0] if models else None,
                                            "socket_path": SESSION_SOCKET_PATH,
                                            "session_limit": settings.ACCOUNT_SESSION_LIMIT})
