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

from gpuworker.ladder import WORKING_FLOOR_BYTES, ComponentFootprint, Footprint, transformer_working, working_parts
from gpuworker.limits import MAX_IMAGE_SIDE, allowed_maximum

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


def _channels(config: Mapping[str, Any] | None) -> list[int]:
    channels = (config or {}).get("block_out_channels")
    return [int(c) for c in channels] if isinstance(channels, (list, tuple)) and channels else []


def _config(module: Any) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    return dict(config) if config is not None else None


DENOISERS = ("unet", "transformer")  # the component that denoises: a UNet (SD, SDXL) or a transformer (SD3, Flux)


def default_size(pipe: Any) -> int:
    """The pipeline's own default width and height: the UNet's (or transformer's) sample size
    times the VAE's scale (512 for a pipeline with neither)."""
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if module is not None:
            return int(module.config.sample_size * pipe.vae_scale_factor)
    return DEFAULT_IMAGE_SIZE


def denoiser_working(config: Mapping[str, Any] | None, *, width: int, height: int, vae_scale_factor: int,
                     dtype_bytes: int) -> int:
    """The denoiser's activations (floor excluded) from its config: a UNet's by its block channels
    (ladder.working_parts), a transformer's by its tokens and width (ladder.transformer_working)."""
    if not config:
        return 0
    channels = _channels(config)
    if channels:
        unet, _ = working_parts(width=width, height=height, vae_scale_factor=vae_scale_factor, unet_channels=channels,
                                vae_channels=[], dtype_bytes=dtype_bytes)
        return unet
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        return transformer_working(width=width, height=height, vae_scale_factor=vae_scale_factor,
                                   patch_size=int(config.get("patch_size") or 1), hidden_size=heads * head_dim,
                                   dtype_bytes=dtype_bytes)
    return 0


def _working_of(denoisers: Mapping[str, Mapping[str, Any] | None], vae: Mapping[str, Any] | None, *,
                size: tuple[int, int], vae_scale_factor: int, dtype_bytes: int) -> tuple[dict[str, int], int]:
    """(each component's own working memory, the model's whole working memory) for one image."""
    _, vae_bytes = working_parts(width=size[0], height=size[1], vae_scale_factor=vae_scale_factor, unet_channels=[],
                                 vae_channels=_channels(vae), dtype_bytes=dtype_bytes)
    own = {name: denoiser_working(config, width=size[0], height=size[1], vae_scale_factor=vae_scale_factor,
                                  dtype_bytes=dtype_bytes) for name, config in denoisers.items()}
    denoiser_bytes = max(own.values(), default=0)
    whole = max(denoiser_bytes, vae_bytes) + WORKING_FLOOR_BYTES
    if not (denoiser_bytes and vae_bytes):
        return {}, whole
    return {**{name: n for name, n in own.items() if n}, "vae": vae_bytes}, whole


def pipeline_footprint(model_id: str, pipe: Any, schema: Mapping[str, Any],
                       size: tuple[int, int] | None = None, *, max_side: int = MAX_IMAGE_SIDE) -> Footprint:
    """The footprint of a loaded diffusers pipeline (modules still on the CPU, at their run dtype),
    for the largest image its schema allows, `max_side` (MAX_IMAGE_SIDE) where it sets no maximum
    (or `size`, width and height). Steps change a job's time, not its memory: they are not in it.
    Every module counts: the UNet or transformer, each text encoder (1, 2 and 3), the VAE.

    A pipeline with a denoiser (UNet or transformer) and a VAE carries each one's own working
    memory (offload rungs run them one at a time); any other keeps only the whole model's (see
    Footprint.transient_bytes)."""
    import torch

    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    dtype_bytes = max((p.element_size() for m in modules.values() for p in m.parameters()), default=4)
    if size is None:
        size = largest_size(schema, "width", max_side), largest_size(schema, "height", max_side)
    own, whole = _working_of({name: _config(modules.get(name)) for name in DENOISERS if name in modules},
                             _config(modules.get("vae")), size=size,
                             vae_scale_factor=int(getattr(pipe, "vae_scale_factor", 8)), dtype_bytes=dtype_bytes)
    components = tuple(replace(component_footprint(name, module), working_bytes=own.get(name, 0))
                       for name, module in modules.items())
    return Footprint(model_id=model_id, components=components, working_bytes=whole)


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
    denoisers = {name: _saved_config(folder / name) for name in DENOISERS if (folder / name).is_dir()}
    vae = _saved_config(folder / "vae")
    size = largest_size(schema, "width", max_side), largest_size(schema, "height", max_side)
    own, whole = _working_of(denoisers, vae, size=size, vae_scale_factor=2 ** max(0, len(_channels(vae)) - 1),
                             dtype_bytes=dtype_bytes)
    return Footprint(model_id=model_id, components=tuple(replace(c, working_bytes=own.get(c.name, 0))
                                                         for c in components),
                     working_bytes=whole)


def _saved_config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
