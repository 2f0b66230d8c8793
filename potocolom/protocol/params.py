"""A job's or a session's params against its model's params_schema: the one validator of the API
(every complaint, by place) and of the GPU worker (the most relevant one, for job_failed)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import exceptions
from jsonschema.validators import validator_for

SIDE_PARAMS = ("width", "height")
STEPS_PARAM = "steps"


def param_caps(*, max_side: int, max_steps: int) -> dict[str, int]:
    """The caps for width, height and steps, for a schema that sets no maximum of its own."""
    return {**{name: max_side for name in SIDE_PARAMS}, STEPS_PARAM: max_steps}


def complaints(schema: dict[str, Any], params: Any, *,
               caps: Mapping[str, int] | None = None) -> list[tuple[list[str], str]]:
    """The schema's complaints about params (the path to the place, the message), then each cap of
    `caps` that a param exceeds while its schema sets no maximum (or exclusiveMaximum) of its own."""
    validator = validator_for(schema)(schema)
    found = [([str(p) for p in error.absolute_path], error.message)
             for error in sorted(validator.iter_errors(params), key=lambda e: list(e.absolute_path))]
    if caps and isinstance(params, dict):
        properties = schema.get("properties")
        declared = properties if isinstance(properties, dict) else {}
        for name, cap in caps.items():
            own = declared.get(name)
            if isinstance(own, dict) and ("maximum" in own or "exclusiveMaximum" in own):
                continue
            value = params.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
                found.append(([name], f"{value} is greater than the maximum of {cap}"))
    return found


def params_errors(schema: dict[str, Any], params: Any, *, caps: Mapping[str, int] | None = None) -> list[str]:
    """The complaints about params as messages naming the place ('' when none)."""
    return [f"{'/'.join(path)}: {message}" if path else message
            for path, message in complaints(schema, params, caps=caps)]


def params_problems(schema: dict[str, Any], params: Any, *,
                    caps: Mapping[str, int] | None = None) -> dict[str, list[str]]:
    """The complaints about params by the param they concern ("params" for the object as a whole,
    such as a missing required field)."""
    problems: dict[str, list[str]] = {}
    for path, message in complaints(schema, params, caps=caps):
        inner = "/".join(path[1:])
        problems.setdefault(path[0] if path else "params", []).append(f"{inner}: {message}" if inner else message)
    return problems


def params_error(schema: dict[str, Any], params: Any) -> tuple[str, str] | None:
    """The schema's most relevant complaint about params: its place ("params" for the object as a
    whole) and message; None when there is none or no schema. What a worker reports in job_failed."""
    if not schema:
        return None
    error = exceptions.best_match(validator_for(schema)(schema).iter_errors(params))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "params"
    return where, error.message
