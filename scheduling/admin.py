"""Operators' view of jobs: readable rows (short id, thumbnails, model, state, owner, created, how long
it waited and ran), filters by state and model, queued ones in dispatch order with positions, actions
to cancel, pause, resume and requeue, and a read-only job page with its images (docs/operations.md)."""
from __future__ import annotations

import json
import mimetypes
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.core.files.storage import default_storage
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from potocolom.web.read_only import ReadOnlyAdmin
from scheduling import selectors, services
from scheduling.errors import JobAlreadyEnded, JobNotPaused
from scheduling.images import INIT_IMAGE, init_image_content
from scheduling.models import Job, JobState
from scheduling.thumbnails import NotAnImage, thumbnail

QUEUE_ORDER_ROWS = 1_000  # per model, placed by the queue; any further ones follow by submission
LIST_THUMBNAILS = 4  # images shown per row of the job list (the job's page shows them all)
LIST_THUMBNAIL_PX, PAGE_THUMBNAIL_PX = 96, 256  # made at twice the size they are shown at
STORED_IMAGE_MAX_BYTES = 64 * 1024 * 1024  # a stored image past this is not read for a thumbnail


def duration_text(start: datetime | None, end: datetime | None) -> str:
    """'0.42 s', '12.3 s', '4 min 05 s', '2 h 03 min'; '' when either end is missing."""
    if start is None or end is None:
        return ""
    seconds = max(0.0, (end - start).total_seconds())
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class QueueOrderFilter(admin.SimpleListFilter):
    """'Queued, in dispatch order': the queue's own order (fair share: the turns between accounts,
    then each account's priorities), which no SQL ordering can express. JobAdmin annotates each row
    with its place (`queue_place`) and orders by it."""

    title = "order"
    parameter_name = "order"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("queue", "Queued, in dispatch order")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        if self.value() == "queue":
            return queryset.filter(state=JobState.QUEUED)
        return queryset


def _in_queue_order(request: HttpRequest) -> bool:
    return request.GET.get(QueueOrderFilter.parameter_name) == "queue"


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """Jobs are written by their services, never by this form: the job page is read-only (no Save),
    and what an operator may do to a job is the actions."""

    list_display = ["short_id", "thumbnails", "model_id", "state", "owner", "priority", "position", "progress",
                    "attempts", "worker_id", "rung", "created_at", "waited", "ran", "gpu_time"]
    list_display_links = ["short_id"]
    list_filter = [QueueOrderFilter, "state", "model_id"]
    list_select_related = ["account"]
    search_fields = ["id", "account__username", "model_id", "worker_id"]
    actions = ["cancel_jobs", "pause_jobs", "resume_jobs", "requeue_jobs"]
    SHOWN = ["id", "account", "model_id", "state", "priority", "error", "created_at", "started_at", "finished_at",
             "waited", "ran", "gpu_time", "image_gallery", "init_image_thumbnail", "shown_params"]

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        return [*self.SHOWN, *self._other_fields()]

    def get_fieldsets(self, request: HttpRequest, obj: Job | None = None) -> Any:
        return [(None, {"fields": self.SHOWN[:12]}),
                ("Images and params", {"fields": self.SHOWN[12:]}),
                ("Scheduling", {"fields": self._other_fields(), "classes": ["collapse"]})]

    @staticmethod
    def _other_fields() -> list[str]:
        """Every other field of the model, so that one added later is shown too (params and images
        are shown above, without the init_image's base64 and as pictures)."""
        return [f.name for f in Job._meta.fields if f.name not in {*JobAdmin.SHOWN, "params", "images"}]

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        if _in_queue_order(request):  # the changelist's ordering would override the filter's
            return ("queue_place", "model_id", "submitted_us", "id")
        return ("-created_at",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        if not _in_queue_order(request):  # a row holds no image (init_images are in the storage)
            return super().get_queryset(request)
        order = selectors.dispatch_order(per_model=QUEUE_ORDER_ROWS)
        place = Case(*(When(id=job_id, then=Value(n)) for n, job_id in enumerate(order)),
                     default=Value(len(order)), output_field=IntegerField()) if order else Value(0)
        # annotated before the ordering that names it (ModelAdmin.get_queryset orders at once)
        return (Job._default_manager.defer("params").select_related("account").annotate(queue_place=place)
                .order_by(*self.get_ordering(request)))

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view  # staff only, as every admin page
        return [path("<uuid:object_id>/images/<int:index>/", view(self.image_view), name="scheduling_job_image"),
                path("<uuid:object_id>/images/<int:index>/thumbnail/<int:size>/", view(self.image_view),
                     name="scheduling_job_thumbnail"),
                path("<uuid:object_id>/init-image/thumbnail/<int:size>/", view(self.init_image_view),
                     name="scheduling_job_init_thumbnail"),
                *super().get_urls()]

    def _viewable(self, request: HttpRequest, object_id: Any) -> Job:
        job = Job.objects.filter(id=object_id).first()
        if job is None or not self.has_view_permission(request, job):
            raise Http404
        return job

    def image_view(self, request: HttpRequest, object_id: Any, index: int, size: int | None = None) -> HttpResponseBase:
        """One stored image of a job (as stored: PNG), or a JPEG thumbnail of it at most `size` px."""
        job = self._viewable(request, object_id)
        if index >= len(job.images) or not default_storage.exists(job.images[index]):
            raise Http404
        name = job.images[index]
        if size is None:
            content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
            return _private(FileResponse(default_storage.open(name, "rb"), content_type=content_type))
        with default_storage.open(name, "rb") as stored:
            return _thumbnail_response(stored.read(STORED_IMAGE_MAX_BYTES + 1), size)

    def init_image_view(self, request: HttpRequest, object_id: Any, size: int) -> HttpResponseBase:
        """A JPEG thumbnail of the init_image the job was submitted with."""
        content = init_image_content(self._viewable(request, object_id).init_image)
        if content is None:
            raise Http404
        return _thumbnail_response(content[0], size)

    @admin.display(description="owner", ordering="account__username")
    def owner(self, job: Job) -> str:
        return job.account.get_username()

    @admin.display(description="id", ordering="id")
    def short_id(self, job: Job) -> str:
        return str(job.id)[:8]

    @admin.display(description="images")
    def thumbnails(self, job: Job) -> SafeString:
        shown = _pictures(job, range(min(len(job.images), LIST_THUMBNAILS)), LIST_THUMBNAIL_PX)
        more = len(job.images) - LIST_THUMBNAILS
        return format_html("{}{}", shown, f" +{more}" if more > 0 else "")

    @admin.display(description="images")
    def image_gallery(self, job: Job) -> str:
        return _pictures(job, range(len(job.images)), PAGE_THUMBNAIL_PX) if job.images else "none"

    @admin.display(description="init image")
    def init_image_thumbnail(self, job: Job) -> str:
        if not job.init_image:
            return "none"
        url = reverse("admin:scheduling_job_init_thumbnail", args=[job.id, PAGE_THUMBNAIL_PX])
        return format_html('<img src="{}" alt="init image" class="job-thumbnail" style="max-width:{}px; '
                           'max-height:{}px">', url, PAGE_THUMBNAIL_PX // 2, PAGE_THUMBNAIL_PX // 2)

    @admin.display(description="params")
    def shown_params(self, job: Job) -> SafeString:
        params = {**job.params, INIT_IMAGE: "(an image, shown above)"} if job.init_image else job.params
        return format_html("<pre>{}</pre>", json.dumps(params, indent=2, sort_keys=True, ensure_ascii=False))

    @admin.display(description="waited", ordering="started_at")
    def waited(self, job: Job) -> str:
        """From submission to the first step on a worker."""
        return duration_text(job.created_at, job.started_at)

    @admin.display(description="ran")
    def ran(self, job: Job) -> str:
        """From its start on a worker to its end (pauses and preemptions included)."""
        return duration_text(job.started_at, job.finished_at)

    @admin.display(description="GPU time", ordering="gpu_ms")
    def gpu_time(self, job: Job) -> str:
        return "" if job.gpu_ms is None else f"{job.gpu_ms / 1000:.2f} s"

    @admin.display(description="position")
    def position(self, job: Job) -> int | None:
        return selectors.position_of(job)

    @admin.display(description="progress")
    def progress(self, job: Job) -> str:
        return f"{job.progress_step}/{job.progress_steps}" if job.progress_steps else ""

    @admin.action(description="Cancel the selected jobs")
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._each(request, queryset, services.job_cancel, "cancelled", skip=(JobAlreadyEnded,))

    @admin.action(description="Pause the selected jobs (held ones once their worker stops them)")
    def pause_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._each(request, queryset, services.job_pause, "paused", skip=(JobAlreadyEnded,))

    @admin.action(description="Resume the selected paused jobs")
    def resume_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._each(request, queryset, services.job_resume, "resumed", skip=(JobAlreadyEnded, JobNotPaused))

    def _each(self, request: HttpRequest, queryset: QuerySet[Job], service: Callable[..., Job], done_as: str, *,
              skip: tuple[type[Exception], ...]) -> None:
        """Run a job service on each selected job; those it refuses with one of `skip` are passed over."""
        done = 0
        for job in queryset:
            try:
                service(job=job, now=timezone.now())
                done += 1
            except skip:
                pass
        self.message_user(request, f"{done_as} {done} job(s)", messages.SUCCESS)

    @admin.action(description="Requeue the selected jobs (failed, cancelled or stuck)")
    def requeue_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        moved = [services.job_requeue(job=job, now=timezone.now()) for job in queryset]
        count = sum(1 for job in moved if job.state != JobState.SUCCEEDED)
        self.message_user(request, f"requeued {count} job(s)", messages.SUCCESS)


def _pictures(job: Job, indexes: range, size: int) -> SafeString:
    """Thumbnails of the job's images at `indexes`, each a link to the full image."""
    return format_html_join(
        " ", '<a href="{}"><img src="{}" alt="image {}" class="job-thumbnail" loading="lazy" '
             'style="max-width:{}px; max-height:{}px"></a>',
        ((reverse("admin:scheduling_job_image", args=[job.id, n]),
          reverse("admin:scheduling_job_thumbnail", args=[job.id, n, size]), n + 1, size // 2, size // 2)
         for n in indexes))


def _thumbnail_response(data: bytes, size: int) -> HttpResponseBase:
    if len(data) > STORED_IMAGE_MAX_BYTES:
        raise Http404
    try:
        small = thumbnail(data, size=size)
    except (NotAnImage, ValueError):
        raise Http404 from None
    return _private(HttpResponse(small, content_type="image/jpeg"))


def _private(response: HttpResponseBase) -> HttpResponseBase:
    """A job's images never change once stored; only the staff member's own browser keeps them."""
    response["Cache-Control"] = "private, max-age=3600"
    return response
