"""The diffusers adapter: seeded jobs equal the direct diffusers call, sizes, checks, progress, interrupt."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuworker.inputs import ParamsRefused
from gpuworker.installed import ModelOnDisk
from gpuworker.pipelines import DiffusersPipeline
from gpuworker.step_hooks import JobCancelled, StepHooks


def png_data_url(width: int, height: int, rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_it_gives_the_pixels_of_the_direct_diffusers_call_for_a_seeded_job(
        tiny_pipeline: DiffusersPipeline, models_dir: Path) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    params = {"prompt": "a small red circle", "width": 64, "height": 128, "steps": 3, "seed": 1234,
              "guidance_scale": 6.0}
    (ours,) = tiny_pipeline.generate(params)

    direct = StableDiffusionPipeline.from_pretrained(models_dir / "tiny")
    direct.set_progress_bar_config(disable=True)
    (expected,) = direct(prompt="a small red circle", height=128, width=64, num_inference_steps=3,
                         guidance_scale=6.0, generator=torch.Generator("cpu").manual_seed(1234)).images

    assert ours.size == (64, 128)
    assert np.array_equal(np.asarray(ours), np.asarray(expected))


def test_it_uses_the_documented_defaults(tiny_pipeline: DiffusersPipeline) -> None:
    request = tiny_pipeline.check_inputs({"prompt": "x"})

    assert (request.width, request.height) == (tiny_pipeline.default_size, tiny_pipeline.default_size)
    assert (request.steps, request.guidance_scale, request.negative_prompt) == (20, 7.5, None)
    assert request.init_image is None
    assert 0 <= request.seed <= 2**32 - 1


def test_it_returns_img2img_images_of_exactly_the_requested_size(tiny_pipeline: DiffusersPipeline) -> None:
    steps_seen: list[tuple[int, int]] = []
    params = {"prompt": "a blue square", "init_image": png_data_url(40, 24, (10, 20, 200)),
              "width": 64, "height": 128, "steps": 4, "strength": 0.5, "seed": 7}

    images = tiny_pipeline.generate(params, hooks=StepHooks(
        progress=lambda step, steps, preview: steps_seen.append((step, steps))))

    assert [image.size for image in images] == [(64, 128)]
    assert steps_seen == [(1, 2), (2, 2)]  # img2img runs int(steps x strength) steps


def test_it_takes_an_init_image_as_bare_base64_too(tiny_pipeline: DiffusersPipeline) -> None:
    bare = png_data_url(64, 64, (0, 200, 0)).partition(",")[2]

    request = tiny_pipeline.check_inputs({"prompt": "p", "init_image": bare, "width": 128, "height": 64})

    assert request.init_image is not None and request.init_image.size == (128, 64)


def test_it_reports_each_step_and_stops_when_asked(tiny_pipeline: DiffusersPipeline) -> None:
    steps_seen: list[tuple[int, int]] = []

    with pytest.raises(JobCancelled):
        tiny_pipeline.generate({"prompt": "p", "steps": 5, "seed": 1}, hooks=StepHooks(
            progress=lambda step, steps, preview: steps_seen.append((step, steps)),
            cancelled=lambda: len(steps_seen) >= 2))

    assert steps_seen == [(1, 5), (2, 5)]  # interrupted after step 2: no more steps ran


@pytest.mark.parametrize(("params", "message"), [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "p", "width": 100}, "width"),
    ({"prompt": "p", "height": "64"}, "height"),
    ({"prompt": "p", "steps": 0}, "steps"),
    ({"prompt": "p", "steps": 51}, "steps"),
    ({"prompt": "p", "seed": -1}, "seed"),
    ({"prompt": "p", "seed": 2**32}, "seed"),
    ({"prompt": "p", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "p", "strength": 1.5}, "strength"),
    ({"prompt": "p", "colour": "red"}, "colour"),
    ({"prompt": "p", "init_image": "not base64!"}, "init_image"),
    ({"prompt": "p", "init_image": base64.b64encode(b"not an image").decode()}, "init_image"),
    ({"prompt": "p", "init_image": png_data_url(8, 8, (1, 2, 3)), "steps": 1, "strength": 0.5}, "strength"),
    (["prompt"], "JSON object"),
])
def test_it_rejects_bad_params(tiny_pipeline: DiffusersPipeline, params: Any, message: str) -> None:
    with pytest.raises(ParamsRefused, match=message):
        tiny_pipeline.check_inputs(params)


@pytest.mark.parametrize(("params", "message"), [
    ({"prompt": "p", "width": 100}, "multiple of 8"),
    ({"prompt": "p", "steps": True}, "steps must be an integer"),
    ({"prompt": None}, "prompt must be a string"),
    ({"prompt": "p", "init_image": 5}, "init_image must be a base64 string"),
])
def test_it_rejects_what_the_pipeline_cannot_run_even_when_the_schema_allows_it(
        tiny_pipeline: DiffusersPipeline, params: Any, message: str) -> None:
    permissive = ModelOnDisk(model_id="open", pipeline="StableDiffusionPipeline", source="x",
                                manifest_path=Path("x"), capabilities=("txt2img", "img2img"))
    adapter = DiffusersPipeline(permissive, tiny_pipeline.pipe, tiny_pipeline.img2img, "cpu", "full")

    with pytest.raises(ParamsRefused, match=message):
        adapter.check_inputs(params)


def test_it_refuses_img2img_for_a_model_without_it(tiny_pipeline: DiffusersPipeline) -> None:
    txt2img_only = ModelOnDisk(model_id="t", pipeline="StableDiffusionPipeline", source="x",
                                  manifest_path=Path("x"), capabilities=("txt2img",))
    adapter = DiffusersPipeline(txt2img_only, tiny_pipeline.pipe, None, "cpu", "full")

    with pytest.raises(ParamsRefused, match="does not do img2img"):
        adapter.check_inputs({"prompt": "p", "init_image": png_data_url(8, 8, (1, 2, 3))})


def test_it_loads_on_rung_full(tiny_pipeline: DiffusersPipeline) -> None:
    assert tiny_pipeline.rung == "full"
    assert tiny_pipeline.pipe.device.type == "cpu"
    assert type(tiny_pipeline.img2img).__name__ == "StableDiffusionImg2ImgPipeline"
