"""The memory ladder on a real device: per-rung peak VRAM and seconds per step, and a real
out-of-memory demotion on CUDA.

Two random-weight pipelines, built offline: the tiny model (make_tiny_model) and one whose UNet,
VAE and text encoder are sized like Stable Diffusion 1.5 (about 1.07 B parameters, 2.1 GB in
float16). Each is loaded on every rung (full, model_offload, group_offload, group_offload with
its groups on disk) and runs one job; the table shows, per rung, the ladder's estimate of what it
needs, the measured peak (`torch.cuda.max_memory_allocated`), seconds per denoising step (from
the step callback, device synchronised) and the largest pixel difference from full residency
(the baseline, measured in the same run). Then the ladder's plan for both models at a few VRAM
budgets, and the out-of-memory demo: the large model on full under MEMORY_MODE auto, a per-process
memory cap between its full and model-offload peaks at a hungry size (`--oom-size`), and one job
at that size through the worker's own denoising loop: a real torch.OutOfMemoryError, the model
moved down and reloaded (memory given back, shown), the job retried once and finished on
model_offload.

Without CUDA (or with --device cpu) it does what a CPU can: the tiny model on every rung with
onload_device cpu (peak VRAM "n/a"), the plans, and the demotion path with an injected error
(labelled as such). --large adds the SD-1.5-sized model on CPU (slow; use a small --size).
On CUDA it also measures realtime frames per model on full residency: p95 per batched call and
frames/s at batch 1, 2, 4, ... with the worker's own measure_batches, and the slots that gives
within a 500 ms budget.

    .venv/bin/python bench/gpu_ladder.py                      # H200: about 2 minutes
    .venv/bin/python bench/gpu_ladder.py --device cpu --steps 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = (("full", False), ("model_offload", False), ("group_offload", False), ("group_offload", True))
GIB = 2**30


def make_sd15_sized_model(directory: Path, device: str) -> Path:
    """A random-weight pipeline with SD 1.5's UNet, VAE and a 12-layer 768-wide text encoder."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from gpuworker.tiny import TOKENIZER_MAX_LENGTH, tiny_manifest, write_tokenizer_files

    write_tokenizer_files(directory / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(str(directory / "tokenizer"), model_max_length=TOKENIZER_MAX_LENGTH)
    vocab = tokenizer.get_vocab()
    build_on = device if device.startswith("cuda") else "cpu"  # random init is quick on the GPU
    with torch.device(build_on):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
        vae = AutoencoderKL(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=4, layers_per_block=2,
                            sample_size=512)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            vocab_size=1000, max_position_embeddings=TOKENIZER_MAX_LENGTH, bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"]))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1)
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   image_encoder=None, requires_safety_checker=False)
    pipe.to("cpu", torch.float16 if device.startswith("cuda") else torch.float32)
    pipe.save_pretrained(str(directory), safe_serialization=True)
    manifest = tiny_manifest()
    manifest["model_id"] = "sd15-random"
    manifest["params_schema"]["properties"]["width"]["enum"] = [64, 256, 512, 768, 1024]
    manifest["params_schema"]["properties"]["height"]["enum"] = [64, 256, 512, 768, 1024]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory / "manifest.json"


def footprint_at(model: Any, pipe: Any, size: int) -> Any:
    """The ladder's footprint for a size x size image instead of the manifest's largest."""
    from gpuworker.footprints import pipeline_footprint

    return pipeline_footprint(model.model_id, pipe, model.params_schema, size=(size, size))


class StepClock:
    """Seconds between step callbacks, the device synchronised first."""

    def __init__(self, cuda: bool):
        self.cuda, self.stamps = cuda, []  # type: ignore[var-annotated]

    def __call__(self, step: int, steps: int, preview: str | None = None) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    @property
    def seconds_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return statistics.median(gaps) if gaps else float("nan")


def run_rows(model: Any, device: str, size: int, steps: int) -> None:
    import numpy as np
    import torch

    from gpuworker.ladder import mib
    from gpuworker.pipelines import DiffusersPipeline
    from gpuworker.step_hooks import StepHooks
    from gpuworker.weights import offload_dir_for

    cuda = device.startswith("cuda")
    params = {"prompt": "a lighthouse at dusk", "width": size, "height": size, "steps": steps, "seed": 7}
    baseline: Any = None
    print(f"\n{model.model_id} at {size}x{size}, {steps} steps on {device}")
    print(f"{'rung':<22}{'load s':>8}{'est. MiB':>10}{'peak MiB':>10}{'s/step':>9}{'job s':>8}{'max |diff|':>12}")
    for rung, on_disk in ROWS:
        started = time.perf_counter()
        offload_dir = offload_dir_for(model.model_id, on_disk)
        pipeline = DiffusersPipeline.load(model, device, rung, offload_dir=offload_dir)
        loaded_s = time.perf_counter() - started
        estimate = footprint_at(model, pipeline.pipe, size).needs(rung)
        pipeline.generate({**params, "steps": 1})  # warm-up: kernels, hooks, pinned buffers
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock = StepClock(cuda)
        started = time.perf_counter()
        (image,) = pipeline.generate(params, hooks=StepHooks(progress=clock))
        job_s = time.perf_counter() - started
        peak = mib(torch.cuda.max_memory_allocated()) if cuda else "n/a"
        pixels = np.asarray(image, dtype=np.int16)
        baseline = pixels if baseline is None else baseline
        diff = int(np.abs(pixels - baseline).max())
        name = rung + (" (disk)" if on_disk else "")
        print(f"{name:<22}{loaded_s:>8.1f}{mib(estimate).removesuffix(' MiB'):>10}"
              f"{peak.removesuffix(' MiB'):>10}{clock.seconds_per_step:>9.3f}{job_s:>8.2f}{diff:>12}", flush=True)
        pipeline.release()


def measure_frames(model: Any, device: str, size: int, budget_ms: float) -> None:
    """Realtime frames on full residency: ms per batched call (p95) and frames/s at batch sizes
    1, 2, 4, ... (the worker's own measure_batches, as at load), and the slots it would advertise."""
    from PIL import Image as PILImage

    from gpuworker.pipelines import DEFAULT_GUIDANCE_SCALE, DiffusersPipeline, FrameRequest
    from gpuworker.slots import (
        BATCH_CAP,
        MEASURE_STRENGTH,
        SESSION_STEPS,
        measure_batches,
        p95,
        slots_from_measurements,
    )

    pipeline = DiffusersPipeline.load(model, device, "full")
    image = PILImage.new("RGB", (size, size), (128, 128, 128))

    def run_batch(n: int) -> None:  # returns PIL images: the device work is done when it returns
        pipeline.generate_frames(FrameRequest(
            prompts=["a quick sketch"] * n, images=[image] * n, seeds=list(range(n)), width=size, height=size,
            steps=SESSION_STEPS, guidance_scale=DEFAULT_GUIDANCE_SCALE, strength=MEASURE_STRENGTH))

    measured = measure_batches(run_batch, budget_ms, cap=BATCH_CAP, max_seconds=30.0)
    frame_ms, slots = slots_from_measurements(measured, budget_ms)
    print(f"\nrealtime frames: {model.model_id} at {size}x{size}, {SESSION_STEPS} steps, full residency "
          f"(budget {budget_ms:g} ms)")
    print(f"{'batch':>6}{'p95 ms':>9}{'median ms':>11}{'frames/s':>10}")
    for n, samples in sorted(measured.items()):
        if samples:
            median = statistics.median(samples)
            print(f"{n:>6}{p95(samples):>9.1f}{median:>11.1f}{n * 1000 / median:>10.1f}")
    print(f"  frame p95 {frame_ms:.1f} ms at batch 1; {slots} realtime slot(s) within the budget")
    pipeline.release()


def show_plans(footprints: list[Any]) -> None:
    """plan_rungs for the models in load order at budgets where the largest one changes rung."""
    from gpuworker.ladder import MIB, mib, plan_rungs
    from potocolom.protocol.rungs import RUNGS

    print("\nthe ladder's plan (load order " + " then ".join(f.model_id for f in footprints) + ")")
    largest = max(footprints, key=lambda f: f.weights_bytes)
    others = [f for f in footprints if f is not largest]
    resident = sum(f.weights_bytes for f in others)
    pool = max((f.working_bytes for f in others), default=0)
    budgets = {resident + largest.resident_bytes(r) + max(pool, largest.transient_bytes(r)) for r in RUNGS}
    budgets |= {min(budgets) - MIB, 2 * sum(f.needs("full") for f in footprints)}
    for budget in sorted(budgets, reverse=True):
        plan = plan_rungs(footprints, free_bytes=budget)
        print(f"  {mib(budget):>12} free: " + ", ".join(f"{c.model_id} {c.rung or 'not served'}" for c in plan))


def peak_of(model: Any, device: str, rung: str, params: dict[str, Any]) -> float:
    """Peak bytes of one job on `rung` (inf when it does not fit at all)."""
    import torch

    from gpuworker.pipelines import DiffusersPipeline, OutOfMemory

    pipeline = DiffusersPipeline.load(model, device, rung)
    torch.cuda.reset_peak_memory_stats()
    try:
        pipeline.generate(params)
        return float(torch.cuda.max_memory_allocated())
    except OutOfMemory:
        return float("inf")
    finally:
        pipeline.release()


def cuda_index(device: str) -> int:
    """The index of "cuda" or "cuda:N" (set_per_process_memory_fraction wants one)."""
    import torch

    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def demote_once(model: Any, device: str, size: int, steps: int) -> None:
    """One job at a hungry size on full under auto: out of memory, moved down, retried."""
    import torch

    from gpuworker.denoise_loop import DenoiseLoop
    from gpuworker.jobs import WorkerJob
    from gpuworker.ladder import mib
    from gpuworker.pipelines import DiffusersPipeline, InjectedOutOfMemory
    from gpuworker.timings import JobTiming

    cuda = device.startswith("cuda")
    params = {"prompt": "a very large lighthouse", "width": size, "height": size, "steps": steps, "seed": 3}
    fault = None
    if cuda:
        offloaded, full = peak_of(model, device, "model_offload", params), peak_of(model, device, "full", params)
        cap = (offloaded + full) / 2 if full != float("inf") else offloaded * 1.05
        total = torch.cuda.get_device_properties(device).total_memory
        print(f"\nout of memory, for real: {model.model_id} at {size}x{size} peaks at {mib(int(full))} on full, "
              f"{mib(int(offloaded))} on model_offload; capping this process at {mib(int(cap))}")
        torch.cuda.set_per_process_memory_fraction(cap / total, cuda_index(device))
    else:
        fault = InjectedOutOfMemory({model.model_id: 1})
        print(f"\nout of memory (no CUDA here: injected at the pipeline seam): {model.model_id} at {size}x{size}")
    pipeline = DiffusersPipeline.load(model, device, "full", fault=fault)
    estimate = footprint_at(model, pipeline.pipe, size)
    print(f"  the ladder's estimate at {size}x{size}: full {mib(estimate.needs('full'))}, "
          f"model_offload {mib(estimate.needs('model_offload'))}")
    messages: list[dict[str, Any]] = []
    done = threading.Event()

    def post(message: dict[str, Any], job: Any) -> None:
        messages.append(message)
        if message["type"] in ("job_result", "job_failed"):
            done.set()

    def demote(model_id: str, rung: str) -> None:
        before = torch.cuda.memory_allocated() if cuda else None
        started = time.perf_counter()
        pipeline.move_to(rung)
        after = torch.cuda.memory_allocated() if cuda else None
        memory = f"device memory in use {mib(before)} -> {mib(after)}" if cuda else "device memory n/a (no CUDA)"
        print(f"  moved down to {rung} in {time.perf_counter() - started:.1f} s; {memory}")

    loop = DenoiseLoop({model.model_id: pipeline}, post, lambda job: None, memory_mode="auto", demote=demote)
    loop.start()
    timing = JobTiming(job_id="oom-demo", model_id=model.model_id, received=time.monotonic())
    loop.submit(WorkerJob(job_id="oom-demo", model_id=model.model_id, params=params, timing=timing))
    finished = done.wait(600)
    loop.stop()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, cuda_index(device))
    final = messages[-1] if finished and messages else {"type": "timeout"}
    print(f"  job ended: {final['type']} on rung {final.get('rung', timing.rung)}"
          f"{'; error: ' + final['error'] if final.get('error') else ''}; gpu {timing.gpu_ms or 0:.0f} ms")
    pipeline.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--size", type=int, default=None, help="image size (default: 512 on CUDA, 64 on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 10 on CUDA, 3 on CPU)")
    parser.add_argument("--oom-size", type=int, default=1024, help="the hungry size of the out-of-memory demo")
    parser.add_argument("--large", action="store_true", help="include the SD-1.5-sized model on CPU too")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from gpuworker.installed import read_manifest
    from gpuworker.tiny import make_tiny_model
    from gpuworker.vram import VramBudget
    from gpuworker.weights import read_modules

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit(f"--device {device}, but torch sees no CUDA device here (no CUDA); use --device cpu")
    if not cuda:
        print("no CUDA: running what a CPU can (onload_device cpu, no VRAM peaks, an injected out-of-memory error)")
    size, steps = args.size or (512 if cuda else 64), args.steps or (10 if cuda else 3)
    if cuda:
        torch.zeros(1, device=device)
        print(f"device: {VramBudget(device).gpu_info()}")

    with tempfile.TemporaryDirectory(prefix="gpu-ladder-") as scratch:
        root = Path(scratch)
        models = read_manifest(make_tiny_model(root / "tiny"))
        if cuda or args.large:
            started = time.perf_counter()
            models += read_manifest(make_sd15_sized_model(root / "sd15", device))
            print(f"built the SD-1.5-sized random pipeline in {time.perf_counter() - started:.1f} s")
        for model in models:
            run_rows(model, device, size if model.model_id != "tiny-sd" else min(size, 512), steps)
        footprints = []
        for model in models:
            modules = read_modules(model, device)
            footprints.append(footprint_at(model, modules.pipe, size))
            del modules
        show_plans(footprints)
        if cuda:
            for model in models:
                measure_frames(model, device, min(size, 512), 500.0)
        demote_once(models[-1], device, args.oom_size if cuda else size, steps)


if __name__ == "__main__":
    main()
