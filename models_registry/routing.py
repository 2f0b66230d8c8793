"""Routing a job to a model (pure): the named model, or the cheapest registered one that fits."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from models_registry.errors import InvalidParams, NoMatchingModel, UnknownModel
from potocolom.protocol.manifests import Manifest
from potocolom.protocol.params import params_errors, params_problems


def route(manifests: Sequence[Manifest], *, model_id: str | None = None, tier: str | None = None,
          capabilities: Iterable[str] = (), params: dict[str, Any]) -> Manifest:
    """The model a request goes to.

    With model_id: that model, if registered and its schema (and its caps) accept params. Without:
    the cheapest model whose tier (when given), capabilities (all given) and params_schema match;
    ties go to the smaller model_id. NoMatchingModel's detail names, per candidate of that tier and
    those capabilities, the params it refused.
    """
    if model_id is not None:
        named = next((m for m in manifests if m.model_id == model_id), None)
        if named is None:
            raise UnknownModel({"model_id": [f"no model {model_id!r} is registered"]})
        errors = params_errors(named.params_schema, params, caps=named.caps)
        if errors:
            raise InvalidParams({"params": errors})
        return named
    wanted = set(capabilities)
    candidates = [m for m in manifests if (tier is None or m.tier == tier) and wanted <= set(m.capabilities)]
    problems = {m.model_id: params_problems(m.params_schema, params, caps=m.caps) for m in candidates}
    fitting = [m for m in candidates if not problems[m.model_id]]
    if not fitting:
        asked = {"tier": tier, "capabilities": sorted(wanted)}
        # Which params each model of that tier and those capabilities refused, so a client can fix them.
        raise NoMatchingModel({"message": f"no registered model fits {asked} and these params",
                               "candidates": dict(sorted(problems.items()))})
    return min(fitting, key=lambda m: (m.cost, m.model_id))
