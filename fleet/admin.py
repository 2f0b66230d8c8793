"""Operators' view of workers (connected, models, jobs in flight; read-only) and their credentials."""
from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from potocolom.web.read_only import ReadOnlyAdmin
from scheduling.models import HELD_STATES, Job
from workers.models import PlacementRecord, Worker, WorkerToken
from workers.services import worker_tokens_revoke


@admin.register(Worker)
class WorkerAdmin(ReadOnlyAdmin):
    """Read-only: a worker's row is its hello's and heartbeats' (workers.services); its credential
    is revoked on the worker tokens' page."""

    # `token`: the credential this worker_id is bound to (None once that token was revoked).
    list_display = ["worker_id", "token", "connected", "models_served", "models_installed", "jobs_in_flight",
                    "gpu_memory", "last_seen"]
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

    @admin.display(description="installed (MiB needed: full / model offload / group offload)")
    def models_installed(self, worker: Worker) -> str:
        """What placement may load there (a v2 hello's `installed`); a v1 worker says nothing."""
        if worker.installed is None:
            return "not said (placement leaves it as it is)"
        def entry(m: dict) -> str:
            needs = m.get("needs_mib") or {}
            step = f", {m['step_ms']:.0f} ms/step" if isinstance(m.get("step_ms"), (int, float)) else ""
            return (f"{m.get('model_id')} ({needs.get('full', '?')} / {needs.get('model_offload', '?')} / "
                    f"{needs.get('group_offload', '?')}{step})")
        return ", ".join(entry(m) for m in worker.installed) or "none"

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


@admin.register(PlacementRecord)
class PlacementRecordAdmin(ReadOnlyAdmin):
    """What placement asked of workers and why (read-only: placement writes these)."""

    list_display = ["sent_at", "action", "model_id", "worker_id", "rung", "outcome_shown", "duration", "reason"]
    list_filter = ["action", "outcome", "worker_id"]
    search_fields = ["model_id", "worker_id", "reason"]
    readonly_fields = [f.name for f in PlacementRecord._meta.fields]

    @admin.display(description="outcome")
    def outcome_shown(self, record: PlacementRecord) -> str:
        text = record.outcome or "waiting"
        return f"{text}: {record.error}" if record.error else text

    @admin.display(description="duration")
    def duration(self, record: PlacementRecord) -> str:
        seconds = record.duration_seconds
        return "" if seconds is None else f"{seconds:.1f} s"
