"""The worker's own caps on what arrives from outside: the pixels an image may declare, and the
largest width/height and steps of a model whose params_schema sets no maximum. Read once from the
environment at start (the worker has no Django settings); docs/operations.md lists them."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MAX_IMAGE_PIXELS = 4_194_304  # the contract's default: a 2048 x 2048 image
MAX_IMAGE_SIDE = 2048  # width/height cap for a model whose schema sets no maximum
MAX_STEPS = 150  # steps cap for a model whose schema sets no maximum


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class Limits:
    """MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE and MAX_STEPS as this worker applies them."""

    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_image_side: int = MAX_IMAGE_SIDE
    max_steps: int = MAX_STEPS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Limits:
        """The limits the environment sets, each defaulted; a bad value fails loudly."""
        return cls(max_image_pixels=_positive_int(environ, "MAX_IMAGE_PIXELS", MAX_IMAGE_PIXELS),
                   max_image_side=_positive_int(environ, "MAX_IMAGE_SIDE", MAX_IMAGE_SIDE),
                   max_steps=_positive_int(environ, "MAX_STEPS", MAX_STEPS))


def allowed_maximum(schema: object, key: str, cap: int) -> int:
    """The largest integer `key` a params_schema allows: its enum's largest, else its `maximum`,
    else `cap` (MAX_IMAGE_SIDE or MAX_STEPS: a schema without a maximum gets the worker's)."""
    properties = schema.get("properties", {}) if isinstance(schema, Mapping) else {}
    spec = properties.get(key, {}) if isinstance(properties, Mapping) else {}
    if not isinstance(spec, Mapping):
        return cap
    if isinstance(spec.get("enum"), list):
        allowed = [v for v in spec["enum"] if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        if allowed:
            return max(allowed)
    high = spec.get("maximum")
    if isinstance(high, int) and not isinstance(high, bool) and high > 0:
        return high
    return cap
