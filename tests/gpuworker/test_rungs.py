"""The memory rungs on CPU with the real tiny pipeline: same pixels on every rung, footprints
measured from the modules, a clean reload between rungs, and the ladder applied at load."""
from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuworker.footprints import block_groups, pipeline_footprint, safetensors_bytes
from gpuworker.installed import ModelOnDisk, discover_models
from gpuworker.ladder import MIB
from gpuworker.loading import load_pipelines
from gpuworker.pipelines import DiffusersPipeline, FrameRequest
from gpuworker.vram import VramBudget
from gpuworker.weights import read_modules
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD, RUNG_MODEL_OFFLOAD
from tests.gpuworker.test_pipelines import png_data_url

TXT2IMG = {"prompt": "a small red circle", "width": 64, "height": 64, "steps": 2, "seed": 11}
IMG2IMG = {"prompt": "a blue square", "init_image": png_data_url(64, 64, (10, 20, 200)), "width": 64, "height": 64,
           "steps": 4, "strength": 0.5, "seed": 12}


def pixels(pipeline: Any, params: dict[str, Any]) -> list[np.ndarray]:
    return [np.asarray(image) for image in pipeline.generate(params)]


def frame_pixels(pipeline: Any) -> list[np.ndarray]:
    from PIL import Image

    image = Image.new("RGB", (64, 64), (90, 30, 160))
    request = FrameRequest(prompts=["a", "b"], images=[image, image], seeds=[1, 2], width=64, height=64, steps=2,
                           guidance_scale=7.5, strength=1.0)
    return [np.asarray(out) for out in pipeline.generate_frames(request)]


@pytest.fixture(scope="module")
def tiny_model(models_dir: Path) -> ModelOnDisk:
    (model,) = discover_models(models_dir)
    return model


@pytest.fixture(scope="module")
def full_pixels(tiny_pipeline: DiffusersPipeline) -> dict[str, list[np.ndarray]]:
    return {"txt2img": pixels(tiny_pipeline, TXT2IMG), "img2img": pixels(tiny_pipeline, IMG2IMG),
            "frames": frame_pixels(tiny_pipeline)}


@pytest.mark.parametrize(("rung", "on_disk"), [(RUNG_MODEL_OFFLOAD, False), (RUNG_GROUP_OFFLOAD, False),
                                               (RUNG_GROUP_OFFLOAD, True)])
def test_every_rung_gives_the_pixels_of_full_residency(tiny_model: ModelOnDisk, full_pixels: dict[str, Any],
                                                       rung: str, on_disk: bool, tmp_path: Path) -> None:
    offload_dir = str(tmp_path / "groups") if on_disk else None
    pipeline = DiffusersPipeline.load(tiny_model, "cpu", rung, offload_dir=offload_dir)

    assert pipeline.rung == rung
    for name, params in (("txt2img", TXT2IMG), ("img2img", IMG2IMG), ("txt2img", TXT2IMG)):  # twice: hooks reset
        assert all(np.array_equal(a, b) for a, b in zip(pixels(pipeline, params), full_pixels[name], strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(frame_pixels(pipeline), full_pixels["frames"], strict=True))
    if on_disk:
        assert sorted(p.suffix for p in (tmp_path / "groups").iterdir()) == [".safetensors"] * len(
            list((tmp_path / "groups").iterdir())) != []


@pytest.mark.parametrize("rung", [RUNG_FULL, RUNG_MODEL_OFFLOAD, RUNG_GROUP_OFFLOAD])
def test_a_job_stopped_at_a_step_boundary_leaves_the_rung_whole(tiny_model: ModelOnDisk,
                                                                 full_pixels: dict[str, Any], rung: str) -> None:
    from gpuworker.step_hooks import JobCancelled, StepHooks

    pipeline = DiffusersPipeline.load(tiny_model, "cpu", rung)
    steps: list[int] = []
    decodes: list[int] = []
    handle = pipeline.pipe.vae.decoder.register_forward_pre_hook(lambda module, args: decodes.append(1))
    try:
        with pytest.raises(JobCancelled):
            pipeline.generate({**TXT2IMG, "steps": 20}, hooks=StepHooks(
                progress=lambda step, total, preview: steps.append(step), cancelled=lambda: len(steps) >= 2))
        assert steps == [1, 2] and decodes == []  # left after step 2 of 20, nothing decoded
        # The hooks were put back as a finished call leaves them: the next job is as on full.
        assert all(np.array_equal(a, b) for a, b in zip(pixels(pipeline, TXT2IMG), full_pixels["txt2img"],
                                                        strict=True))
        assert decodes == [1]
    finally:
        handle.remove()


def test_the_footprint_is_measured_from_the_loaded_modules(tiny_model: ModelOnDisk, models_dir: Path) -> None:
    modules = read_modules(tiny_model, "cpu")
    footprint = pipeline_footprint(tiny_model.model_id, modules.pipe, tiny_model.params_schema)
    pipe = modules.pipe

    # The safetensors headers hold the same bytes, less non-persistent buffers (CLIP's position ids).
    assert 0 <= footprint.weights_bytes - safetensors_bytes(models_dir / "tiny") < 4096
    by_name = {c.name: c for c in footprint.components}
    assert set(by_name) == {"unet", "vae", "text_encoder"}
    assert by_name["unet"].weights_bytes == sum(p.numel() * 4 for p in pipe.unet.parameters()) + sum(
        b.numel() * b.element_size() for b in pipe.unet.buffers())
    assert footprint.largest_component_bytes == by_name["unet"].weights_bytes
    # Working memory of the largest size the manifest allows (512), float32 on CPU, beyond the floor.
    assert footprint.working_bytes > 64 * MIB + 512 * 512 * 32 * 4


def test_block_groups_are_the_groups_diffusers_makes(tiny_model: ModelOnDisk) -> None:
    modules = read_modules(tiny_model, "cpu")
    expected = {name: block_groups(module) for name, module in modules.pipe.components.items()
                if hasattr(module, "parameters")}
    modules.pipe.enable_group_offload(onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)

    for name, (top_level, groups) in expected.items():
        made: dict[int, Any] = {}
        for module in modules.pipe.components[name].modules():
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook("group_offloading") if registry is not None else None
            if hook is not None:
                made[id(hook.group)] = hook.group

        def size(group: Any) -> int:  # a group's modules' tensors and its loose ones, each once
            tensors = [t for m in group.modules for t in [*m.parameters(), *m.buffers()]]
            unique = {id(t): t for t in [*tensors, *group.parameters, *group.buffers]}
            return sum(t.numel() * t.element_size() for t in unique.values())

        def is_block(group: Any) -> bool:  # a block group's leader is its last block; the rest's, their parent
            return any(group.offload_leader is m for m in group.modules)

        unmatched = [g for g in made.values() if not is_block(g)]
        blocks = [g for g in made.values() if is_block(g)]
        assert sorted(size(g) for g in blocks) == sorted(groups), name
        assert sum(size(g) for g in unmatched) == top_level, name


def test_moving_down_frees_the_old_modules_and_reloads_on_the_new_rung(
        tiny_model: ModelOnDisk, full_pixels: dict[str, Any]) -> None:
    pipeline = DiffusersPipeline.load(tiny_model, "cpu")
    old_unet = weakref.ref(pipeline.pipe.unet)

    pipeline.move_to(RUNG_MODEL_OFFLOAD)
    gc.collect()

    assert old_unet() is None  # memory given back: nothing holds the full-rung modules
    assert pipeline.rung == RUNG_MODEL_OFFLOAD and pipeline.pipe.unet is not None
    assert all(np.array_equal(a, b) for a, b in zip(pixels(pipeline, TXT2IMG), full_pixels["txt2img"], strict=True))

    pipeline.move_to(RUNG_GROUP_OFFLOAD)

    assert pipeline.rung == RUNG_GROUP_OFFLOAD
    assert all(np.array_equal(a, b) for a, b in zip(pixels(pipeline, IMG2IMG), full_pixels["img2img"], strict=True))


def tiny_twin(model: ModelOnDisk, model_id: str) -> ModelOnDisk:
    return replace(model, model_id=model_id)


def test_at_load_a_budget_keeps_the_first_model_resident_and_offloads_the_next(
        tiny_model: ModelOnDisk, caplog: pytest.LogCaptureFixture) -> None:
    modules = read_modules(tiny_model, "cpu")
    footprint = pipeline_footprint(tiny_model.model_id, modules.pipe, tiny_model.params_schema)
    # Room for one resident copy and, beside it, the other one offloaded; not for two resident.
    budget_mib = (footprint.weights_bytes + footprint.needs(RUNG_MODEL_OFFLOAD)) // MIB + 1
    assert budget_mib * MIB < 2 * footprint.weights_bytes + footprint.working_bytes
    models = [tiny_twin(tiny_model, "tiny-a"), tiny_twin(tiny_model, "tiny-b")]
    budget = VramBudget("cpu", budget_mib)

    with caplog.at_level(logging.INFO, logger="gpuworker.loading"):
        loaded = load_pipelines(models, "cpu", budget=budget)

    assert {m: p.rung for m, p in loaded.pipelines.items()} == {"tiny-a": RUNG_FULL, "tiny-b": RUNG_MODEL_OFFLOAD}
    assert budget.held_bytes == footprint.weights_bytes
    assert budget.gpu_info() == {"name": "cpu (pretend VRAM from --vram-mib)", "total_mib": budget_mib,
                                 "free_mib": (budget_mib * MIB - footprint.weights_bytes) // MIB}
    assert "model tiny-b on cpu: rung model_offload:" in caplog.text and "full needs" in caplog.text


def test_a_model_that_fits_on_no_rung_is_not_served_and_the_log_says_why(
        tiny_model: ModelOnDisk, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gpuworker.loading"):
        loaded = load_pipelines([tiny_model], "cpu", budget=VramBudget("cpu", 8))

    assert loaded.pipelines == {}
    assert loaded.refused["tiny-sd"].startswith("fits on no rung: 8 MiB free; full needs")
    assert "model tiny-sd is not served: it fits on no rung" in caplog.text


@pytest.mark.parametrize("mode", [RUNG_FULL, RUNG_MODEL_OFFLOAD, RUNG_GROUP_OFFLOAD])
def test_a_pinned_mode_places_every_model_on_its_rung_or_not_at_all(tiny_model: ModelOnDisk, mode: str) -> None:
    roomy = load_pipelines([tiny_model], "cpu", mode=mode, budget=VramBudget("cpu", 10_000))
    unbudgeted = load_pipelines([tiny_model], "cpu", mode=mode)
    short = load_pipelines([tiny_model], "cpu", mode=mode, budget=VramBudget("cpu", 100))

    assert roomy.pipelines["tiny-sd"].rung == unbudgeted.pipelines["tiny-sd"].rung == mode
    assert short.pipelines == {} and "pinned by MEMORY_MODE" in short.refused["tiny-sd"]


def test_without_cuda_or_a_budget_every_model_runs_as_on_full_residency(tiny_model: ModelOnDisk) -> None:
    budget = VramBudget("cpu")
    loaded = load_pipelines([tiny_model, tiny_twin(tiny_model, "tiny-b")], "cpu", budget=budget)

    assert [p.rung for p in loaded.pipelines.values()] == [RUNG_FULL, RUNG_FULL]
    assert budget.free_bytes() is None and budget.gpu_info() is None
    assert loaded.choices["tiny-b"].reason.startswith("rung full: no VRAM figure")
