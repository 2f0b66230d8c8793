"""Images from outside are checked from their header: format allow-list and a pixel cap."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from potocolom.protocol.images import ImageRefused, checked_image, header_of, image_bytes, image_header


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


def noisy(fmt: str, size: tuple[int, int] = (512, 512), **save: object) -> str:
    """A frame as a browser sends it: an image of noise, a few hundred kilobytes of base64."""
    import random

    rng = random.Random(7)
    image = Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_frames_header_is_read_from_the_start_of_its_base64(fmt: str) -> None:
    text = noisy(fmt)
    assert len(text) > 65_536  # the whole is never decoded for this
    assert header_of(text, max_pixels=512 * 512) == image_header(base64.b64decode(text), max_pixels=512 * 512)
    with pytest.raises(ImageRefused, match="512x512"):
        header_of(text, max_pixels=512 * 511)


def test_a_jpeg_whose_header_sits_past_a_large_exif_block_is_still_read() -> None:
    exif = Image.Exif()
    exif[0x010E] = "x" * 20_000  # ImageDescription: 20 kB of APP1 before the frame header
    text = noisy("JPEG", (256, 256), exif=exif.tobytes())
    assert header_of(text, max_pixels=256 * 256).format == "JPEG"


def test_a_frame_that_is_no_image_is_refused_whatever_its_length() -> None:
    text = base64.b64encode(b"GIF89a" + bytes(100_000)).decode()
    with pytest.raises(ImageRefused, match="PNG, JPEG or WebP"):
        header_of(text, max_pixels=4_194_304)
    with pytest.raises(ImageRefused):
        header_of(base64.b64encode(png_declaring(60_000, 60_000)).decode(), max_pixels=4_194_304)
