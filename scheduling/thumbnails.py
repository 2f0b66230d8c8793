"""Small JPEG copies of a job's images for the admin's job pages (docs/operations.md, "The admin"):
made on request from the stored PNG (or the init_image), never stored, bounded in size."""
from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

THUMBNAIL_MAX_PX = 512  # the largest long side a thumbnail may ask for
SOURCE_MAX_PIXELS = 64 * 1024 * 1024  # a stored image larger than this is not decoded for a thumbnail


class NotAnImage(ValueError):
    """The bytes are not an image Pillow can read, or one too large to decode for a thumbnail."""


def thumbnail(data: bytes, *, size: int) -> bytes:
    """`data` (PNG, JPEG or WebP) scaled down to at most `size` px on its long side, as JPEG (an image
    already that small keeps its size); transparency is flattened onto white."""
    if not 1 <= size <= THUMBNAIL_MAX_PX:
        raise ValueError(f"size must be 1..{THUMBNAIL_MAX_PX}, not {size}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > SOURCE_MAX_PIXELS:
                raise NotAnImage(f"{image.width}x{image.height} is too large to decode for a thumbnail")
            image.draft("RGB", (size, size))  # JPEG: decode at a reduced scale straight away
            image.thumbnail((size, size))
            small = image.convert("RGBA")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise NotAnImage(str(exc)) from exc
    flat = Image.new("RGB", small.size, "white")
    flat.paste(small, mask=small.getchannel("A"))
    out = io.BytesIO()
    flat.save(out, format="JPEG", quality=85)
    return out.getvalue()
