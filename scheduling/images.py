"""A job's `init_image`: checked from its header at submission (PNG, JPEG or WebP, at most
MAX_IMAGE_PIXELS declared, nothing decoded), kept as submitted in the file storage (never in a row),
given back to the worker in its params, and shown to clients as a URL. docs/design/hot-path.md."""
from __future__ import annotations

import sys
import uuid
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from potocolom.protocol.images import ImageRefused, checked_image, image_bytes, image_header

INIT_IMAGE = "init_image"
PARAM_COLUMNS = ("steps", "width", "height")  # params the queue, ETA and placement queries read


def init_image_problem(params: dict[str, Any], *, max_pixels: int) -> str | None:
    """Why the params' init_image is refused, or None (also when there is none)."""
    if INIT_IMAGE not in params:
        return None
    try:
        checked_image(params[INIT_IMAGE], max_pixels=max_pixels)
    except ImageRefused as exc:
        return str(exc)
    return None


def param_columns(params: dict[str, Any]) -> dict[str, int | None]:
    """The job's `steps`, `width` and `height` as its row's columns (None: not a positive integer
    under 2**31, which leaves the model's default)."""
    return {name: value if isinstance(value := params.get(name), int) and not isinstance(value, bool)
            and 0 < value < 2**31 else None for name in PARAM_COLUMNS}


def init_image_store(job_id: uuid.UUID | str, value: str) -> str:
    """Keep a submitted init_image (its text as sent) in the storage; its storage name."""
    return default_storage.save(f"jobs/{job_id}/init_image.txt", ContentFile(value.encode("utf-8")))


def init_image_text(name: str) -> str | None:
    """A stored init_image's text as it was sent, or None when the job has none. OSError when the
    storage cannot give it."""
    if not name:
        return None
    with default_storage.open(name, "rb") as stored:
        return stored.read().decode("utf-8")


def init_image_content(name: str) -> tuple[bytes, str] | None:
    """The bytes of a stored init_image and their media type, or None when the job has none (or
    its file is gone). It was checked at submission; a MAX_IMAGE_PIXELS lowered since does not hide
    it from its owner."""
    try:
        value = init_image_text(name)
    except OSError:
        return None
    if value is None:
        return None
    try:
        data = image_bytes(value)
        return data, image_header(data, max_pixels=sys.maxsize).mime
    except ImageRefused:
        return None
