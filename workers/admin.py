"""Operators' view of workers (connected, models, jobs in flight) and their credentials."""
from __future__ import annotations

from django.contrib import admin

from scheduling.models import HELD_STATES, Job
from workers.models import Worker, WorkerToken


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["worker_id", "connected", "models_served", "jobs_in_flight", "gpu", "last_seen"]
    list_filter = ["connected"]
    readonly_fields = [f.name for f in Worker._meta.fields]

    @admin.display(description="models")
    def models_served(self, worker: Worker) -> str:
        return ", ".join(f"{m['model_id']} ({m['rung']})" for m in worker.served_models)

    @admin.display(description="jobs in flight")
    def jobs_in_flight(self, worker: Worker) -> str:
        jobs = Job.objects.filter(worker_id=worker.worker_id, state__in=HELD_STATES).values_list("id", "state")
        return ", ".join(f"{job_id} ({state})" for job_id, state in jobs) or "none"

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(WorkerToken)
class WorkerTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at", "revoked"]
    readonly_fields = ["token_hash", "created_at"]
    list_editable = ["revoked"]
