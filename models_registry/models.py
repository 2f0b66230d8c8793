"""Registered models: one row per manifest, the truth that routing reads."""
from __future__ import annotations

from django.db import models


class Tier(models.TextChoices):
    DRAFT = "draft"
    STANDARD = "standard"
    PREMIUM = "premium"


class ModelManifest(models.Model):
    """A model the API can route jobs and sessions to (loaded by `load_manifests`)."""

    model_id = models.CharField(max_length=200, unique=True)
    tier = models.CharField(max_length=20, choices=Tier.choices)
    cost = models.FloatField()
    capabilities = models.JSONField(default=list)
    pipeline = models.CharField(max_length=200)
    source = models.CharField(max_length=1000)
    params_schema = models.JSONField(default=dict)
    loaded_from = models.CharField(max_length=1000, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["cost", "model_id"]

    def __str__(self) -> str:
        return self.model_id
