"""A job's `init_image`: checked from its header at submission (PNG, JPEG or WebP, at most
MAX_IMAGE_PIXELS declared, nothing decoded), kept in the job's params as submitted (the worker
gets it so), and never part of the job's representation: a page of jobs would carry megabytes."""
from __future__ import annotations

import sys
from typing import Any

from django.db import models
from django.db.models.expressions import Func

from potocolom.protocol.images import ImageRefused, checked_image, image_bytes, image_header

INIT_IMAGE = "init_image"


def init_image_problem(params: dict[str, Any], *, max_pixels: int) -> str | None:
    """Why the params' init_image is refused, or None (also when there is none)."""
    if INIT_IMAGE not in params:
        return None
    try:
        checked_image(params[INIT_IMAGE], max_pixels=max_pixels)
    except ImageRefused as exc:
        return str(exc)
    return None


def init_image_content(params: dict[str, Any]) -> tuple[bytes, str] | None:
    """The bytes of a stored init_image and their media type, or None when the job has none.
    It was checked at submission; a MAX_IMAGE_PIXELS lowered since does not hide it from its owner."""
    value = params.get(INIT_IMAGE)
    if value is None:
        return None
    try:
        data = image_bytes(value)
        return data, image_header(data, max_pixels=sys.maxsize).mime
    except ImageRefused:
        return None


class ParamsWithoutImage(Func):
    """A job's params without init_image, computed by the database, so listing jobs never loads
    their images (as `shown_params`; whether there was one as `has_init_image`)."""

    output_field = models.JSONField()

    def __init__(self, field: str = "params") -> None:
        super().__init__(models.F(field))

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:  # jsonb minus a key
        return super().as_sql(compiler, connection, template=f"(%(expressions)s - '{INIT_IMAGE}')", **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return super().as_sql(compiler, connection, template=f"json_remove(%(expressions)s, '$.{INIT_IMAGE}')",
                              **extra)
