"""Images from outside, on the worker: PNG, JPEG or WebP only, and at most MAX_IMAGE_PIXELS declared,
checked from the header before anything decodes. A bad job image fails its job; a bad frame is
dropped on the event loop, and the denoising thread and the other sessions never notice."""
from __future__ import annotations

import base64
import io
import logging
from typing import Any

import pytest

from gpuworker.inputs import ParamsRefused, decode_image
from gpuworker.limits import Limits
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import GatedPipeline, run_async
from tests.gpuworker.test_sessions import BLUE, RED, TWO_SLOTS, park_in_a_job
from tests.gpuworker.test_worker import SMALL_JOB, make_worker, running
from tests.potocolom.protocol.test_images import png_declaring

BOMB = base64.b64encode(png_declaring(60_000, 60_000)).decode()  # 3.6 gigapixels in a few dozen bytes


def encoded(fmt: str, size: tuple[int, int] = (64, 64)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_it_decodes_the_three_formats_with_or_without_a_data_url(fmt: str) -> None:
    image = decode_image(encoded(fmt), max_pixels=64 * 64)
    assert (image.size, image.mode) == ((64, 64), "RGB")
    assert decode_image(f"data:image/{fmt.lower()};base64,{encoded(fmt)}", max_pixels=64 * 64).size == (64, 64)


@pytest.mark.parametrize(("value", "error"), [
    (BOMB, "init_image: the image declares more than 4096 pixels"),
    (encoded("GIF"), "init_image: the image must be a PNG, JPEG or WebP file"),
    (encoded("BMP"), "init_image: the image must be a PNG, JPEG or WebP file"),
    (encoded("PNG", (65, 64)), "more than 4096"),
    ("not base64!", "init_image: the image is not valid base64"),
    (3, "init_image must be a base64 string"),
])
def test_it_refuses_images_it_would_not_decode(value: Any, error: str) -> None:
    with pytest.raises(ParamsRefused, match=error):
        decode_image(value, max_pixels=4096)


def test_a_job_whose_init_image_is_a_bomb_fails_with_a_clear_error(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                bomb_job = await fake.job({**SMALL_JOB, "init_image": BOMB, "strength": 1.0})
                gif_job = await fake.job({**SMALL_JOB, "init_image": encoded("GIF"), "strength": 1.0})
                good_job = await fake.job({**SMALL_JOB, "init_image": encoded("WEBP"), "strength": 1.0})
                bomb = await fake.next_message("job_failed", job_id=bomb_job)
                gif = await fake.next_message("job_failed", job_id=gif_job)
                await fake.next_message("job_result", job_id=good_job)

            assert bomb["error"] == "init_image: the image declares more than 4194304 pixels"
            assert gif["error"] == "init_image: the image must be a PNG, JPEG or WebP file"

    run_async(body())


def test_a_bomb_frame_is_dropped_without_holding_up_other_sessions(gated_pipeline: GatedPipeline,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": gated_pipeline}, realtime=TWO_SLOTS)):
                await fake.next_message("hello")
                for session_id in ("s-1", "s-2"):
                    assert (await fake.session_start(session_id))["type"] == "session_accepted"
                job_id = await park_in_a_job(fake, gated_pipeline)  # the denoising thread is busy in a job's step
                await fake.frame("s-1", 1, BOMB)
                await fake.frame("s-2", 1, RED)
                await fake.barrier()
                # Refused already, while the denoising thread is still parked: it never saw the bomb.
                assert "session s-1: frame 1 dropped: frame image: the image declares more than" in caplog.text
                gated_pipeline.gate.set()
                other = await fake.next_message("frame_result", session_id="s-2", seq=1)
                await fake.frame("s-1", 2, BLUE)  # the same session's next good frame runs
                mine = await fake.next_message("frame_result", session_id="s-1", seq=2)
                await fake.next_message("job_result", job_id=job_id)

            assert other["image"] and mine["image"]
            assert [m["seq"] for m in fake.frames_of("s-1")] == [2]

    with caplog.at_level(logging.WARNING, logger="gpuworker.sessions"):
        run_async(body())


def test_max_image_pixels_from_the_environment_caps_frames(gated_pipeline: GatedPipeline,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline}, realtime=TWO_SLOTS,
                                 limits=Limits.from_env({"MAX_IMAGE_PIXELS": "1000"}))
            async with running(worker):
                await fake.next_message("hello")
                assert (await fake.session_start("s-1"))["type"] == "session_accepted"
                gated_pipeline.gate.set()
                await fake.frame("s-1", 1, RED)  # 64 x 64 = 4096 pixels: over this worker's cap
                await fake.barrier()
                job_id = await fake.job(SMALL_JOB)
                await fake.next_message("job_result", job_id=job_id)

            assert fake.frames_of("s-1") == []
            assert "frame 1 dropped: frame image: the image declares 64x64 pixels, more than 1000" in caplog.text

    with caplog.at_level(logging.WARNING, logger="gpuworker.sessions"):
        run_async(body())
