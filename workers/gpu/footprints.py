"""A model's footprint for the memory ladder: weights at their run dtype, block groups exactly as
diffusers' block-level group offload cuts them, and working memory for the largest image its schema
allows (docs/design/memory-ladder.md); measured from loaded modules, or read from the saved files."""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Collection, Mapping
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


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets), read without its data."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def safetensors_bytes(folder: str | Path) -> int:
    """The bytes of every tensor in a saved pipeline's safetensors files, read from their headers
    only (a check on pipeline_footprint at the stored dtype, before anything is loaded)."""
    total = 0
    for path in sorted(Path(folder).glob("*/*.safetensors")):
        total += sum(end - start for entry in safetensors_header(path).values()
                     for start, end in [entry["data_offsets"]])
    return total


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # cast to the run dtype on loading
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def block_group_of(parts: list[str], explicit: Collection[str]) -> str | None:
    """The block group a tensor falls in under block-level group offload (block_groups' rule, by
    name): a child listed in `_group_offload_block_modules` is cut like a module of its own; an
    indexed child (ModuleList, Sequential) gives a group per index; anything else is top level."""
    if len(parts) > 2 and parts[0] in explicit:
        inner = block_group_of(parts[1:], ())
        return None if inner is None else f"{parts[0]}.{inner}"
    if len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return None


def _explicit_blocks(folder: Path) -> tuple[str, ...]:
    """The component class's `_group_offload_block_modules` (its config's `_class_name`), if any."""
    try:
        class_name = json.loads((folder / "config.json").read_text()).get("_class_name")
    except (OSError, ValueError):
        return ()
    import diffusers

    return tuple(getattr(getattr(diffusers, str(class_name), None), "_group_offload_block_modules", None) or ())


def saved_component_footprint(name: str, folder: Path, *, dtype_bytes: int) -> ComponentFootprint | None:
    """One saved component's footprint from its safetensors headers (None without weights: a
    tokenizer, a scheduler): floating tensors at the run dtype's `dtype_bytes`, others as stored."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    explicit = _explicit_blocks(folder)
    top_level, groups = 0, dict[str, int]()
    for path in files:
        for tensor, entry in safetensors_header(path).items():
            size = dtype_bytes if entry["dtype"] in FLOAT_DTYPES else DTYPE_BYTES.get(entry["dtype"], 4)
            nbytes = math.prod(entry["shape"]) * size
            group = block_group_of(tensor.split("."), explicit)
            if group is None:
                top_level += nbytes
            else:
                groups[group] = groups.get(group, 0) + nbytes
    return ComponentFootprint(name=name, weights_bytes=top_level + sum(groups.values()), top_level_bytes=top_level,
                              largest_group_bytes=max(groups.values(), default=0))


def saved_footprint(model_id: str, folder: str | Path, schema: Mapping[str, Any], *, dtype_bytes: int,
                    max_side: int = MAX_IMAGE_SIDE) -> Footprint:
    """The footprint pipeline_footprint would measure once the saved pipeline in `folder` is
    loaded at a dtype of `dtype_bytes`, read from its files alone (model_index.json, each
    component's config.json and safetensors headers): what a worker says of the models it has
    installed but not loaded. Tensors only: buffers a model makes at load time are not in it."""
    folder = Path(folder)
    index = json.loads((folder / "model_index.json").read_text())
    components = [footprint for name in sorted(index) if not name.startswith("_") and (folder / name).is_dir()
                  for footprint in [saved_component_footprint(name, folder / name, dtype_bytes=dtype_bytes)]
                  if footprint is not None]
    unet_channels, vae_channels = _saved_channels(folder / "unet"), _saved_channels(folder / "vae")
    size = largest_size(schema, "width", max_side), largest_size(schema, "height", max_side)
    unet, vae = working_parts(width=size[0], height=size[1], vae_scale_factor=2 ** max(0, len(vae_channels) - 1),
                              unet_channels=unet_channels, vae_channels=vae_channels, dtype_bytes=dtype_bytes)
    own = {"unet": unet, "vae": vae} if unet_channels and vae_channels else {}
    return Footprint(model_id=model_id, components=tuple(replace(c, working_bytes=own.get(c.name, 0))
                                                         for c in components),
                     working_bytes=max(unet, vae) + WORKING_FLOOR_BYTES)


def _saved_channels(folder: Path) -> list[int]:
    try:
        channels = json.loads((folder / "config.json").read_text()).get("block_out_channels")
    except (OSError, ValueError):
        return []
    return [int(c) for c in channels] if isinstance(channels, list) else []
