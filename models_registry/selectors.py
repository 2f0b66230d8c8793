"""Reads of the model registry, as plain manifests for the pure routing rules."""
from __future__ import annotations

from django.conf import settings

from models_registry.models import ModelManifest
from potocolom.protocol.manifests import Manifest
from potocolom.protocol.params import param_caps


def registered_manifests() -> list[Manifest]:
    """Every registered model as plain data, cheapest first."""
    return [to_manifest(row) for row in ModelManifest.objects.all()]


def registered_ids(model_ids: list[str]) -> set[str]:
    """Those of `model_ids` that are registered."""
    return set(ModelManifest.objects.filter(model_id__in=model_ids).values_list("model_id", flat=True))


def to_manifest(row: ModelManifest) -> Manifest:
    """The row as routing sees it: with the API's MAX_IMAGE_SIDE and MAX_STEPS as caps on the params
    its schema sets no maximum for."""
    return Manifest(model_id=row.model_id, tier=row.tier, cost=row.cost, capabilities=tuple(row.capabilities),
                    pipeline=row.pipeline, source=row.source, params_schema=row.params_schema,
                    caps=param_caps(max_side=settings.MAX_IMAGE_SIDE, max_steps=settings.MAX_STEPS))
