"""Images from outside (a job's init_image, a browser's frame), checked from their header before
any pixel is decoded: PNG, JPEG or WebP, at most `max_pixels`. docs/design/http.md, "Images from outside"."""
from __future__ import annotations

import base64
import binascii
import io
import sys
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")  # what the API and the worker accept
MIME_OF = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


class ImageRefused(ValueError):
    """The image is not one we accept; the message says why, in words a client can act on."""


@dataclass(frozen=True)
class ImageHeader:
    format: str  # one of FORMATS
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def mime(self) -> str:
        return MIME_OF[self.format]


def base64_body(text: str, *, max_bytes: int | None = None) -> str:
    """The base64 of an image given as bare base64 or a `data:image/...;base64,` URL, its length
    checked against `max_bytes` before anything is decoded."""
    if not isinstance(text, str) or not text:
        raise ImageRefused("the image must be a non-empty base64 string or data: URL")
    if text.startswith("data:"):
        head, comma, text = text.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ImageRefused("a data: URL image must be base64 (data:image/png;base64,...)")
    if max_bytes is not None and len(text) > (max_bytes * 4) // 3 + 4:
        raise ImageRefused(f"the image is over {max_bytes} bytes")
    return text


def image_bytes(text: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of an image given as bare base64 or a `data:image/...;base64,` URL."""
    body = base64_body(text, max_bytes=max_bytes)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the image is not valid base64") from None


def image_header(data: bytes, *, max_pixels: int) -> ImageHeader:
    """Read the header of `data`: its format and declared size, refusing anything but PNG, JPEG and
    WebP, and anything declaring more than `max_pixels` pixels. Nothing is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(FORMATS)) as image:
                header = ImageHeader(str(image.format), int(image.width), int(image.height))
    except Image.DecompressionBombError:
        raise ImageRefused(f"the image declares more than {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageRefused("the image must be a PNG, JPEG or WebP file") from None
    if header.format not in FORMATS:
        raise ImageRefused("the image must be a PNG, JPEG or WebP file")
    if header.width < 1 or header.height < 1:
        raise ImageRefused("the image declares no pixels")
    return image_header_checked(header, max_pixels=max_pixels)


def checked_image(text: str, *, max_pixels: int, max_bytes: int | None = None) -> tuple[bytes, ImageHeader]:
    """`image_bytes` then `image_header`: the bytes of an acceptable image and its header."""
    data = image_bytes(text, max_bytes=max_bytes)
    return data, image_header(data, max_pixels=max_pixels)


HEADER_PREFIXES = (4_096, 65_536)  # base64 characters tried before the whole: PNG's and WebP's sizes
# come in the first 30 bytes, JPEG's after its APP segments (EXIF is at most 64 KiB)


def header_of(text: str, *, max_pixels: int, max_bytes: int | None = None) -> ImageHeader:
    """`image_header` of a base64 image (or data: URL) read from a prefix of it: a browser frame of
    a megabyte is checked without decoding all of its base64 (1.3 ms on the event loop), only the
    few kilobytes its header sits in. The rest is decoded, and checked again, by the worker."""
    body = base64_body(text, max_bytes=max_bytes)
    for size in HEADER_PREFIXES:
        if len(body) <= size:
            break
        try:
            header = image_header(base64.b64decode(body[:size], validate=True), max_pixels=sys.maxsize)
        except (binascii.Error, ValueError):
            continue  # a header cut short, or odd base64 there: a longer prefix, then the whole, decide
        return image_header_checked(header, max_pixels=max_pixels)
    return image_header(image_bytes(body), max_pixels=max_pixels)


def image_header_checked(header: ImageHeader, *, max_pixels: int) -> ImageHeader:
    if header.pixels > max_pixels:
        raise ImageRefused(f"the image declares {header.width}x{header.height} pixels, more than {max_pixels}")
    return header
