"""Checkpoints on the worker: a job stopped at a step boundary and resumed from its blob (through
base64, as the wire carries it) gives the pixels of the uninterrupted run, for every scheduler
checkpoints.py covers, txt2img and img2img; blobs that are not for the job, too large or garbage
are refused; a scheduler it cannot resume gives no checkpoint."""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuworker.checkpoints import (
    MAX_BLOB_BYTES,
    MAX_CHECKPOINT_CHARS,
    Checkpoint,
    CheckpointMismatch,
    CheckpointRefused,
    capture_checkpoint,
    fingerprint_for,
    restore_scheduler,
)
from gpuworker.pipelines import DiffusersPipeline
from gpuworker.step_hooks import PreemptedAtStep, StepHooks

PROJECT_DIR = Path(__file__).resolve().parents[2]
TXT2IMG = {"prompt": "a red kite", "width": 64, "height": 64, "steps": 6, "seed": 11, "guidance_scale": 6.0}

# (scheduler class, config changes): every scheduler checkpoints.py resumes, and the DPM-Solver
# variants whose step reads more (noise from the generator, a third-order history).
SCHEDULERS = [
    ("EulerDiscreteScheduler", {}),
    ("EulerAncestralDiscreteScheduler", {}),
    ("DDIMScheduler", {}),
    ("LCMScheduler", {}),
    ("DPMSolverMultistepScheduler", {}),
    ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    ("DPMSolverMultistepScheduler", {"solver_order": 3}),
]


def png_data_url(width: int, height: int) -> str:
    """A small gradient PNG (a flat colour would hide a wrongly noised start)."""
    from PIL import Image

    pixels = np.add.outer(np.arange(height), np.arange(width)).astype(np.uint8)[..., None].repeat(3, axis=2)
    buffer = io.BytesIO()
    Image.fromarray(pixels * 3).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


IMG2IMG = {**TXT2IMG, "steps": 8, "strength": 0.5, "init_image": png_data_url(64, 64)}  # runs 4 steps


def with_scheduler(tiny_pipeline: DiffusersPipeline, name: str, **config: Any) -> DiffusersPipeline:
    """The tiny model on another scheduler: new pipeline objects sharing the shared fixture's modules."""
    import diffusers

    from gpuworker.weights import img2img_class

    scheduler = getattr(diffusers, name).from_config(tiny_pipeline.pipe.scheduler.config, **config)
    pipe = type(tiny_pipeline.pipe).from_pipe(tiny_pipeline.pipe, scheduler=scheduler)
    img2img = img2img_class(pipe).from_pipe(pipe)
    for each in (pipe, img2img):
        each.set_progress_bar_config(disable=True)
    return DiffusersPipeline(tiny_pipeline.model, pipe, img2img, "cpu", "full")


def pixels(images: list[Any]) -> list[np.ndarray]:
    return [np.asarray(image) for image in images]


def same_pixels(ours: list[Any], theirs: list[Any]) -> bool:
    return len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(pixels(ours), pixels(theirs),
                                                                                strict=True))


def preempted_at(adapter: DiffusersPipeline, params: dict[str, Any], boundary: int) -> PreemptedAtStep:
    """Run `params` and preempt it at the boundary after `boundary` steps (0: before the first)."""
    done: list[int] = []
    hooks = StepHooks(progress=lambda step, steps, preview: done.append(step), preempted=lambda: len(done) == boundary)
    with pytest.raises(PreemptedAtStep) as raised:
        adapter.generate(params, hooks=hooks)
    return raised.value


def over_the_wire(checkpoint: Checkpoint | None) -> Checkpoint:
    """The checkpoint as another process gets it back from the API: base64 text, decoded."""
    assert checkpoint is not None
    text = checkpoint.to_base64()
    assert isinstance(text, str) and len(text) <= MAX_CHECKPOINT_CHARS
    return Checkpoint.from_base64(text)


def resumed(adapter: DiffusersPipeline, params: dict[str, Any], checkpoint: Checkpoint,
            ) -> tuple[list[Any], list[tuple[int, int]]]:
    steps_seen: list[tuple[int, int]] = []
    hooks = StepHooks(progress=lambda step, steps, preview: steps_seen.append((step, steps)))
    images = adapter.generate(params, resume=checkpoint, hooks=hooks)
    return images, steps_seen


@pytest.mark.parametrize(("name", "config"), SCHEDULERS)
def test_a_txt2img_job_resumed_from_a_middle_step_gives_the_uninterrupted_pixels(
        tiny_pipeline: DiffusersPipeline, name: str, config: dict[str, Any]) -> None:
    adapter = with_scheduler(tiny_pipeline, name, **config)
    uninterrupted = adapter.generate(TXT2IMG)

    preempted = preempted_at(adapter, TXT2IMG, 3)
    images, steps_seen = resumed(adapter, TXT2IMG, over_the_wire(preempted.checkpoint))

    assert (preempted.step, preempted.steps) == (3, 6)
    assert steps_seen == [(4, 6), (5, 6), (6, 6)]  # progress goes on from k+1
    assert same_pixels(images, uninterrupted)
    assert same_pixels(adapter.generate(TXT2IMG), uninterrupted)  # the pipeline is left as it was


@pytest.mark.parametrize(("name", "config"), [SCHEDULERS[0], SCHEDULERS[1], SCHEDULERS[2], SCHEDULERS[5]])
def test_an_img2img_job_resumed_from_a_middle_step_gives_the_uninterrupted_pixels(
        tiny_pipeline: DiffusersPipeline, name: str, config: dict[str, Any]) -> None:
    adapter = with_scheduler(tiny_pipeline, name, **config)
    uninterrupted = adapter.generate(IMG2IMG)

    preempted = preempted_at(adapter, IMG2IMG, 1)
    images, steps_seen = resumed(adapter, IMG2IMG, over_the_wire(preempted.checkpoint))

    assert (preempted.step, preempted.steps) == (1, 4)  # img2img runs int(8 x 0.5) steps
    assert steps_seen == [(2, 4), (3, 4), (4, 4)]
    assert same_pixels(images, uninterrupted)


@pytest.mark.parametrize("params", [TXT2IMG, IMG2IMG], ids=["txt2img", "img2img"])
@pytest.mark.parametrize("first", [True, False], ids=["before-the-first-step", "after-the-last-step"])
def test_a_job_resumes_from_its_first_and_its_last_boundary(
        tiny_pipeline: DiffusersPipeline, params: dict[str, Any], first: bool) -> None:
    adapter = with_scheduler(tiny_pipeline, "EulerAncestralDiscreteScheduler")
    uninterrupted = adapter.generate(params)
    steps = 6 if params is TXT2IMG else 4

    preempted = preempted_at(adapter, params, 0 if first else steps)
    images, steps_seen = resumed(adapter, params, over_the_wire(preempted.checkpoint))

    assert (preempted.step, preempted.steps) == (0 if first else steps, steps)
    assert steps_seen == ([(step, steps) for step in range(1, steps + 1)] if first else [])
    assert same_pixels(images, uninterrupted)


def test_a_job_resumes_at_its_own_step_where_the_schedule_repeats_a_timestep(tiny_pipeline: DiffusersPipeline) -> None:
    # DPM-Solver with Karras sigmas at 50 steps runs timestep 1 twice (steps 48 and 49): from the
    # timestep alone the scheduler would resume at the wrong one of the two.
    adapter = with_scheduler(tiny_pipeline, "DPMSolverMultistepScheduler", use_karras_sigmas=True)
    params = {**TXT2IMG, "steps": 50}
    adapter.pipe.scheduler.set_timesteps(50)
    assert adapter.pipe.scheduler.timesteps[47:49].tolist() == [1, 1]
    uninterrupted = adapter.generate(params)

    preempted = preempted_at(adapter, params, 47)
    images, steps_seen = resumed(adapter, params, over_the_wire(preempted.checkpoint))

    assert steps_seen == [(48, 50), (49, 50), (50, 50)]
    assert same_pixels(images, uninterrupted)


def test_checkpoints_taken_while_a_job_goes_on_change_nothing_and_each_resumes_it(
        tiny_pipeline: DiffusersPipeline) -> None:
    adapter = with_scheduler(tiny_pipeline, "DPMSolverMultistepScheduler")
    uninterrupted = adapter.generate(TXT2IMG)
    taken: list[Checkpoint | None] = []

    images = adapter.generate(TXT2IMG, hooks=StepHooks(checkpoint_due=lambda: True, on_checkpoint=taken.append))

    assert same_pixels(images, uninterrupted)
    assert [checkpoint.step for checkpoint in taken if checkpoint is not None] == [0, 1, 2, 3, 4, 5, 6]
    for checkpoint in (taken[2], taken[5]):
        assert same_pixels(resumed(adapter, TXT2IMG, over_the_wire(checkpoint))[0], uninterrupted)


def test_a_resumed_job_can_be_preempted_again_and_still_gives_the_uninterrupted_pixels(
        tiny_pipeline: DiffusersPipeline) -> None:
    adapter = with_scheduler(tiny_pipeline, "LCMScheduler")
    uninterrupted = adapter.generate(TXT2IMG)
    first = preempted_at(adapter, TXT2IMG, 2)
    done: list[int] = []

    hooks = StepHooks(progress=lambda step, steps, preview: done.append(step), preempted=lambda: done[-1:] == [4])
    with pytest.raises(PreemptedAtStep) as second:
        adapter.generate(TXT2IMG, resume=over_the_wire(first.checkpoint), hooks=hooks)
    images, steps_seen = resumed(adapter, TXT2IMG, over_the_wire(second.value.checkpoint))

    assert (second.value.step, done) == (4, [3, 4])
    assert steps_seen == [(5, 6), (6, 6)]
    assert same_pixels(images, uninterrupted)


def test_a_blob_resumes_the_job_in_another_process(tiny_pipeline: DiffusersPipeline, models_dir: Path,
                                                   tmp_path: Path) -> None:
    adapter = with_scheduler(tiny_pipeline, "EulerAncestralDiscreteScheduler")
    (uninterrupted,) = adapter.generate(TXT2IMG)
    preempted = preempted_at(adapter, TXT2IMG, 3)
    assert preempted.checkpoint is not None
    (tmp_path / "checkpoint.txt").write_text(preempted.checkpoint.to_base64())
    code = f"""
import json, sys
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
from diffusers import EulerAncestralDiscreteScheduler
from gpuworker.checkpoints import Checkpoint
from gpuworker.installed import discover_models
from gpuworker.pipelines import DiffusersPipeline
(model,) = discover_models(Path({str(models_dir)!r}))
adapter = DiffusersPipeline.load(model, "cpu")
adapter.pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(adapter.pipe.scheduler.config)
checkpoint = Checkpoint.from_base64(Path({str(tmp_path / "checkpoint.txt")!r}).read_text())
(image,) = adapter.generate(json.loads({json.dumps(TXT2IMG)!r}), resume=checkpoint)
np.save({str(tmp_path / "resumed.npy")!r}, np.asarray(image))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)

    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "resumed.npy"), np.asarray(uninterrupted))


def _with_fingerprint(checkpoint: Checkpoint, **changes: Any) -> Checkpoint:
    return dataclasses.replace(checkpoint, fingerprint=dataclasses.replace(checkpoint.fingerprint, **changes))


@pytest.mark.parametrize(("change", "message"), [
    (lambda adapter, checkpoint: (adapter, {**TXT2IMG, "width": 128}, checkpoint), "width: 64 != 128"),
    (lambda adapter, checkpoint: (adapter, {**TXT2IMG, "steps": 8}, checkpoint), "steps: 6 != 8"),
    (lambda adapter, checkpoint: (with_scheduler(adapter, "DDIMScheduler"), TXT2IMG, checkpoint),
     "scheduler: 'EulerDiscreteScheduler' != 'DDIMScheduler'"),
    (lambda adapter, checkpoint: (with_scheduler(adapter, "EulerDiscreteScheduler", use_karras_sigmas=True), TXT2IMG,
                                  checkpoint), "scheduler_config"),
    (lambda adapter, checkpoint: (adapter, {**TXT2IMG, "init_image": IMG2IMG["init_image"]}, checkpoint), "strength"),
    (lambda adapter, checkpoint: (adapter, TXT2IMG, _with_fingerprint(checkpoint, device="cuda:NVIDIA H200")),
     "device: 'cuda:NVIDIA H200' != 'cpu'"),
    (lambda adapter, checkpoint: (adapter, TXT2IMG, _with_fingerprint(checkpoint, torch="2.0.0")), "torch"),
    (lambda adapter, checkpoint: (adapter, TXT2IMG, _with_fingerprint(checkpoint, dtype="torch.float16")), "dtype"),
], ids=["size", "steps", "scheduler", "scheduler-config", "img2img", "device", "torch", "dtype"])
def test_a_checkpoint_for_another_job_or_worker_is_refused(
        tiny_pipeline: DiffusersPipeline, change: Callable[..., Any], message: str) -> None:
    checkpoint = over_the_wire(preempted_at(tiny_pipeline, TXT2IMG, 2).checkpoint)
    adapter, params, checkpoint = change(tiny_pipeline, checkpoint)

    with pytest.raises(CheckpointMismatch, match=message.replace("(", r"\(").replace(")", r"\)")):
        adapter.generate(params, resume=checkpoint)


def test_a_scheduler_it_cannot_resume_gives_no_checkpoint_and_the_job_is_unchanged(
        tiny_pipeline: DiffusersPipeline) -> None:
    adapter = with_scheduler(tiny_pipeline, "UniPCMultistepScheduler")  # a history checkpoints.py does not carry
    uninterrupted = adapter.generate(TXT2IMG)
    taken: list[Checkpoint | None] = []

    images = adapter.generate(TXT2IMG, hooks=StepHooks(checkpoint_due=lambda: True, on_checkpoint=taken.append))
    preempted = preempted_at(adapter, TXT2IMG, 2)

    assert same_pixels(images, uninterrupted)
    assert taken and all(checkpoint is None for checkpoint in taken)
    assert (preempted.step, preempted.steps, preempted.checkpoint) == (2, 6, None)


def test_it_refuses_a_blob_or_a_text_over_the_size_limit(tiny_pipeline: DiffusersPipeline) -> None:
    import torch

    checkpoint = preempted_at(tiny_pipeline, TXT2IMG, 1).checkpoint
    assert checkpoint is not None
    huge = dataclasses.replace(checkpoint, latents=torch.zeros(1, 4, 1024, 1024))  # 16 MiB of float32

    with pytest.raises(CheckpointRefused, match=f"more than {MAX_BLOB_BYTES}"):
        huge.to_blob()
    with pytest.raises(CheckpointRefused, match=f"more than {MAX_BLOB_BYTES}"):
        Checkpoint.from_blob(checkpoint.to_blob() + b"\0" * MAX_BLOB_BYTES)
    with pytest.raises(CheckpointRefused, match=f"more than {MAX_CHECKPOINT_CHARS}"):
        Checkpoint.from_base64("A" * (MAX_CHECKPOINT_CHARS + 4))


def _safetensors_blob(metadata: dict[str, str] | None) -> bytes:
    import torch
    from safetensors.torch import save

    return save({"latents": torch.zeros(1, 4, 8, 8)}, metadata=metadata)


def _rewritten_header(blob: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """The blob with its checkpoint header changed (and its safetensors header re-framed)."""
    (length,) = struct.unpack("<Q", blob[:8])
    outer = json.loads(blob[8:8 + length])
    header = json.loads(outer["__metadata__"]["potocolom.checkpoint"])
    change(header)
    outer["__metadata__"]["potocolom.checkpoint"] = json.dumps(header)
    text = json.dumps(outer).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + length:]


@pytest.mark.parametrize(("make", "message"), [
    (lambda blob: b"", "too short"),
    (lambda blob: b"garbage!garbage!", "header runs past its end"),
    (lambda blob: blob[: len(blob) // 2], "tensors cannot be read"),
    (lambda blob: _safetensors_blob(None), "no readable header"),
    (lambda blob: _safetensors_blob({"potocolom.checkpoint": "{not json"}), "no readable header"),
    (lambda blob: _rewritten_header(blob, lambda header: header.update(format=99)), "format is 99"),
    (lambda blob: _rewritten_header(blob, lambda header: header.update(step=7)), "step 7 is past its steps 6"),
    (lambda blob: _rewritten_header(blob, lambda header: header.update(step="3")), "step must be an integer"),
    (lambda blob: _rewritten_header(blob, lambda header: header["fingerprint"].pop("device")), "fingerprint"),
    (lambda blob: _rewritten_header(blob, lambda header: header["scheduler"].update(history=[True])),
     "its header says"),
    ("not base64!", "not valid base64"),
    (12345, "must be a base64 string"),
], ids=["empty", "garbage", "truncated", "no-header", "bad-json", "format", "step", "step-type", "fingerprint",
        "tensors", "bad-base64", "not-text"])
def test_it_refuses_a_malformed_checkpoint_with_a_clear_error(
        tiny_pipeline: DiffusersPipeline, make: Any, message: str) -> None:
    checkpoint = preempted_at(tiny_pipeline, TXT2IMG, 2).checkpoint
    assert checkpoint is not None
    blob = checkpoint.to_blob()

    with pytest.raises(CheckpointRefused, match=message):
        if callable(make):
            Checkpoint.from_base64(base64.b64encode(make(blob)).decode())
        else:
            Checkpoint.from_base64(make)


# FlowMatchEuler drives flow-matching models (SD3, Flux), which have no tiny Stable Diffusion
# pipeline here. What a checkpoint carries is the scheduler's state, so it is tested at the
# scheduler's level: a deterministic stand-in for the model's output (not a model) drives its steps.
@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic", "stochastic-sampling"])
def test_a_flow_match_euler_schedule_resumed_from_a_blob_gives_the_same_latents(stochastic: bool) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    def model_output(sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return torch.sin(sample * 3.0 + timestep / 1000.0) - 0.5 * sample

    def run(scheduler: Any, latents: torch.Tensor, generator: torch.Generator, start: int,
            stop: int) -> torch.Tensor:
        for timestep in scheduler.timesteps[start:stop]:
            latents = scheduler.step(model_output(latents, timestep), timestep, latents, generator=generator,
                                     return_dict=False)[0]
        return latents

    config = {"shift": 3.0, "stochastic_sampling": stochastic}
    steps, boundary = 8, 3
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator("cpu").manual_seed(5))
    scheduler: Any = FlowMatchEulerDiscreteScheduler(**config)  # diffusers' stubs lack set_timesteps
    scheduler.set_timesteps(steps)
    uninterrupted = run(scheduler, noise, torch.Generator("cpu").manual_seed(9), 0, steps)

    first: Any = FlowMatchEulerDiscreteScheduler(**config)
    first.set_timesteps(steps)
    generator = torch.Generator("cpu").manual_seed(9)
    latents = run(first, noise, generator, 0, boundary)
    fingerprint = fingerprint_for(first, steps=steps, strength=None, width=64, height=64, device="cpu",
                                  dtype=torch.float32)
    taken = capture_checkpoint(first, latents, generator, index=boundary, step=boundary, steps=steps,
                               fingerprint=fingerprint)
    checkpoint = over_the_wire(taken)

    second: Any = FlowMatchEulerDiscreteScheduler(**config)  # as another process would build it
    second.set_timesteps(steps)
    checkpoint.check_fits(fingerprint_for(second, steps=steps, strength=None, width=64, height=64, device="cpu",
                                          dtype=torch.float32))
    restore_scheduler(second, checkpoint.scheduler, "cpu")
    resumed_latents = run(second, checkpoint.latents, checkpoint.generator(), boundary, steps)

    assert torch.equal(resumed_latents, uninterrupted)
