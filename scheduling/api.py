"""REST for jobs: /api/v1/jobs/ (DRF). Views translate; services and selectors do the work."""
from __future__ import annotations

import mimetypes
import uuid
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.db.models import Prefetch
from django.http import FileResponse, Http404, HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from models_registry.errors import InvalidParams
from potocolom.protocol.errors import InvalidRequest
from scheduling import events, selectors, services
from scheduling.images import INIT_IMAGE, init_image_content, init_image_problem
from scheduling.models import Job, JobState, WebhookDelivery
from scheduling.serializers import JobCreateSerializer, JobSerializer
from scheduling.throttles import JobControlThrottle, JobSubmitThrottle
from scheduling.webhooks.resolving import webhook_url_problem
from scheduling.webhooks.services import webhook_secret_of, webhook_secret_rotate

MAX_INDEX_DIGITS = 9  # an image index longer than this is no image of any job
THROTTLES: dict[str, type[JobSubmitThrottle]] = {
    "create": JobSubmitThrottle, "pause": JobControlThrottle, "resume": JobControlThrottle}


def account_of(request: Request) -> User:
    """The authenticated account (every view here requires one)."""
    assert isinstance(request.user, User)
    return request.user


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """An account's image-generation jobs; another account's job answers 404."""

    serializer_class = JobSerializer

    def get_throttles(self) -> list[Any]:
        """Submissions, and pauses and resumes, are rate-limited (JOB_SUBMIT_RATE, a counter each):
        reading and cancelling stay free."""
        throttle = THROTTLES.get(self.action or "")
        return [throttle()] if throttle is not None else []

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular building the schema: no request
            return Job.objects.none()
        state = self.request.query_params.get("state") if self.action == "list" else None
        if state is not None and state not in JobState.values:
            raise InvalidRequest({"state": [f"must be one of {', '.join(JobState.values)}"]})
        jobs = selectors.jobs_of(account=account_of(self.request), state=state)
        if self.action == "list":
            jobs = jobs.prefetch_related(Prefetch("webhook_deliveries", to_attr="listed_deliveries",
                                                  queryset=WebhookDelivery.objects.order_by("-created_at", "id")))
        return jobs

    def get_object(self) -> Job:
        try:  # a malformed id is a missing job, not a 500
            uuid.UUID(str(self.kwargs.get("pk")))
        except ValueError:
            raise Http404 from None
        return super().get_object()

    def get_serializer_context(self) -> dict[str, Any]:
        context = {**super().get_serializer_context(), "positions": getattr(self, "_positions", {})}
        if hasattr(self, "_etas"):
            context["etas"] = self._etas
        return context

    def paginate_queryset(self, queryset: Any) -> Any:
        page = super().paginate_queryset(queryset)
        self._positions = selectors.positions_of(page if page is not None else queryset)
        return page

    def retrieve(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        job = self.get_object()
        self._positions = selectors.positions_of([job])
        return Response(self.get_serializer(job).data)

    @extend_schema(parameters=[OpenApiParameter("state", str, enum=JobState.values)])
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request: Request) -> Response:
        """Submit a job. Without model_id the cheapest model that fits tier, capabilities and params runs it."""
        body = JobCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        problem = init_image_problem(body.validated_data["params"], max_pixels=settings.MAX_IMAGE_PIXELS)
        if problem:
            raise InvalidParams({"params": {INIT_IMAGE: [problem]}})
        job_request = body.to_request()
        webhook_url = body.validated_data.get("webhook_url")
        if webhook_url is not None:
            problem = webhook_url_problem(webhook_url, account_id=account_of(request).id)
            if problem:
                raise InvalidRequest({"webhook_url": [problem]})
            job_request = replace(job_request, webhook_url=webhook_url,
                                  webhook_origin=f"{request.scheme}://{request.get_host()}")
        job = services.job_submit(account=account_of(request), request=job_request, now=timezone.now())
        # `job` is as submitted, or as dispatched when a worker of this process took it at once
        return Response(self._as_announced(job), status=status.HTTP_201_CREATED)

    def _as_announced(self, job: Job) -> dict[str, Any]:
        """A job just queued (submitted or resumed) as its event announced it: the same position and
        estimated wait, placed once for both."""
        said = events.announced(str(job.id))
        if job.state == JobState.QUEUED and said is not None and said[0] is not None:  # queued as it was said
            self._positions = {str(job.id): said[0]}
            self._etas = {str(job.id): said[1]} if said[1] is not None else {}
        else:  # one another process took meanwhile is no longer queued here: read what it became
            self._positions = selectors.positions_of([job])
            if job.state == JobState.QUEUED and str(job.id) not in self._positions:
                job.refresh_from_db()
        return self.get_serializer(job).data

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a job that has not ended (409 when it has)."""
        job = services.job_cancel(job=self.get_object(), now=timezone.now())
        return Response(self.get_serializer(job).data)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str | None = None) -> Response:
        """Pause a job: a queued one at once; a dispatched or running one once its worker stops it at
        a step boundary (it answers with its state until then). 409 when it has ended."""
        return self._answer(services.job_pause(job=self.get_object(), now=timezone.now()))

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str | None = None) -> Response:
        """Queue a paused job again at its old place (409 when it is not paused, or has ended)."""
        return Response(self._as_announced(services.job_resume(job=self.get_object(), now=timezone.now())))

    def _answer(self, job: Job) -> Response:
        """The job as it is now, with its position when it is queued."""
        self._positions = selectors.positions_of([job])
        return Response(self.get_serializer(job).data)

    @extend_schema(request=None, responses={(200, "image/png"): OpenApiTypes.BINARY,
                                            (200, "image/jpeg"): OpenApiTypes.BINARY,
                                            (200, "image/webp"): OpenApiTypes.BINARY})
    @action(detail=True, methods=["get"], url_path="init_image", url_name="init-image")
    def init_image(self, request: Request, pk: str | None = None) -> HttpResponse:
        """The init_image the job was submitted with, as sent (for its own account only)."""
        content = init_image_content(self.get_object().init_image)
        if content is None:
            raise Http404
        data, media_type = content
        return HttpResponse(data, content_type=media_type)

    @extend_schema(responses={(200, "image/png"): bytes})
    @action(detail=True, methods=["get"], url_path=r"images/(?P<index>\d+)", url_name="image")
    def image(self, request: Request, pk: str | None = None, index: str = "0") -> FileResponse:
        """One of a succeeded job's images (PNG), for its own account only."""
        job = self.get_object()
        # an index of thousands of digits is no image either (int() refuses past 4,300 digits: a 500)
        if len(index) > MAX_INDEX_DIGITS or int(index) >= len(job.images):
            raise Http404
        name = job.images[int(index)]
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return FileResponse(default_storage.open(name, "rb"), content_type=content_type)


class WebhookSecretView(APIView):
    """The account's webhook signing secret (Standard Webhooks, `whsec_` + base64 of the key)."""

    @extend_schema(request=None, responses={200: OpenApiTypes.OBJECT})
    def get(self, request: Request) -> Response:
        """The secret deliveries are signed with (made on first use)."""
        return Response({"secret": webhook_secret_of(account=account_of(request), now=timezone.now())})

    @extend_schema(request=None, responses={200: OpenApiTypes.OBJECT})
    def post(self, request: Request) -> Response:
        """Rotate it: a new secret signs every attempt from now on; the old one verifies none of them."""
        return Response({"secret": webhook_secret_rotate(account=account_of(request), now=timezone.now())})
