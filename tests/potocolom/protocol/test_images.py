"""Images from outside are checked from their header: format allow-list and a pixel cap."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from potocolom.protocol.images import ImageRefused, checked_image, image_bytes, image_header


def encoded(fmt: str, size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares `width` x `height` (a decompression bomb's shape)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_the_three_formats_are_read_from_their_header(fmt: str, mime: str) -> None:
    header = image_header(encoded(fmt), max_pixels=100)
    assert (header.format, header.width, header.height, header.mime) == (fmt, 8, 6, mime)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_other_formats_are_refused(fmt: str) -> None:
    with pytest.raises(ImageRefused, match="PNG, JPEG or WebP"):
        image_header(encoded(fmt), max_pixels=100)


def test_bytes_that_are_no_image_are_refused() -> None:
    with pytest.raises(ImageRefused, match="PNG, JPEG or WebP"):
        image_header(b"<svg xmlns='http://www.w3.org/2000/svg'/>", max_pixels=100)


def test_a_bomb_is_refused_from_its_header() -> None:
    bomb = png_declaring(60_000, 60_000)  # 3.6 gigapixels in a few dozen bytes
    assert len(bomb) < 200
    with pytest.raises(ImageRefused, match="pixels"):
        image_header(bomb, max_pixels=4_194_304)


def test_the_cap_is_inclusive() -> None:
    assert image_header(png_declaring(2048, 2048), max_pixels=2048 * 2048).pixels == 2048 * 2048
    with pytest.raises(ImageRefused, match="2049x2048"):
        image_header(png_declaring(2049, 2048), max_pixels=2048 * 2048)


def test_base64_and_data_urls_give_the_same_bytes() -> None:
    data = encoded("PNG")
    bare = base64.b64encode(data).decode()
    assert image_bytes(bare) == data
    assert image_bytes("data:image/png;base64," + bare) == data
    assert checked_image(bare, max_pixels=100)[1].format == "PNG"


@pytest.mark.parametrize("text", ["", "not base64!", "data:image/png,rawbytes"])
def test_bad_encodings_are_refused(text: str) -> None:
    with pytest.raises(ImageRefused):
        image_bytes(text)


def test_an_oversized_text_is_refused_before_decoding() -> None:
    with pytest.raises(ImageRefused, match="over 10 bytes"):
        image_bytes("A" * 100, max_bytes=10)
