"""Model families on the worker (docs/protocol.md, "Model families"): the tiny SDXL and SD3 pipelines that
make_tiny_model writes run through the same paths as SD: jobs and img2img, every rung the CPU has,
realtime frames, checkpoints resumed to the uninterrupted pixels, and footprints read from files."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuworker.families import family_of
from gpuworker.footprints import block_groups, pipeline_footprint
from gpuworker.inputs import ParamsRefused
from gpuworker.installed import ModelOnDisk, discover_models
from gpuworker.jobs import encode_png_b64
from gpuworker.loading import load_pipelines, measure_step_ms, realtime_capacity
from gpuworker.main import WorkerOptions, build_worker
from gpuworker.models_on_demand import InstalledCatalog, needs_mib
from gpuworker.pipelines import DiffusersPipeline, FrameRequest
from gpuworker.step_hooks import StepHooks
from gpuworker.tiny import make_tiny_model, tiny_manifest
from potocolom.protocol.manifests import ManifestError, parse_manifest
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD, RUNG_MODEL_OFFLOAD, RUNGS
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import run_async
from tests.gpuworker.test_checkpoints import IMG2IMG, TXT2IMG, over_the_wire, pixels, preempted_at, same_pixels
from tests.gpuworker.test_worker import make_worker, running

FAMILIES = ("sdxl", "sd3")
DENOISER = {"sdxl": "unet", "sd3": "transformer"}
SHORT_TXT2IMG = {**TXT2IMG, "steps": 3}
SHORT_IMG2IMG = {**IMG2IMG, "steps": 4}  # strength 0.5: runs 2 steps


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelOnDisk]:
    """Each family's tiny model, written by make_tiny_model into a models dir of its own."""
    models = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"models-{family}")
        make_tiny_model(root / family, family)
        (models[family],) = discover_models(root)
    return models


@pytest.fixture(scope="module")
def full_pipelines(family_models: dict[str, ModelOnDisk]) -> dict[str, DiffusersPipeline]:
    return {family: DiffusersPipeline.load(model, "cpu") for family, model in family_models.items()}


def same_but_rounding(ours: list[Any], theirs: list[Any]) -> bool:
    """The same images but for float rounding: at most one level apart, in at most 0.1 % of the values.
    Offloaded modules may run other CPU kernels than resident ones, which sum in another order (on an
    AMD EPYC, SDXL img2img on model offload left 2 of 12,288 values one level off); a rung that
    changed the computation would differ far more."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(pixels(ours), pixels(theirs), strict=True):
        diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
        if a.shape != b.shape or diff.max() > 1 or np.count_nonzero(diff) > diff.size // 1000:
            return False
    return True


def frames(pipeline: DiffusersPipeline, count: int = 2) -> list[np.ndarray]:
    from PIL import Image

    image = Image.new("RGB", (64, 64), (90, 30, 160))
    request = FrameRequest(prompts=["a", "b", "c"][:count], images=[image] * count, seeds=[1, 2, 3][:count], width=64,
                           height=64, steps=2, guidance_scale=1.0, strength=1.0)
    return [np.asarray(out) for out in pipeline.generate_frames(request)]


@pytest.mark.parametrize("family", FAMILIES)
def test_make_tiny_model_writes_a_pipeline_of_the_family_with_its_manifest(
        family_models: dict[str, ModelOnDisk], full_pipelines: dict[str, DiffusersPipeline], family: str) -> None:
    model = family_models[family]
    written = json.loads(model.manifest_path.read_text())

    assert written == tiny_manifest(family) and model.model_id == f"tiny-{family}"
    assert model.pipeline == {"sdxl": "StableDiffusionXLPipeline", "sd3": "StableDiffusion3Pipeline"}[family]
    pipeline = full_pipelines[family]
    assert family_of(pipeline.pipe) == family_of(pipeline.img2img) == family_of(pipeline.frames) == family
    assert pipeline.default_size == 64
    if family == "sd3":  # no T5: diffusers encodes its part as zeros
        assert pipeline.pipe.text_encoder_3 is None and pipeline.pipe.tokenizer_3 is None
        assert type(pipeline.pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"


def test_make_tiny_model_refuses_a_family_it_does_not_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family must be one of sd, sdxl, sd3"):
        make_tiny_model(tmp_path, "flux")


def test_a_manifest_names_one_of_the_family_pipelines() -> None:
    manifest = {**tiny_manifest("sd3"), "pipeline": "FluxPipeline"}
    assert parse_manifest(manifest, origin="m").pipeline == "FluxPipeline"
    with pytest.raises(ManifestError, match="field 'pipeline' must name a pipeline of a model family"):
        parse_manifest({**manifest, "pipeline": "KandinskyPipeline"}, origin="m")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_job_and_an_img2img_job_give_images_of_the_asked_size(full_pipelines: dict[str, DiffusersPipeline],
                                                                family: str) -> None:
    pipeline = full_pipelines[family]
    steps: list[tuple[int, int]] = []

    (txt2img,) = pipeline.generate(SHORT_TXT2IMG, hooks=StepHooks(
        progress=lambda step, total, preview: steps.append((step, total))))
    (img2img,) = pipeline.generate(SHORT_IMG2IMG)

    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert txt2img.size == img2img.size == (64, 64)
    assert not np.array_equal(np.asarray(txt2img), np.asarray(img2img))
    assert same_pixels([txt2img], pipeline.generate(SHORT_TXT2IMG))  # seeded: the same image again


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rung", [RUNG_MODEL_OFFLOAD, RUNG_GROUP_OFFLOAD])
def test_every_rung_gives_the_pixels_of_full_residency(family_models: dict[str, ModelOnDisk],
                                                       full_pipelines: dict[str, DiffusersPipeline], family: str,
                                                       rung: str) -> None:
    full = full_pipelines[family]
    pipeline = DiffusersPipeline.load(family_models[family], "cpu", rung)

    for params in (SHORT_TXT2IMG, SHORT_IMG2IMG, SHORT_TXT2IMG):  # twice: the hooks are reset after a call
        assert same_but_rounding(pipeline.generate(params), full.generate(params)), params
    assert all(np.array_equal(a, b) for a, b in zip(frames(pipeline), frames(full), strict=True))
    if rung == RUNG_GROUP_OFFLOAD:  # the denoiser (SD3: the transformer) is cut into block groups
        denoiser = getattr(pipeline.pipe, DENOISER[family])
        hooked = [m for m in denoiser.modules()
                  if getattr(m, "_diffusers_hook", None) is not None
                  and m._diffusers_hook.get_hook("group_offloading") is not None]
        assert len(hooked) >= len(block_groups(denoiser)[1]) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_frame_batch_gives_each_frame_what_it_gets_alone(full_pipelines: dict[str, DiffusersPipeline],
                                                           family: str) -> None:
    pipeline = full_pipelines[family]
    batched = frames(pipeline, 3)
    alone = frames(pipeline, 1)

    assert [f.shape for f in batched] == [(64, 64, 3)] * 3
    assert np.abs(batched[0].astype(int) - alone[0].astype(int)).max() <= 2  # float rounding in the batch


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("params", [SHORT_TXT2IMG, SHORT_IMG2IMG], ids=["txt2img", "img2img"])
@pytest.mark.parametrize("boundary", [0, 1], ids=["before-the-first-step", "mid-way"])
def test_a_job_resumed_from_its_checkpoint_gives_the_uninterrupted_pixels(
        full_pipelines: dict[str, DiffusersPipeline], family: str, params: dict[str, Any], boundary: int) -> None:
    pipeline = full_pipelines[family]
    uninterrupted = pipeline.generate(params)

    stopped = preempted_at(pipeline, params, boundary)
    checkpoint = over_the_wire(stopped.checkpoint)
    seen: list[tuple[int, int]] = []
    images = pipeline.generate(params, resume=checkpoint, hooks=StepHooks(
        progress=lambda step, steps, preview: seen.append((step, steps))))

    assert stopped.step == boundary
    assert same_pixels(images, uninterrupted)
    assert seen[0][0] == boundary + 1 and seen[-1][0] == seen[-1][1] == stopped.steps


@pytest.mark.parametrize("family", FAMILIES)
def test_a_job_resumed_on_a_lower_rung_gives_the_uninterrupted_pixels(
        family_models: dict[str, ModelOnDisk], full_pipelines: dict[str, DiffusersPipeline], family: str) -> None:
    full = full_pipelines[family]
    checkpoint = over_the_wire(preempted_at(full, SHORT_TXT2IMG, 2).checkpoint)
    pipeline = DiffusersPipeline.load(family_models[family], "cpu", RUNG_FULL)
    pipeline.move_to(RUNG_GROUP_OFFLOAD)  # out of memory moved it down: a clean reload on the rung below

    assert pipeline.rung == RUNG_GROUP_OFFLOAD
    assert same_pixels(pipeline.generate(SHORT_TXT2IMG, resume=checkpoint), full.generate(SHORT_TXT2IMG))
    pipeline.release()
    assert pipeline.pipe is None


@pytest.mark.parametrize("family", FAMILIES)
def test_the_footprint_counts_every_encoder_the_denoiser_and_the_vae(
        family_models: dict[str, ModelOnDisk], full_pipelines: dict[str, DiffusersPipeline], family: str) -> None:
    model, pipeline = family_models[family], full_pipelines[family]
    footprint = pipeline_footprint(model.model_id, pipeline.pipe, model.params_schema)
    by_name = {c.name: c for c in footprint.components}

    assert set(by_name) == {DENOISER[family], "vae", "text_encoder", "text_encoder_2"}
    denoiser = getattr(pipeline.pipe, DENOISER[family])
    assert by_name[DENOISER[family]].weights_bytes == sum(t.numel() * t.element_size()
                                                          for t in [*denoiser.parameters(), *denoiser.buffers()])
    # Offload rungs run one component at a time, each with its own activations (largest size: 512).
    assert by_name[DENOISER[family]].working_bytes > 0 and by_name["vae"].working_bytes > 0
    assert footprint.needs(RUNG_FULL) >= footprint.needs(RUNG_MODEL_OFFLOAD) >= footprint.needs(RUNG_GROUP_OFFLOAD)


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_needs_read_from_the_saved_files_match_the_loaded_model(
        family_models: dict[str, ModelOnDisk], full_pipelines: dict[str, DiffusersPipeline], family: str) -> None:
    model, pipeline = family_models[family], full_pipelines[family]
    catalog = InstalledCatalog.read([model], dtype_bytes=4, max_side=512)

    (entry,) = catalog.entries({})
    loaded = needs_mib(pipeline_footprint(model.model_id, pipeline.pipe, model.params_schema, max_side=512))

    assert entry.model_id == model.model_id and set(entry.needs_mib) == set(RUNGS)
    # The files hold the tensors less the buffers made at load (CLIP's position ids): within a MiB.
    assert all(0 <= loaded[rung] - entry.needs_mib[rung] <= 1 for rung in RUNGS), (loaded, entry.needs_mib)
    assert all(n > 64 for n in entry.needs_mib.values())  # the working floor and more


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_by_the_ladder_it_has_a_step_time_and_realtime_slots(family_models: dict[str, ModelOnDisk],
                                                                    family: str) -> None:
    model = family_models[family]
    loaded = load_pipelines([model], "cpu")
    pipeline = loaded.pipelines[model.model_id]

    step_ms = measure_step_ms(pipeline)
    capacity = realtime_capacity(model.model_id, pipeline, 300.0)  # a short budget: few batches measured

    assert pipeline.rung == RUNG_FULL and step_ms is not None and step_ms > 0
    assert capacity is not None and (capacity.width, capacity.height) == (64, 64) and 1 in capacity.measured


@pytest.mark.parametrize("family", FAMILIES)
def test_the_worker_runs_a_job_and_a_resumed_order_to_the_uninterrupted_image(
        full_pipelines: dict[str, DiffusersPipeline], family: str) -> None:
    pipeline = full_pipelines[family]
    model_id = pipeline.model.model_id
    expected = encode_png_b64(pipeline.generate(SHORT_TXT2IMG))
    checkpoint = over_the_wire(preempted_at(pipeline, SHORT_TXT2IMG, 1).checkpoint)

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            async with running(make_worker(fake, {model_id: pipeline})):
                await fake.next_message("hello")
                fresh = await fake.job(SHORT_TXT2IMG, model_id=model_id, priority=0, account="k1")
                first = await fake.next_message("job_result", job_id=fresh)
                again = await fake.job(SHORT_TXT2IMG, model_id=model_id, priority=0, account="k1",
                                       resume={"step": 1, "checkpoint": checkpoint.to_base64()})
                second = await fake.next_message("job_result", job_id=again)

            assert first["images"] == second["images"] == expected
            assert [m["step"] for m in fake.about(again) if m["type"] == "job_progress"] == [2, 3]

    run_async(body())


@pytest.mark.parametrize("family", FAMILIES)
def test_placement_loads_a_family_model_serves_it_and_unloads_it(family_models: dict[str, ModelOnDisk],
                                                                 family: str) -> None:
    model = family_models[family]
    root = model.manifest_path.parent.parent  # the models dir make_tiny_model wrote into

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = build_worker(WorkerOptions(api=fake.url, token="secret", models_dir=root, device="cpu",
                                                worker_id="families:0", realtime=False, memory_mode="auto",
                                                preload=[], vram_mib=4000))
            async with running(worker):
                hello = await fake.next_message("hello")
                await fake.send({"type": "load_model", "model_id": model.model_id, "rung": RUNG_GROUP_OFFLOAD})
                loaded = await fake.next_message("model_loaded", model_id=model.model_id)
                served = await fake.job(SHORT_TXT2IMG, model_id=model.model_id)
                result = await fake.next_message("job_result", job_id=served)
                await fake.send({"type": "unload_model", "model_id": model.model_id})
                unloaded = await fake.next_message("model_unloaded", model_id=model.model_id)

        (installed,) = hello["installed"]
        assert installed["model_id"] == model.model_id and set(installed["needs_mib"]) == set(RUNGS)
        assert loaded["rung"] == result["rung"] == RUNG_GROUP_OFFLOAD and result["images"]
        assert unloaded["gpu"] == hello["gpu"]  # every byte back
        assert model.model_id not in worker.pipelines

    run_async(body())


def test_an_sd3_size_must_be_a_multiple_of_its_latent_patch(full_pipelines: dict[str, DiffusersPipeline]) -> None:
    import diffusers

    tiny = full_pipelines["sd3"]
    schema = {"type": "object", "properties": {"prompt": {"type": "string"}}}  # any size the worker allows
    model = dataclasses.replace(tiny.model, params_schema=schema)
    fine = DiffusersPipeline(model, tiny.pipe, None, "cpu", RUNG_FULL)
    assert fine.check_inputs({"prompt": "a kite", "width": 72, "height": 64}).width == 72  # scale 2 x patch 1
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=8, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64)
    pipe = diffusers.StableDiffusion3Pipeline(**{**tiny.pipe.components, "transformer": transformer})
    coarse = DiffusersPipeline(model, pipe, None, "cpu", RUNG_FULL)  # scale 2 x patch 8: 16

    with pytest.raises(ParamsRefused, match="width must be a multiple of 16, got 72"):
        coarse.check_inputs({"prompt": "a kite", "width": 72, "height": 64})
    assert coarse.check_inputs({"prompt": "a kite", "width": 80, "height": 64}).width == 80
