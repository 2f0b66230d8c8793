"""The jobs page: submit a job and watch the account's jobs live (REST for the list and the
actions, /ws/jobs/ for the events). Plain JS, no build step; the story is in docs/protocol.md, "REST" and
"Job events"."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from models_registry.models import ModelManifest
from potocolom.protocol.manifests import TIERS

JOBS_SOCKET_PATH = "/ws/jobs/"
TEXT_TO_IMAGE = "txt2img"


@login_required
def jobs_page(request: HttpRequest) -> HttpResponse:
    """The page; the browser lists the jobs over REST and follows them over the jobs socket."""
    models = [m for m in ModelManifest.objects.all() if TEXT_TO_IMAGE in (m.capabilities or [])]
    return render(request, "jobs.html", {"models": models, "tiers": TIERS, "socket_path": JOBS_SOCKET_PATH})
