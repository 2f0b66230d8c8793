"""A loaded model's footprint for the memory ladder, measured from its modules: weights at their
run dtype, block groups exactly as diffusers' block-level group offload cuts them, and working
memory for the largest image its schema allows (docs/design/memory-ladder.md)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from workers.gpu.ladder import WORKING_FLOOR_BYTES, ComponentFootprint, Footprint, working_parts
from workers.gpu.limits import MAX_IMAGE_SIDE, allowed_maximum

DEFAULT_IMAGE_SIZE = 512


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: Any) -> int:
    """A module's parameters and buffers (shared tensors counted once)."""
    seen: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(tensor), tensor)
    return tensor_bytes(seen.values())


def block_groups(module: Any) -> tuple[int, list[int]]:
    """(bytes of the unmatched groups, [bytes of each block group]) of block-level group offload."""
    import torch

    explicit = set(getattr(module, "_group_offload_block_modules", None) or ())
    top_level, groups = 0, []
    for name, child in module.named_children():
        if name in explicit:
            child_top, child_groups = block_groups(child)
            top_level += child_top
            groups.extend(child_groups)
        elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            groups.extend(module_bytes(block) for block in child)
        else:
            top_level += module_bytes(child)
    top_level += tensor_bytes([*module.parameters(recurse=False), *module.buffers(recurse=False)])
    return top_level, groups


def component_footprint(name: str, module: Any) -> ComponentFootprint:
    top_level, groups = block_groups(module)
    return ComponentFootprint(name=name, weights_bytes=module_bytes(module), top_level_bytes=top_level,
                              largest_group_bytes=max(groups, default=0))


def largest_size(schema: Mapping[str, Any], key: str, cap: int = MAX_IMAGE_SIDE) -> int:
    """The largest width (or height) a params_schema allows: the enum's largest, else `maximum`,
    else `cap` (MAX_IMAGE_SIDE): a schema without a maximum lets a job ask for that much."""
    return allowed_maximum(schema, key, cap)


def _channels(module: Any) -> list[int]:
    config = getattr(module, "config", None)
    channels = getattr(config, "block_out_channels", None) if config is not None else None
    return [int(c) for c in channels] if channels else []


def default_size(pipe: Any) -> int:
    """The pipeline's own default width and height: UNet sample size times the VAE's scale (512
    for a pipeline without a UNet)."""
    unet = getattr(pipe, "unet", None)
    if unet is None:
        return DEFAULT_IMAGE_SIZE
    return int(unet.config.sample_size * pipe.vae_scale_factor)


def pipeline_footprint(model_id: str, pipe: Any, schema: Mapping[str, Any],
                       size: tuple[int, int] | None = None, *, max_side: int = MAX_IMAGE_SIDE) -> Footprint:
    """The footprint of a loaded diffusers pipeline (modules still on the CPU, at their run dtype),
    for the largest image its schema allows, `max_side` (MAX_IMAGE_SIDE) where it sets no maximum
    (or `size`, width and height). Steps change a job's time, not its memory: they are not in it.

    A pipeline with a UNet and a VAE carries each one's own working memory (offload rungs run them
    one at a time); any other keeps only the whole model's (see Footprint.transient_bytes)."""
    import torch

    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    dtype_bytes = max((p.element_size() for m in modules.values() for p in m.parameters()), default=4)
    if size is None:
        size = largest_size(schema, "width", max_side), largest_size(schema, "height", max_side)
    unet_channels, vae_channels = _channels(modules.get("unet")), _channels(modules.get("vae"))
    unet, vae = working_parts(width=size[0], height=size[1], vae_scale_factor=int(getattr(pipe, "vae_scale_factor", 8)),
                              unet_channels=unet_channels, vae_channels=vae_channels, dtype_bytes=dtype_bytes)
    own = {"unet": unet, "vae": vae} if unet_channels and vae_channels else {}
    components = tuple(replace(component_footprint(name, module), working_bytes=own.get(name, 0))
                       for name, module in modules.items())
    return Footprint(model_id=model_id, components=components, working_bytes=max(unet, vae) + WORKING_FLOOR_BYTES)


def safetensors_bytes(folder: str | Path) -> int:
    """The bytes of every tensor in a saved pipeline's safetensors files, read from their headers
    only (a check on pipeline_footprint at the stored dtype, before anything is loaded)."""
    import json
    import struct

    total = 0
    for path in sorted(Path(folder).glob("*/*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        total += sum(end - start for key, entry in header.items() if key != "__metadata__"
                     for start, end in [entry["data_offsets"]])
    return total
