from __future__ import annotations

from django.contrib import admin

from models_registry.models import ModelManifest


@admin.register(ModelManifest)
class ModelManifestAdmin(admin.ModelAdmin):
    list_display = ["model_id", "tier", "cost", "capabilities", "pipeline", "updated_at"]
    list_filter = ["tier"]
    search_fields = ["model_id"]
    readonly_fields = ["updated_at", "loaded_from"]
