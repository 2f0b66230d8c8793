"""Operators' view of workers (connected, models, jobs in flight) and their credentials."""
from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from scheduling.models import HELD_STATES, Job
from workers.models import Worker, WorkerToken
from workers.services import worker_tokens_revoke


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    # `token`: the credential this worker_id is bound to (None once that token was revoked).
    list_display = ["worker_id", "token", "connected", "models_served", "jobs_in_flight", "gpu_memory", "last_seen"]
    list_filter = ["connected"]
    readonly_fields = [f.name for f in Worker._meta.fields]

    @admin.display(description="models (rung)")
    def models_served(self, worker: Worker) -> str:
        """Each model with the memory rung it runs on (kept current by rung_changed)."""
        def entry(m: dict) -> str:
            slots = m.get("realtime_slots") or 0
            realtime = f", {slots} realtime slots" if m.get("realtime") and slots else ""
            return f"{m['model_id']} ({m.get('rung', '?')}{realtime})"
        return ", ".join(entry(m) for m in worker.served_models)

    @admin.display(description="GPU")
    def gpu_memory(self, worker: Worker) -> str:
        gpu = worker.gpu
        if not isinstance(gpu, dict):
            return "none (CPU)"
        return f"{gpu.get('name')}: {gpu.get('free_mib')} of {gpu.get('total_mib')} MiB free"

    @admin.display(description="jobs in flight")
    def jobs_in_flight(self, worker: Worker) -> str:
        jobs = Job.objects.filter(worker_id=worker.worker_id, state__in=HELD_STATES).values_list("id", "state")
        return ", ".join(f"{job_id} ({state})" for job_id, state in jobs) or "none"

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(WorkerToken)
class WorkerTokenAdmin(admin.ModelAdmin):
    """Revoking goes through the action (as `manage.py revoke_worker_token`): it also ends the
    token's worker_id bindings, and its open sockets close within a heartbeat period."""

    list_display = ["name", "created_at", "revoked"]
    list_filter = ["revoked"]
    readonly_fields = ["token_hash", "created_at", "revoked"]
    actions = ["revoke"]

    @admin.action(description="Revoke the selected worker tokens (their workers are disconnected)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[WorkerToken]) -> None:
        count = worker_tokens_revoke(token_ids=list(queryset.values_list("pk", flat=True)))
        self.message_user(request, f"revoked {count}", messages.SUCCESS)
