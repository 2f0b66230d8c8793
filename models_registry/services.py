"""Writes of the model registry: manifest files loaded all or nothing."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from django.db import transaction

from models_registry.models import ModelManifest
from potocolom.protocol.manifests import Manifest, ManifestError, parse_manifest_file


def read_manifest_file(path: Path) -> list[Manifest]:
    """Read and validate one manifest file (ManifestError names the file and the field)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot be read ({exc.strerror})") from None
    return parse_manifest_file(data, origin=str(path))


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
