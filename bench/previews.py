"""What a job preview costs (issue 13): gpuworker/previews.py's latents -> JPEG -> base64 in ms, and
as a share of a denoising step, on the tiny model (its own latents and its own measured step) and on
random latents of SD 1.5's size (1x4x64x64, 512 px) and SDXL's (1x4x128x128, 1024 px) against the
H200-measured SD-1.5 step of 27 ms (docs/design/memory-ladder.md). Goal: at most 5% of a step for the
step that carries a preview (one in `preview_steps`: less over the job). `preview_costs()` is the
importable piece (bench/users.py); the story is in docs/design/previews.md.

    .venv/bin/python -m bench.previews [--repeats 50] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

H200_SD15_STEP_MS = 27.0  # docs/design/memory-ladder.md: full rung, 512x512, float16
GOAL_SHARE = 0.05  # a preview costs at most 5% of the step that carries it
DEFAULT_PREVIEW_STEPS = 4  # PREVIEW_STEPS' default: one step in four carries a preview


@dataclass(frozen=True)
class PreviewCost:
    """One row: `preview_ms` the median preview of `shape`, against a step of `step_ms` (`step_of`)."""

    name: str
    shape: tuple[int, ...]
    family: str
    preview_ms: float
    step_ms: float
    step_of: str
    jpeg_bytes: int

    @property
    def share(self) -> float:
        """Of the step that carries the preview."""
        return self.preview_ms / self.step_ms

    def share_over_job(self, preview_steps: int = DEFAULT_PREVIEW_STEPS) -> float:
        return self.share / preview_steps

    @property
    def ok(self) -> bool:
        return self.share <= GOAL_SHARE


def _median_ms(latents: Any, family: str, repeats: int) -> tuple[float, int]:
    """The median ms of one preview (after one warm-up) and its JPEG's size in bytes."""
    import base64

    import torch

    from gpuworker.previews import preview_b64

    def sync() -> None:
        if latents.device.type == "cuda":
            torch.cuda.synchronize()

    size = len(base64.b64decode(preview_b64(latents, family)))
    samples = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        preview_b64(latents, family)  # ends with the image on the CPU: the GPU's part is in it
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), size


def _tiny_step_and_latents(size: int, steps: int) -> tuple[float, Any, str]:
    """The tiny model through the worker's generate on the CPU: its median step ms and its last latents."""
    from gpuworker.installed import discover_models
    from gpuworker.pipelines import DiffusersPipeline
    from gpuworker.previews import family_of_pipeline
    from gpuworker.step_hooks import StepHooks
    from gpuworker.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as root:
        make_tiny_model(Path(root) / "tiny")
        (model,) = discover_models(Path(root))
        pipeline = DiffusersPipeline.load(model, "cpu")
    params = {"prompt": "a lighthouse at dusk", "width": size, "height": size, "steps": steps, "seed": 7}
    pipeline.generate({**params, "steps": 1})  # warm-up
    stamps: list[float] = []
    seen: list[Any] = []

    def keep(step: int, steps: int, latents: Any) -> None:  # the latents each preview would be made of
        seen.append(latents.clone())

    pipeline.generate(params, hooks=StepHooks(progress=lambda *_: stamps.append(time.perf_counter()), preview=keep))
    step_ms = statistics.median((b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False))
    family = family_of_pipeline(pipeline) or "sd"
    return step_ms, seen[-1], family


def preview_costs(*, repeats: int = 50, device: str = "cpu", tiny_size: int = 64, tiny_steps: int = 10,
                  tiny: bool = True) -> list[PreviewCost]:
    """The rows: the tiny model (on the CPU, its own step), then SD 1.5's and SDXL's latent sizes on
    `device` against the H200's SD-1.5 step (SDXL's own step is longer: its share is an upper bound)."""
    import torch

    rows = []
    if tiny:
        step_ms, latents, family = _tiny_step_and_latents(tiny_size, tiny_steps)
        ms, size = _median_ms(latents, family, repeats)
        rows.append(PreviewCost(f"tiny-sd {tiny_size}px", tuple(latents.shape), family, ms, step_ms,
                                "tiny step here", size))
    dtype = torch.float16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    for name, shape, family in (("SD 1.5 512px", (1, 4, 64, 64), "sd"), ("SDXL 1024px", (1, 4, 128, 128), "sdxl"),
                                ("SD3 1024px", (1, 16, 128, 128), "sd3")):
        latents = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        ms, size = _median_ms(latents, family, repeats)
        rows.append(PreviewCost(name, shape, family, ms, H200_SD15_STEP_MS, "H200 SD-1.5 step", size))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu", help="where the random latents are (cpu or cuda)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the worker's CPU side)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = preview_costs(repeats=args.repeats, device=args.device)
    print(f"preview cost, device {args.device}, {args.repeats} repeats (median), torch threads {args.threads}")
    print(f"{'latents':<16} {'shape':<18} {'family':<6} {'preview ms':>10} {'JPEG B':>7} {'step ms':>8} "
          f"{'step of':<17} {'share':>7} {'over job/4':>10}  goal <= 5%")
    for row in rows:
        print(f"{row.name:<16} {'x'.join(map(str, row.shape)):<18} {row.family:<6} {row.preview_ms:>10.2f} "
              f"{row.jpeg_bytes:>7} {row.step_ms:>8.1f} {row.step_of:<17} {row.share:>7.1%} "
              f"{row.share_over_job():>10.1%}  {'ok' if row.ok else 'OVER'}")


if __name__ == "__main__":
    main()
