"""Writes and reads of the model registry."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from django.db import transaction

from models_registry.manifests import Manifest, ManifestError, read_manifest_file
from models_registry.models import ModelManifest


def manifests_load(*, paths: Iterable[Path]) -> list[Manifest]:
    """Validate every file first, then upsert all of them in one transaction: all or nothing."""
    loaded: list[tuple[Manifest, Path]] = []
    for path in paths:
        loaded.extend((manifest, path) for manifest in read_manifest_file(path))
    seen: dict[str, Path] = {}
    for manifest, path in loaded:
        if manifest.model_id in seen:
            raise ManifestError(f"{path}: model_id {manifest.model_id!r} is also in {seen[manifest.model_id]}")
        seen[manifest.model_id] = path
    with transaction.atomic():
        for manifest, path in loaded:
            ModelManifest.objects.update_or_create(
                model_id=manifest.model_id,
                defaults={"tier": manifest.tier, "cost": manifest.cost, "capabilities": list(manifest.capabilities),
                          "pipeline": manifest.pipeline, "source": manifest.source,
                          "params_schema": manifest.params_schema, "loaded_from": str(path.resolve())},
            )
    return [manifest for manifest, _ in loaded]


def registered_manifests() -> list[Manifest]:
    """Every registered model as plain data, for routing."""
    return [to_manifest(row) for row in ModelManifest.objects.all()]


def to_manifest(row: ModelManifest) -> Manifest:
    return Manifest(model_id=row.model_id, tier=row.tier, cost=row.cost, capabilities=tuple(row.capabilities),
                    pipeline=row.pipeline, source=row.source, params_schema=row.params_schema)
