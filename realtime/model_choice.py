"""Which model a session asks for, and its size and steps, from the socket's query (pure)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from potocolom.protocol.manifests import TIERS, Manifest
from potocolom.protocol.params import params_errors
from realtime.errors import BadQuery, NoModelFits

SESSION_PARAMS = ("width", "height", "steps")  # the query fixes these for the whole session
REALTIME_CAPABILITY = "img2img"


def session_params(query: Mapping[str, str]) -> dict[str, int]:
    """width, height and steps from the query, as integers (BadQuery when one is not)."""
    params = {}
    for name in SESSION_PARAMS:
        raw = query.get(name)
        if raw is None:
            continue
        try:
            params[name] = int(raw, 10)
        except ValueError:
            raise BadQuery(f"{name} must be an integer") from None
    return params


def params_fit(manifest: Manifest, params: dict[str, Any]) -> list[str]:
    """The model's complaints about the session's own params (its other required fields, such as
    the prompt, come with each frame)."""
    properties = manifest.params_schema.get("properties", {}) if isinstance(manifest.params_schema, dict) else {}
    schema = {"type": "object", "properties": {k: v for k, v in properties.items() if k in params}}
    return params_errors(schema, params, caps=manifest.caps)  # MAX_IMAGE_SIDE/MAX_STEPS for an open schema


def pick_session_model(manifests: Sequence[Manifest], query: Mapping[str, str]) -> tuple[Manifest, dict[str, int]]:
    """The session's model and params: `model_id` wins; otherwise the cheapest img2img model of
    `tier` (of any tier when none is given), ties to the smaller model_id."""
    params = session_params(query)
    model_id, tier = query.get("model_id"), query.get("tier")
    if model_id:
        manifest = next((m for m in manifests if m.model_id == model_id), None)
        if manifest is None or REALTIME_CAPABILITY not in manifest.capabilities:
            raise NoModelFits(f"no img2img model {model_id!r} is registered")
    else:
        if tier and tier not in TIERS:
            raise BadQuery(f"tier must be one of {', '.join(TIERS)}")
        fitting = [m for m in manifests if REALTIME_CAPABILITY in m.capabilities and (not tier or m.tier == tier)]
        if not fitting:
            raise NoModelFits(f"no img2img model of tier {tier!r} is registered" if tier else None)
        manifest = min(fitting, key=lambda m: (m.cost, m.model_id))
    problems = params_fit(manifest, params)
    if problems:
        raise BadQuery("; ".join(problems))
    return manifest, params
