"""The job's wire shapes (REST)."""
from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.urls import reverse
from django.utils import timezone
from rest_framework import serializers

from potocolom.protocol.manifests import CAPABILITIES, TIERS
from scheduling import selectors
from scheduling.images import INIT_IMAGE
from scheduling.models import Job, JobState, WebhookDelivery
from scheduling.services import JobRequest


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know, so a typo is an error instead of being ignored."""

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if isinstance(self.initial_data, dict):
            unknown = sorted(set(self.initial_data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        return attrs


def _unstorable(value: Any, depth: int = 0) -> str | None:
    """Why a JSON value cannot be stored as is, or None."""
    if depth > 32:
        return "params are nested too deeply"
    if isinstance(value, str):
        if "\x00" in value:
            return "text in params may not hold a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "text in params must be valid Unicode"
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "numbers in params must be finite"
    if isinstance(value, dict):
        return next(filter(None, (_unstorable(k, depth + 1) or _unstorable(v, depth + 1) for k, v in value.items())),
                    None)
    if isinstance(value, list):
        return next(filter(None, (_unstorable(v, depth + 1) for v in value)), None)
    return None


class JobCreateSerializer(StrictSerializer):
    model_id = serializers.CharField(required=False, max_length=200)
    tier = serializers.ChoiceField(choices=TIERS, required=False)
    capabilities = serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES), required=False,
                                         max_length=len(CAPABILITIES))
    params = serializers.DictField()
    priority = serializers.IntegerField(min_value=0, max_value=9, required=False, default=0)
    webhook_url = serializers.CharField(required=False, max_length=2000, trim_whitespace=False,
                                        help_text="http or https URL the job's end is POSTed to, signed (Standard "
                                                  "Webhooks); its host must resolve to public addresses only")

    def validate_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params must be storable as JSON in every database: finite numbers, UTF-8 text, no NUL."""
        problem = _unstorable(params)
        if problem:
            raise serializers.ValidationError(problem)
        return params

    def to_request(self) -> JobRequest:
        data = self.validated_data
        return JobRequest(params=data["params"], model_id=data.get("model_id"), tier=data.get("tier"),
                          capabilities=tuple(data.get("capabilities") or ()), priority=data["priority"])


class ProgressSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    steps = serializers.IntegerField()


def shown_params(job: Job, *, image_url: Callable[[str], str]) -> Any:
    """The job's params as its representation shows them: an init_image (kept in the storage, never
    in the row) reads as the URL that serves it."""
    params = job.params
    if not job.init_image or not isinstance(params, dict):
        return params
    return {**params, INIT_IMAGE: image_url(reverse("job-init-image", kwargs={"pk": job.id}))}


def job_payload(job: Job, *, position: int | None, image_url: Callable[[str], str],
                eta_seconds: float | None = None) -> dict[str, Any]:
    """A job as the contract shows it, built by hand: DRF's ModelSerializer spends ~2.5 ms a job
    building its fields, which is most of a submit's time on a small machine. It never carries an
    image: params.init_image and images are URLs."""
    return {
        "id": str(job.id), "state": job.state, "model_id": job.model_id,
        "params": shown_params(job, image_url=image_url),
        "priority": job.priority, "attempts": job.attempts,
        "position": position if job.state == JobState.QUEUED else None, "worker_id": job.worker_id,
        "created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "finished_at": _iso(job.finished_at),
        "images": [image_url(reverse("job-image", kwargs={"pk": job.id, "index": n})) for n in range(len(job.images))],
        "error": job.error,
        "progress": None if job.progress_steps is None else {"step": job.progress_step or 0,
                                                             "steps": job.progress_steps},
        "rung": job.rung or None,
        "preemptions": job.preemptions, "checkpoint_step": job.checkpoint_step,
        "webhook": webhook_payload(job),
        "eta_seconds": eta_seconds if job.state == JobState.QUEUED else None,
    }


def webhook_payload(job: Job) -> dict[str, Any] | None:
    """The job's webhook as its owner sees it: its URL, its latest event's id and state ("waiting"
    until the job ends) and every attempt of it; None without one. A page of jobs lists their
    deliveries once (`listed_deliveries`, newest first); a single job reads its latest."""
    if not job.webhook_url:
        return None
    listed = getattr(job, "listed_deliveries", None)
    delivery: WebhookDelivery | None = (listed[0] if listed else None) if listed is not None else (
        job.webhook_deliveries.order_by("-created_at", "id").first())
    return {"url": job.webhook_url, "webhook_id": delivery.webhook_id if delivery else None,
            "state": delivery.state if delivery else "waiting",
            "attempts": list(delivery.attempts) if delivery else []}


class WebhookAttemptSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    status_code = serializers.IntegerField(allow_null=True, help_text="the receiver's status; null without an answer")
    error = serializers.CharField(allow_null=True, help_text="why the attempt failed without an answer (refused "
                                                             "host, timeout, connection error)")
    duration_ms = serializers.FloatField()


class WebhookSerializer(serializers.Serializer):
    url = serializers.CharField()
    webhook_id = serializers.CharField(allow_null=True, help_text="the event's webhook-id, the same on every retry")
    state = serializers.ChoiceField(choices=["waiting", "pending", "delivered", "failed"])
    attempts = WebhookAttemptSerializer(many=True)


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    value = moment.isoformat()
    return value[:-6] + "Z" if value.endswith("+00:00") else value


class JobSerializer(serializers.ModelSerializer):
    """The job's shape (for the OpenAPI schema); rendering goes through job_payload."""

    id = serializers.CharField(read_only=True)
    position = serializers.IntegerField(read_only=True, allow_null=True,
                                        help_text="1-based place among queued jobs of its model; null unless queued "
                                                  "(a paused job too)")
    images = serializers.ListField(child=serializers.URLField(), read_only=True, help_text="URLs of its PNG images")
    progress = ProgressSerializer(read_only=True, allow_null=True,
                                  help_text="the worker's last job_progress: denoising step `step` of `steps`")
    rung = serializers.CharField(read_only=True, allow_null=True, help_text="the memory rung the result ran on")
    params = serializers.JSONField(read_only=True, help_text="as submitted, except init_image: the URL serving it")
    preemptions = serializers.IntegerField(read_only=True, help_text="how often it was taken off a worker before "
                                           "it ended (preempted, paused, drained); a dead worker counts in attempts")
    checkpoint_step = serializers.IntegerField(read_only=True, allow_null=True,
                                               help_text="the step of its stored checkpoint, which it resumes from; "
                                                         "null without one")
    eta_seconds = serializers.FloatField(read_only=True, allow_null=True,
                                         help_text="a queued job's estimated wait until it starts, in seconds, from "
                                                   "the measured step time of its model's workers and the steps "
                                                   "queued ahead of it; null otherwise, or with no measured worker")

    webhook = WebhookSerializer(read_only=True, allow_null=True,
                                help_text="its webhook_url's delivery (visible to its own account only); null "
                                          "without one")

    class Meta:
        model = Job
        fields = ["id", "state", "model_id", "params", "priority", "attempts", "position", "worker_id",
                  "created_at", "started_at", "finished_at", "images", "error", "progress", "rung", "preemptions",
                  "checkpoint_step", "eta_seconds", "webhook"]
        read_only_fields = fields

    def to_representation(self, job: Job) -> dict[str, Any]:
        request = self.context.get("request")
        positions = self.context.get("positions", {})
        eta = self._etas(positions, job).get(str(job.id))
        return job_payload(job, position=positions.get(str(job.id)), eta_seconds=eta,
                           image_url=request.build_absolute_uri if request else str)

    def _etas(self, positions: dict[str, int], job: Job) -> dict[str, float]:
        """The estimated waits of the jobs rendered together (a page's, read once for all of them)."""
        etas = self.context.get("etas")
        if etas is None:
            parent = self.parent
            jobs = parent.instance if isinstance(parent, serializers.ListSerializer) else [job]
            etas = selectors.etas_of([each for each in jobs or () if isinstance(each, Job)], positions=positions,
                                     now=timezone.now())
            self.context["etas"] = etas  # type: ignore[index]  # the context dict, shared by a page's jobs
        return etas
