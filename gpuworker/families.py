"""Model families: which family a diffusers pipeline belongs to, and what differs between families
where the worker's code must know (one adapter per family); docs/protocol.md, "Model families", and
docs/design/families.md."""
from __future__ import annotations

import math
from typing import Any

from potocolom.protocol.manifests import PIPELINES

FAMILY_SD = "sd"  # Stable Diffusion 1.x/2.x: UNet, one CLIP encoder
FAMILY_SDXL = "sdxl"  # SDXL (also Turbo): UNet with added time ids and pooled embeds, two CLIP encoders
FAMILY_SD3 = "sd3"  # SD3: MMDiT transformer, flow matching, two CLIP encoders and an optional T5
FAMILY_FLUX = "flux"  # Flux: transformer, flow matching (accepted by name; no tiny model is built)
FAMILIES = (FAMILY_SD, FAMILY_SDXL, FAMILY_SD3, FAMILY_FLUX)

# Class-name prefixes of each family's diffusers pipelines (txt2img, img2img, inpaint), longest first:
# "StableDiffusionXL..." and "StableDiffusion3..." must win over "StableDiffusion...".
_PREFIXES = (("StableDiffusionXL", FAMILY_SDXL), ("StableDiffusion3", FAMILY_SD3), ("Flux", FAMILY_FLUX),
             ("StableDiffusion", FAMILY_SD))


class UnknownFamily(ValueError):
    """A pipeline of none of the families the worker serves."""


def family_of_class_name(name: str) -> str:
    """The family of a diffusers pipeline class named `name`; UnknownFamily for any other."""
    for prefix, family in _PREFIXES:
        if name.startswith(prefix):
            return family
    raise UnknownFamily(f"pipeline {name!r} is of no family served here (Stable Diffusion 1/2, SDXL, SD3, Flux)")


def family_of(pipe: Any) -> str:
    """"sd", "sdxl", "sd3" (or "flux") for a diffusers pipeline object or class, from its class (or
    the first of its bases that names a family: a subclass keeps its family); UnknownFamily else."""
    cls = pipe if isinstance(pipe, type) else type(pipe)
    for base in cls.__mro__:
        try:
            return family_of_class_name(base.__name__)
        except UnknownFamily:
            continue
    raise UnknownFamily(f"pipeline {cls.__name__!r} is of no family served here (Stable Diffusion 1/2, SDXL, SD3, "
                        "Flux)")


def pipeline_families() -> dict[str, str]:
    """Each pipeline name a manifest may give (manifests.PIPELINES) with its family."""
    return {name: family_of_class_name(name) for name in PIPELINES}



def size_multiple(pipe: Any, floor: int) -> int:
    """What a width and height must be a multiple of for `pipe`: at least `floor`, and a
    transformer's latent patch in pixels (the VAE's scale times its patch size; Flux packs 2x2
    patches), which SD3 and Flux refuse to run otherwise."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        return floor
    flux = any(base.__name__.startswith("Flux") for base in type(pipe).__mro__)
    patch = 2 if flux else int(getattr(transformer.config, "patch_size", 1) or 1)
    pixels = int(getattr(pipe, "vae_scale_factor", 8)) * patch
    return floor * pixels // math.gcd(floor, pixels)  # both hold: their least common multiple
