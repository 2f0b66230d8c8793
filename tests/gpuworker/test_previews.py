"""Job previews (docs/protocol.md, "Previews" under "Worker → API"): the per-family latent map
and, against an in-process fake API, the previews a real job on the tiny model sends in job_progress."""
from __future__ import annotations

import base64
import io
import logging
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from gpuworker.previews import MAPS, MAX_SIDE, PreviewRefused, latents_to_rgb, preview_b64, preview_size
from gpuworker.step_hooks import StepHooks
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import run_async
from tests.gpuworker.test_worker import make_worker, running

JOB = {"prompt": "a small red circle", "width": 128, "height": 64, "steps": 5, "seed": 3}
CHANNELS = {"sd": 4, "sdxl": 4, "sd3": 16}


def jpeg_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64, validate=True))) as image:
        assert image.format == "JPEG"
        image.load()  # the whole file decodes, not only its header
        return image.size


@pytest.mark.parametrize("family", sorted(CHANNELS))
@pytest.mark.parametrize(("height", "width", "expected"), [
    (64, 64, (64, 64)),  # SD 1.5 at 512x512: the latent's own size
    (128, 128, (128, 128)),  # SDXL at 1024x1024
    (96, 160, (160, 96)),  # wide: aspect kept
    (512, 256, (128, 256)),  # larger than the cap: scaled down to 256 on the long side
    (300, 1000, (256, 77)),
])
def test_each_family_map_gives_a_jpeg_at_most_256_px_long_with_its_aspect(
        family: str, height: int, width: int, expected: tuple[int, int]) -> None:
    latents = torch.randn(1, CHANNELS[family], height, width, generator=torch.Generator().manual_seed(1))
    size = jpeg_size(preview_b64(latents, family))
    assert size == expected and max(size) <= MAX_SIDE
    assert MAPS[family].channels == CHANNELS[family]


def test_without_a_family_the_channel_count_picks_the_map() -> None:
    sd3 = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    assert np.array_equal(latents_to_rgb(sd3), latents_to_rgb(sd3, "sd3"))
    sd = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    assert np.array_equal(latents_to_rgb(sd), latents_to_rgb(sd, "sd"))


def test_the_map_is_the_published_linear_one_with_its_bias() -> None:
    # Zero latents give the bias; one channel at 1 adds that channel's RGB factors (in [-1, 1] -> 0..255).
    zero = np.zeros((4, 2, 3), dtype=np.float32)
    assert (latents_to_rgb(zero, "sd") == 128).all()  # no bias published for SD 1.x: mid grey
    assert latents_to_rgb(zero, "sdxl")[0, 0].tolist() == [141, 125, 127]  # SDXL's bias 0.1084, -0.0175, -0.0011
    one = zero.copy()
    one[3] = 1.0  # SD's fourth channel: -0.2120, -0.2616, -0.7177
    assert latents_to_rgb(one, "sd")[0, 0].tolist() == [100, 94, 36]
    assert latents_to_rgb(zero, "sd").shape == (2, 3, 3)  # C x H x W is taken as one image


@pytest.mark.parametrize(("latents", "family"), [
    (torch.zeros(1, 16, 8, 8), "sd"),  # SD has 4 channels
    (torch.zeros(1, 4, 8, 8), "sd3"),
    (torch.zeros(1, 16, 8, 8), "flux"),  # no map (its latents are packed in diffusers)
    (torch.zeros(4, 8), "sd"),
])
def test_latents_that_do_not_fit_a_map_are_refused(latents: Any, family: str) -> None:
    with pytest.raises(PreviewRefused):
        preview_b64(latents, family)


def test_preview_size_keeps_the_aspect_and_at_least_one_pixel() -> None:
    assert preview_size(4096, 8) == (256, 1)
    with pytest.raises(PreviewRefused):
        preview_size(0, 8)


def progress_of(fake: FakeApi, job_id: str) -> list[dict[str, Any]]:
    return [m for m in fake.about(job_id) if m["type"] == "job_progress"]


def test_a_job_sends_a_preview_at_most_every_preview_steps_as_a_jpeg(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, preview_steps=2) as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                job_id = await fake.job(JOB)
                await fake.next_message("job_result", job_id=job_id)

            progress = progress_of(fake, job_id)
            assert [m["step"] for m in progress] == [1, 2, 3, 4, 5]
            assert [m["step"] for m in progress if "preview" in m] == [2, 4]
            scale = tiny_pipeline.pipe.vae_scale_factor  # the latent is the image over the VAE's scale
            for message in progress:
                if "preview" in message:
                    assert jpeg_size(message["preview"]) == (JOB["width"] // scale, JOB["height"] // scale)

    run_async(body())


@pytest.mark.parametrize(("protocol", "preview_steps"), [(2, 0), (None, 2)])
def test_no_previews_with_preview_steps_0_or_a_v1_welcome(tiny_pipeline: Any, protocol: int | None,
                                                           preview_steps: int) -> None:
    async def body() -> None:
        # The v1 case: preview_steps in a welcome without `protocol` means nothing (a v1 API has no previews).
        async with FakeApi(protocol=protocol, preview_steps=preview_steps) as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                job_id = await fake.job({**JOB, "steps": 2})
                await fake.next_message("job_result", job_id=job_id)

            progress = progress_of(fake, job_id)
            assert [m["step"] for m in progress] == [1, 2]
            assert not any("preview" in m for m in progress)

    run_async(body())


class OddLatents:
    """The real pipeline, whose preview hook is handed latents of no family's shape (3 channels):
    every preview of them fails."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.rung = inner.rung
        self.seen = 0

    def generate(self, params: Any, *, hooks: StepHooks | None = None, resume: Any = None) -> Any:
        hooks = hooks or StepHooks()
        preview = hooks.preview

        def odd(step: int, steps: int, latents: Any) -> str | None:
            assert preview is not None
            self.seen += 1
            return preview(step, steps, latents[:, :3])

        return self.inner.generate(params, hooks=replace(hooks, preview=odd if preview is not None else None),
                                   resume=resume)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_failing_preview_is_logged_once_and_the_job_goes_on_without_previews(
        tiny_pipeline: Any, caplog: pytest.LogCaptureFixture) -> None:
    odd = OddLatents(tiny_pipeline)

    async def body() -> None:
        async with FakeApi(protocol=2, preview_steps=1) as fake:
            async with running(make_worker(fake, {"tiny-sd": odd})):
                await fake.next_message("hello")
                job_id = await fake.job({**JOB, "steps": 3})
                result = await fake.next_message("job_result", job_id=job_id)

            assert result["images"]
            progress = progress_of(fake, job_id)
            assert [m["step"] for m in progress] == [1, 2, 3]
            assert not any("preview" in m for m in progress)

    with caplog.at_level(logging.WARNING, logger="gpuworker.previews"):
        run_async(body())
    failures = [r for r in caplog.records if r.name == "gpuworker.previews"]
    assert len(failures) == 1 and "without previews" in failures[0].getMessage()
    assert failures[0].exc_info is not None and failures[0].exc_info[0] is PreviewRefused
    assert odd.seen == 3  # the hook went on being called; the previews stopped after the first failure


@pytest.mark.parametrize(("family", "channels"), [("sdxl", 4), ("sd3", 16)])
def test_the_tiny_sdxl_and_sd3_models_latents_preview_by_their_own_family(
        tmp_path: Any, family: str, channels: int) -> None:
    from gpuworker.installed import discover_models
    from gpuworker.pipelines import DiffusersPipeline
    from gpuworker.previews import JobPreviews, family_of_pipeline
    from gpuworker.tiny import make_tiny_model

    make_tiny_model(tmp_path / "model", family=family)
    (model,) = discover_models(tmp_path)
    pipeline = DiffusersPipeline.load(model, "cpu")
    assert family_of_pipeline(pipeline) == family
    previews = JobPreviews(1, pipeline, job_id="a-job")
    shapes: list[tuple[int, ...]] = []
    sizes: list[tuple[int, int]] = []

    def see(step: int, steps: int, latents: Any) -> str | None:
        shapes.append(tuple(latents.shape))
        preview = previews.preview(step, steps, latents)
        assert preview is not None
        sizes.append(jpeg_size(preview))
        return preview

    pipeline.generate({"prompt": "a small red circle", "width": 64, "height": 64, "steps": 2, "seed": 3},
                      hooks=StepHooks(preview=see))
    scale = pipeline.pipe.vae_scale_factor
    assert [shape[1] for shape in shapes] == [channels, channels]
    assert sizes == [(64 // scale, 64 // scale)] * 2
