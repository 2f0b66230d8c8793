"""Operators' view of jobs: filter by state and model, queued ones in dispatch order with positions,
and actions to cancel, pause, resume and requeue."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import Case, IntegerField, QuerySet, Value, When
from django.http import HttpRequest
from django.utils import timezone

from scheduling import selectors, services
from scheduling.errors import JobAlreadyEnded, JobNotPaused
from scheduling.models import Job, JobState

QUEUE_ORDER_ROWS = 1_000  # per model, placed by the queue; any further ones follow by submission


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
class JobAdmin(admin.ModelAdmin):
    list_display = ["id", "account", "model_id", "state", "priority", "position", "attempts", "preemptions",
                    "worker_id", "progress", "checkpoint_step", "rung", "gpu_ms", "created_at", "finished_at"]
    list_filter = [QueueOrderFilter, "state", "model_id"]
    search_fields = ["id", "account__username", "model_id", "worker_id"]
    readonly_fields = [f.name for f in Job._meta.fields]
    actions = ["cancel_jobs", "pause_jobs", "resume_jobs", "requeue_jobs"]

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        if _in_queue_order(request):  # the changelist's ordering would override the filter's
            return ("queue_place", "model_id", "submitted_us", "id")
        return ("-created_at",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        if not _in_queue_order(request):
            return super().get_queryset(request)
        order = selectors.dispatch_order(per_model=QUEUE_ORDER_ROWS)
        place = Case(*(When(id=job_id, then=Value(n)) for n, job_id in enumerate(order)),
                     default=Value(len(order)), output_field=IntegerField()) if order else Value(0)
        # annotated before the ordering that names it (ModelAdmin.get_queryset orders at once)
        return Job._default_manager.annotate(queue_place=place).order_by(*self.get_ordering(request))

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

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
