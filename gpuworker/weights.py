"""Reading a model onto the CPU at its run dtype (so the ladder can measure it before anything
reaches the device) and placing it on a rung: `pipe.to`, `enable_model_cpu_offload` or
`enable_group_offload` (torch and diffusers imported lazily); docs/design/memory-ladder.md, "The rungs"."""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuworker.installed import ModelOnDisk
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD, RUNG_MODEL_OFFLOAD, RUNGS


class PipelineLoadError(RuntimeError):
    """A model's pipeline could not be loaded from its source."""


def place(pipes: Sequence[Any], device: str, rung: str = RUNG_FULL, *, offload_dir: str | None = None) -> str:
    """Put a model's pipeline objects (the loaded one first, the rest made from it with `from_pipe`,
    sharing its modules) where `rung` says, on `device`; return the rung it runs on."""
    import torch

    pipe = pipes[0]
    if rung == RUNG_FULL:
        pipe.to(device)  # moves the shared modules for all of them
    elif rung == RUNG_MODEL_OFFLOAD:
        for each in pipes:  # each call of a pipeline ends by offloading the modules its own hooks know
            each.enable_model_cpu_offload(device=device)
    elif rung == RUNG_GROUP_OFFLOAD:
        # Once: the hooks sit on the shared modules. Groups of one block, prefetched on a CUDA stream
        # when there is one, kept on disk (safetensors files) when `offload_dir` is given.
        cuda = device.startswith("cuda")
        pipe.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=cuda,
                                  offload_to_disk_path=offload_dir)
    else:
        raise ValueError(f"unknown rung {rung!r}; expected one of {', '.join(RUNGS)}")
    return rung


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Hold back one logger's warnings for the duration."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def img2img_class(pipe: Any) -> Any:
    """StableDiffusionImg2ImgPipeline for Stable Diffusion; diffusers' AutoPipeline mapping for
    the rest (it imports every pipeline family, about a second, so only when needed)."""
    import diffusers

    if isinstance(pipe, diffusers.StableDiffusionPipeline):
        return diffusers.StableDiffusionImg2ImgPipeline
    return diffusers.AutoPipelineForImage2Image


def torch_dtype_for(device: str) -> Any:
    """float16 on CUDA (how Stable Diffusion is served), float32 on CPU (no fast half kernels)."""
    import torch

    return torch.float16 if device.startswith("cuda") else torch.float32


@dataclass
class Modules:
    """A model read from its source onto the CPU at the dtype it runs in, not yet placed."""

    pipe: Any
    img2img: Any | None = None
    frames: Any | None = None

    @property
    def pipes(self) -> list[Any]:
        return [p for p in (self.pipe, self.img2img, self.frames) if p is not None]


def read_modules(model: ModelOnDisk, device: str) -> Modules:
    """`<manifest.pipeline>.from_pretrained(source)` on the CPU at `device`'s dtype; img2img (and
    the frames pipeline) through `from_pipe`, sharing its modules."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights are installed, never downloaded
    import diffusers

    pipeline_class = getattr(diffusers, model.pipeline, None)
    if pipeline_class is None or not hasattr(pipeline_class, "from_pretrained"):
        raise PipelineLoadError(f"model {model.model_id}: diffusers has no pipeline {model.pipeline!r}")
    dtype = torch_dtype_for(device)
    try:
        pipe = pipeline_class.from_pretrained(model.source, dtype=dtype, **left_out_components(model.source))
    except (OSError, ValueError) as exc:
        raise PipelineLoadError(f"model {model.model_id}: cannot load {model.source}: {exc}") from exc
    pipe.set_progress_bar_config(disable=True)
    modules = Modules(pipe)
    if "img2img" in model.capabilities:
        # from_pipe shares the loaded modules: no second copy of the weights. It casts them to
        # its `dtype` (float32 unless told), so it is told the loaded one. The cast warns that
        # "[]" modules should stay float32 (a diffusers quirk): nothing to say. It runs before
        # placement: offloaded modules must not be cast or moved by hand.
        with _quiet("diffusers.models.modeling_utils"):
            modules.img2img = img2img_class(pipe).from_pipe(pipe, dtype=dtype)
            # Frames get their own pipeline object and scheduler: a frame batch may run inside
            # a job's step callback, and must not touch that job's timesteps or step index.
            modules.frames = img2img_class(pipe).from_pipe(pipe, dtype=dtype, scheduler=copy.deepcopy(pipe.scheduler))
        modules.img2img.set_progress_bar_config(disable=True)
        modules.frames.set_progress_bar_config(disable=True)
    return modules


def left_out_components(source: str) -> dict[str, None]:
    """`name=None` for each component a saved pipeline left out (`[null, null]` in its
    model_index.json: SD3 without its T5 encoder), which diffusers' from_pretrained must be told
    again; nothing for a hub id or a folder without that file."""
    path = Path(source) / "model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict):
        return {}
    return {name: None for name, entry in index.items()
            if not name.startswith("_") and isinstance(entry, list) and entry and all(e is None for e in entry)}


def offload_dir_for(model_id: str, to_disk: bool) -> str | None:
    """A fresh folder for a model's offloaded groups (under $TMPDIR), or None to keep them in RAM."""
    if not to_disk:
        return None
    import tempfile

    return tempfile.mkdtemp(prefix=f"potocolom-offload-{model_id}-")
