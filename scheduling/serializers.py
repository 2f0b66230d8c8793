"""The job's wire shapes (REST)."""
from __future__ import annotations

from typing import Any

from django.urls import reverse
from rest_framework import serializers

from models_registry.manifests import CAPABILITIES, TIERS
from scheduling.models import Job, JobState
from scheduling.services import JobRequest


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know, so a typo is an error instead of being ignored."""

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if isinstance(self.initial_data, dict):
            unknown = sorted(set(self.initial_data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["unknown field"] for name in unknown})
        return attrs


class JobCreateSerializer(StrictSerializer):
    model_id = serializers.CharField(required=False, max_length=200)
    tier = serializers.ChoiceField(choices=TIERS, required=False)
    capabilities = serializers.ListField(child=serializers.ChoiceField(choices=CAPABILITIES), required=False,
                                         max_length=len(CAPABILITIES))
    params = serializers.DictField()
    priority = serializers.IntegerField(min_value=0, max_value=9, required=False, default=0)

    def to_request(self) -> JobRequest:
        data = self.validated_data
        return JobRequest(params=data["params"], model_id=data.get("model_id"), tier=data.get("tier"),
                          capabilities=tuple(data.get("capabilities") or ()), priority=data["priority"])


class ProgressSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    steps = serializers.IntegerField()


class JobSerializer(serializers.ModelSerializer):
    id = serializers.CharField(read_only=True)
    position = serializers.SerializerMethodField()
    images = serializers.SerializerMethodField()
    progress = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "state", "model_id", "params", "priority", "attempts", "position", "worker_id",
                  "created_at", "started_at", "finished_at", "images", "error", "progress"]
        read_only_fields = fields

    def get_position(self, job: Job) -> int | None:
        positions = self.context.get("positions", {})
        return positions.get(str(job.id)) if job.state == JobState.QUEUED else None

    def get_images(self, job: Job) -> list[str]:
        request = self.context.get("request")
        urls = [reverse("job-image", kwargs={"pk": job.id, "index": n}) for n in range(len(job.images))]
        return [request.build_absolute_uri(url) for url in urls] if request else urls

    def get_progress(self, job: Job) -> dict[str, int] | None:
        """The worker's last job_progress: denoising step `step` of `steps`."""
        if job.progress_steps is None:
            return None
        return {"step": job.progress_step or 0, "steps": job.progress_steps}
