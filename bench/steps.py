"""Step-boundary scheduling on the worker, measured (issue 11). Each part is a function in PARTS.

(a) checkpoints: per scheduler, the seconds of one denoising step beside what a checkpoint costs:
    its size (blob bytes and the wire's base64 characters), the save (capture at the boundary: the
    copy of latents, history and generator state to the CPU, then safetensors and base64) and the
    resume (base64 and safetensors read back, the fingerprint checked, the state put on a scheduler
    freshly set for the job's schedule, the latents moved to the device). Goal: save + resume under
    one step. Two models: the tiny pipeline through the worker's own generate (64x64 by default),
    and a random-weight UNet of SD 1.5's config at 512x512 (latents 4x64x64, guidance batch 2)
    driven step by step by the same scheduler and checkpoint code, since the whole SD-1.5-sized
    pipeline (its VAE and text encoder) changes nothing in a checkpoint's cost. No downloads.

    .venv/bin/python bench/steps.py                    # all parts
    .venv/bin/python bench/steps.py --parts a --sd15-steps 2 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULERS = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler")
HEADER = f"{'model':<14}{'size':>6}{'scheduler':>34}{'step s':>9}{'blob KiB':>10}{'b64 KiB':>9}" \
         f"{'save ms':>9}{'resume ms':>11}{'(save+resume)/step':>20}"


def _row(model: str, size: int, scheduler: str, step_s: float, blob: int, text: int, save_s: float,
         resume_s: float) -> None:
    ratio = (save_s + resume_s) / step_s
    print(f"{model:<14}{size:>6}{scheduler:>34}{step_s:>9.3f}{blob / 1024:>10.1f}{text / 1024:>9.1f}"
          f"{save_s * 1000:>9.2f}{resume_s * 1000:>11.2f}{ratio:>20.4f}", flush=True)


def _resume_seconds(text: str, scheduler: Any, steps: int, device: str, fingerprint: Any) -> float:
    """What resuming adds to a job's call: read the text back and put its state where the steps read it."""
    from workers.gpu.checkpoints import Checkpoint, restore_scheduler

    started = time.perf_counter()
    checkpoint = Checkpoint.from_base64(text)
    checkpoint.check_fits(fingerprint)
    scheduler.set_timesteps(steps)  # a fresh call does this too; the state goes on after it
    restore_scheduler(scheduler, checkpoint.scheduler, device)
    checkpoint.latents.to(device)
    checkpoint.generator()
    return time.perf_counter() - started


def _tiny_rows(size: int, steps: int) -> None:
    """The tiny pipeline through generate: step time from a plain run, save time at each boundary."""
    import diffusers

    from workers.gpu.installed import discover_models
    from workers.gpu.pipelines import DiffusersPipeline
    from workers.gpu.placement import img2img_class
    from workers.gpu.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as root:
        make_tiny_model(Path(root) / "tiny")
        (model,) = discover_models(Path(root))
        base = DiffusersPipeline.load(model, "cpu")
    params = {"prompt": "a lighthouse at dusk", "width": size, "height": size, "steps": steps, "seed": 7}
    for name in SCHEDULERS:
        pipe = type(base.pipe).from_pipe(base.pipe,
                                         scheduler=getattr(diffusers, name).from_config(base.pipe.scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        adapter = DiffusersPipeline(model, pipe, img2img_class(pipe).from_pipe(pipe), "cpu", "full")
        _tiny_row(adapter, params, name)


def _tiny_row(adapter: Any, params: dict[str, Any], name: str) -> None:
    from workers.gpu.checkpoints import Checkpoint

    adapter.generate({**params, "steps": 1})  # warm-up
    stamps: list[float] = []
    adapter.generate(params, on_step=lambda step, steps: stamps.append(time.perf_counter()))
    step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    saves: list[float] = []
    texts: list[tuple[str, int]] = []
    reported: list[float] = []

    def keep(checkpoint: Any) -> None:
        captured = time.perf_counter()  # capture_checkpoint ran between on_step and here
        text = checkpoint.to_base64()
        saves.append(captured - reported[-1] + time.perf_counter() - captured)
        texts.append((text, len(checkpoint.to_blob())))

    adapter.generate(params, on_step=lambda step, steps: reported.append(time.perf_counter()),
                     capture=lambda: bool(reported), on_checkpoint=keep)
    text, blob = max(texts, key=lambda pair: len(pair[0]))  # DPM's grows with its history
    fingerprint = Checkpoint.from_base64(text).fingerprint  # the job's: generate took it for this job
    resume_s = statistics.median(_resume_seconds(text, adapter.pipe.scheduler, params["steps"], "cpu", fingerprint)
                                 for _ in range(5))
    _row("tiny", params["width"], name, step_s, blob, len(text), statistics.median(saves), resume_s)


def _sd15_rows(steps: int) -> None:
    """A random UNet of SD 1.5's config at 512x512, stepped by hand with guidance (batch 2)."""
    import diffusers
    import torch
    from diffusers import UNet2DConditionModel

    from workers.gpu.checkpoints import capture_checkpoint, fingerprint_for

    started = time.perf_counter()
    torch.manual_seed(0)
    unet: Any = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    unet.eval()
    print(f"(SD-1.5-sized UNet built in {time.perf_counter() - started:.0f} s, "
          f"{sum(p.numel() for p in unet.parameters()) / 1e6:.0f} M parameters)", flush=True)
    config = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "num_train_timesteps": 1000, "steps_offset": 1}
    context = torch.randn(2, 77, 768, generator=torch.Generator("cpu").manual_seed(1))
    for name in SCHEDULERS:
        scheduler = getattr(diffusers, name)(**config)
        scheduler.set_timesteps(steps)
        fingerprint = fingerprint_for(scheduler, steps=steps, strength=None, width=512, height=512, device="cpu",
                                      dtype=torch.float32)
        generator = torch.Generator("cpu").manual_seed(7)
        latents = torch.randn(1, 4, 64, 64, generator=generator) * scheduler.init_noise_sigma
        step_times, saves, text, blob = [], [], "", 0
        for index, timestep in enumerate(scheduler.timesteps):
            started = time.perf_counter()
            with torch.no_grad():
                model_input = scheduler.scale_model_input(torch.cat([latents] * 2), timestep)
                uncond, cond = unet(model_input, timestep, encoder_hidden_states=context).sample.chunk(2)
            latents = scheduler.step(uncond + 7.5 * (cond - uncond), timestep, latents, generator=generator,
                                     return_dict=False)[0]
            step_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            checkpoint = capture_checkpoint(scheduler, latents, generator, index=index + 1, step=index + 1,
                                            steps=steps, fingerprint=fingerprint)
            assert checkpoint is not None
            text = checkpoint.to_base64()
            saves.append(time.perf_counter() - started)
            blob = len(checkpoint.to_blob())
        fresh = getattr(diffusers, name)(**config)
        resume_s = statistics.median(_resume_seconds(text, fresh, steps, "cpu", fingerprint) for _ in range(5))
        _row("sd15-unet", 512, name, statistics.median(step_times), blob, len(text), statistics.median(saves),
             resume_s)


def part_a(args: argparse.Namespace) -> None:
    """(a) Checkpoint size, save time and resume time beside one step's time, on the CPU."""
    print(f"\n(a) checkpoints on CPU, {args.threads} torch threads; the largest checkpoint of each run "
          "(DPM-Solver's grows with its history), save: median over the boundaries, resume: median of 5")
    print(HEADER)
    for size in args.tiny_sizes:
        _tiny_rows(size, args.tiny_steps)
    if args.sd15_steps > 0:
        _sd15_rows(args.sd15_steps)


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {"a": part_a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="".join(PARTS), help=f"which parts to run, of {''.join(PARTS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tiny-sizes", type=int, nargs="+", default=[64],
                        help="the tiny VAE scales by 2 only: at 512 its UNet attends over 128x128 tokens (slow)")
    parser.add_argument("--tiny-steps", type=int, default=8)
    parser.add_argument("--sd15-steps", type=int, default=3, help="steps of the SD-1.5-sized UNet (0: skip it)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    for part in args.parts:
        if part not in PARTS:
            parser.error(f"no part {part!r}: the parts are {', '.join(PARTS)}")
        PARTS[part](args)


if __name__ == "__main__":
    main()
