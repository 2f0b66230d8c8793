"""Model manifests (one JSON object per model, a file holds one or a list): parsed and validated once,
with one set of rules, for the API's registry and the GPU worker's installed models alike."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

TIERS = ("draft", "standard", "premium")
CAPABILITIES = ("txt2img", "img2img")
# The diffusers pipelines a manifest may name, one per model family (docs/protocol.md, "Model families"):
# SD 1.x/2.x, SDXL (also Turbo), SD3 and Flux; img2img comes from the same weights.
PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "FluxPipeline")
REQUIRED_FIELDS = ("model_id", "tier", "cost", "capabilities", "pipeline", "source", "params_schema")


class ManifestError(ValueError):
    """A manifest file is not valid."""


@dataclass(frozen=True)
class Manifest:
    model_id: str
    tier: str
    cost: float
    capabilities: tuple[str, ...]
    pipeline: str
    source: str
    params_schema: dict[str, Any] = field(hash=False, compare=False)
    # Caps on params the schema sets no maximum for (the API's MAX_IMAGE_SIDE and MAX_STEPS); see
    # param_caps(). Empty: the schema alone decides.
    caps: Mapping[str, int] = field(default_factory=dict, hash=False, compare=False)


def parse_manifest_file(data: bytes, *, origin: str) -> list[Manifest]:
    """The manifests in one file's bytes (UTF-8 JSON); ManifestError names origin and field."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{origin}: not UTF-8 text") from None
    return parse_manifests(text, origin=origin)


def parse_manifests(text: str, *, origin: str) -> list[Manifest]:
    """The manifests in one file's text (one object or a list); ManifestError names origin and field."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{origin}: not valid JSON ({exc})") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise ManifestError(f"{origin}: the list holds no manifest")
    manifests = [parse_manifest(item, origin=f"{origin}[{n}]" if isinstance(data, list) else origin)
                 for n, item in enumerate(items)]
    seen: set[str] = set()
    for manifest in manifests:
        if manifest.model_id in seen:
            raise ManifestError(f"{origin}: model_id {manifest.model_id!r} appears twice")
        seen.add(manifest.model_id)
    return manifests


def parse_manifest(item: Any, *, origin: str) -> Manifest:
    """One manifest object, validated field by field."""
    if not isinstance(item, dict):
        raise ManifestError(f"{origin}: a manifest must be a JSON object, got {type(item).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in item]
    if missing:
        raise ManifestError(f"{origin}: missing field {missing[0]!r}")

    def bad(name: str, why: str) -> ManifestError:
        return ManifestError(f"{origin}: field {name!r} {why}")

    model_id = item["model_id"]
    if not isinstance(model_id, str) or not model_id.strip() or len(model_id) > 200:
        raise bad("model_id", "must be a non-empty string of at most 200 characters")
    if item["tier"] not in TIERS:
        raise bad("tier", f"must be one of {', '.join(TIERS)}, got {item['tier']!r}")
    cost = item["cost"]
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
        raise bad("cost", f"must be a number of at least 0, got {cost!r}")
    capabilities = item["capabilities"]
    if not isinstance(capabilities, list) or not capabilities or any(c not in CAPABILITIES for c in capabilities):
        raise bad("capabilities", f"must be a non-empty list of {', '.join(CAPABILITIES)}, got {capabilities!r}")
    for name in ("pipeline", "source"):
        if not isinstance(item[name], str) or not item[name].strip():
            raise bad(name, "must be a non-empty string")
    if item["pipeline"] not in PIPELINES:
        raise bad("pipeline", f"must name a pipeline of a model family served: one of {', '.join(PIPELINES)}, "
                              f"got {item['pipeline']!r}")
    schema = item["params_schema"]
    if not isinstance(schema, dict):
        raise bad("params_schema", "must be a JSON Schema object")
    try:
        validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad("params_schema", f"is not a valid JSON Schema: {exc.message}") from None
    return Manifest(model_id=model_id, tier=item["tier"], cost=float(cost), capabilities=tuple(capabilities),
                    pipeline=item["pipeline"], source=item["source"], params_schema=schema)
