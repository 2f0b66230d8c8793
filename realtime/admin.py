"""Operators' view of sessions (the admission queue in order with positions, live sessions per
worker, an action to end sessions) and of metering; read-only pages."""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from potocolom.web.read_only import ReadOnlyAdmin
from realtime import selectors, services
from realtime.models import RealtimeSession, SessionState, UsageRecord, UsageTally


class SessionViewFilter(admin.SimpleListFilter):
    """'The queue, in admission order' and 'live, by worker'."""

    title = "view"
    parameter_name = "view"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("queue", "The queue, in admission order"), ("live", "Live, by worker")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[RealtimeSession]) -> QuerySet[RealtimeSession]:
        if self.value() == "queue":
            return queryset.filter(state=SessionState.QUEUED).order_by("joined_at", "id")
        if self.value() == "live":
            return queryset.filter(state__in=(SessionState.PLACING, SessionState.LIVE)).order_by("worker_id",
                                                                                                 "joined_at")
        return queryset


@admin.register(RealtimeSession)
class RealtimeSessionAdmin(ReadOnlyAdmin):
    """Read-only: admission and the session services write sessions; ending one is the action."""

    list_display = ["id", "account", "model_id", "state", "position", "worker_id", "free_slots", "joined_at",
                    "live_since", "closed_at"]
    list_filter = [SessionViewFilter, "state", "model_id", "worker_id"]
    search_fields = ["id", "account__username", "model_id", "worker_id"]
    readonly_fields = [f.name for f in RealtimeSession._meta.fields]
    actions = ["end_sessions"]

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        return ("joined_at", "id")

    @admin.display(description="position")
    def position(self, session: RealtimeSession) -> int | None:
        if session.state != SessionState.QUEUED:
            return None
        return selectors.queue_positions().get(str(session.id))

    @admin.display(description="free slots on its worker")
    def free_slots(self, session: RealtimeSession) -> int | None:
        if not session.worker_id:
            return None
        return selectors.slots_free().get((session.worker_id, session.model_id))

    @admin.action(description="End the selected sessions")
    def end_sessions(self, request: HttpRequest, queryset: QuerySet[RealtimeSession]) -> None:
        ended = sum(1 for session in queryset if services.session_end(session_id=str(session.id), now=timezone.now()))
        self.message_user(request, f"ended {ended} session(s)", messages.SUCCESS)


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ["account", "model_id", "session", "worker_id", "started_at", "ended_at", "seconds"]
    list_filter = ["model_id", "account"]
    search_fields = ["account__username", "model_id"]
    readonly_fields = [f.name for f in UsageRecord._meta.fields]


@admin.register(UsageTally)
class UsageTallyAdmin(ReadOnlyAdmin):
    """The seconds of the usage records retention deleted, per account and model."""

    list_display = ["account", "model_id", "seconds"]
    list_filter = ["model_id"]
    search_fields = ["account__username", "model_id"]
    readonly_fields = [f.name for f in UsageTally._meta.fields]
