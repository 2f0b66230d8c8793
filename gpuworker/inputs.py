"""What a job or a frame brings in, checked before anything runs: params field by field and against
the manifest's params_schema, and images from their header before a pixel is decoded; the caps:
docs/operations.md, "The memory ladder (GPU workers)"."""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from potocolom.protocol.images import FORMATS, ImageRefused, checked_image
from potocolom.protocol.params import params_error

if TYPE_CHECKING:
    from PIL.Image import Image

MESSAGE_CHARS = 300  # error messages travel in job_failed; an echoed init_image must not


class ParamsRefused(ValueError):
    """A job's params (or a frame's image) that this worker cannot run."""


def short(text: str) -> str:
    """`text` cut to MESSAGE_CHARS."""
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


def checked_integer(params: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamsRefused(f"{key} must be an integer, got {short(repr(value))}")
    if not low <= value <= high:
        raise ParamsRefused(f"{key} must be between {low} and {high}, got {value}")
    return value


def checked_number(params: dict[str, Any], key: str, default: float, low: float, high: float | None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamsRefused(f"{key} must be a number, got {short(repr(value))}")
    if value < low or (high is not None and value > high):
        raise ParamsRefused(f"{key} must be between {low} and {high if high is not None else 'any'}, got {value}")
    return float(value)


def checked_text(params: dict[str, Any], key: str, *, required: bool) -> str | None:
    value = params.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ParamsRefused(f"{key} must be a string, got {short(repr(value))}")
    return value


def check_schema(schema: dict[str, Any], params: Any) -> None:
    """Validate params against the manifest's params_schema (potocolom.protocol.params) with a short message."""
    error = params_error(schema, params)
    if error is not None:
        where, message = error
        raise ParamsRefused(f"{where}: {short(message)}")


def checked_image_bytes(value: Any, *, max_pixels: int, what: str = "init_image") -> bytes:
    """The bytes of a base64 (or `data:` URL) PNG, JPEG or WebP declaring at most `max_pixels`
    pixels, checked from its header alone (a bomb is refused in microseconds); ParamsRefused else."""
    if not isinstance(value, str):
        raise ParamsRefused(f"{what} must be a base64 string, got {type(value).__name__}")
    try:
        data, _ = checked_image(value, max_pixels=max_pixels)
    except ImageRefused as exc:
        raise ParamsRefused(f"{what}: {exc}") from None
    return data


def open_image(data: bytes, *, max_pixels: int, what: str = "init_image") -> Image:
    """Decode checked bytes (checked_image_bytes) to an RGB PIL image, PNG, JPEG or WebP only."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data), formats=list(FORMATS)) as opened:
            pixels = opened.width * opened.height
            if pixels <= max_pixels:  # checked already: never decode a bomb, whoever calls this
                return opened.convert("RGB")
    except (ValueError, UnidentifiedImageError, OSError, PILImage.DecompressionBombError) as exc:
        raise ParamsRefused(f"{what} is not a readable image: {short(str(exc))}") from None
    raise ParamsRefused(f"{what}: the image declares {pixels} pixels, more than {max_pixels}")


def decode_image(value: Any, *, max_pixels: int, what: str = "init_image") -> Image:
    """An RGB PIL image from base64 (PNG, JPEG or WebP) with or without a `data:` URL prefix,
    refused from its header when it declares more than `max_pixels` pixels."""
    return open_image(checked_image_bytes(value, max_pixels=max_pixels, what=what), max_pixels=max_pixels,
                      what=what)
