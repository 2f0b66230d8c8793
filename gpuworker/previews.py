"""Job previews: a job's current latents as a small base64 JPEG for `job_progress`, decoded by a
fixed linear map per model family from latent channels to RGB (no VAE call, no extra weights); the
story: docs/design/previews.md."""
from __future__ import annotations

import base64
import functools
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuworker.families import FAMILY_SD, FAMILY_SD3, FAMILY_SDXL, UnknownFamily, family_of

log = logging.getLogger(__name__)

MAX_SIDE = 256  # px on the preview's long side (the contract's cap)
JPEG_QUALITY = 70  # modest: a 64x64 preview is about 2 KB, a 256x256 one about 15 KB
SD3_CHANNELS = 16  # without a family, a 16-channel latent is taken as SD3's, any other as SD's


class PreviewRefused(ValueError):
    """Latents this module cannot preview (a family without a map, or a shape that is not its own)."""


@dataclass(frozen=True)
class LatentMap:
    """RGB = latent channels x factors + bias, in [-1, 1] (then to 0..255), per latent pixel."""

    factors: tuple[tuple[float, float, float], ...]  # one (R, G, B) row per latent channel
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def channels(self) -> int:
        return len(self.factors)


# The published latent-to-RGB factor tables (and biases) of ComfyUI's comfy/latent_formats.py
# (classes SD15, SDXL and SD3, `latent_rgb_factors` / `latent_rgb_factors_bias`), fitted by
# regression of VAE-decoded images on their latents. They apply to the latents the denoiser sees
# (already scaled, and for SD3 shifted, for the VAE), which is what diffusers' step callback gives.
MAPS: dict[str, LatentMap] = {
    FAMILY_SD: LatentMap((
        (0.3512, 0.2297, 0.3227),
        (0.3250, 0.4974, 0.2350),
        (-0.2829, 0.1762, 0.2721),
        (-0.2120, -0.2616, -0.7177),
    )),
    FAMILY_SDXL: LatentMap((
        (0.3651, 0.4232, 0.4341),
        (-0.2533, -0.0042, 0.1068),
        (0.1076, 0.1111, -0.0362),
        (-0.3165, -0.2492, -0.2188),
    ), (0.1084, -0.0175, -0.0011)),
    FAMILY_SD3: LatentMap((
        (-0.0922, -0.0175, 0.0749),
        (0.0311, 0.0633, 0.0954),
        (0.1994, 0.0927, 0.0458),
        (0.0856, 0.0339, 0.0902),
        (0.0587, 0.0272, -0.0496),
        (-0.0006, 0.1104, 0.0309),
        (0.0978, 0.0306, 0.0427),
        (-0.0042, 0.1038, 0.1358),
        (-0.0194, 0.0020, 0.0669),
        (-0.0488, 0.0130, -0.0268),
        (0.0922, 0.0988, 0.0951),
        (-0.0278, 0.0524, -0.0542),
        (0.0332, 0.0456, 0.0895),
        (-0.0069, -0.0030, -0.0810),
        (-0.0596, -0.0465, -0.0293),
        (-0.1448, -0.1463, -0.1189),
    ), (0.2394, 0.2135, 0.1925)),
}


def family_for(family: str | None, channels: int) -> str:
    """The family whose map decodes these latents: `family` when given, else by the channel count
    (16: SD3, any other: SD)."""
    if family is not None:
        return family
    return FAMILY_SD3 if channels == SD3_CHANNELS else FAMILY_SD


def preview_size(width: int, height: int, max_side: int = MAX_SIDE) -> tuple[int, int]:
    """(width, height) of the preview of a width x height latent: the latent's own size, or scaled
    down (aspect kept, at least 1 px) so that its long side is `max_side`."""
    if width < 1 or height < 1 or max_side < 1:
        raise PreviewRefused(f"no preview of a {width}x{height} latent at most {max_side} px")
    long_side = max(width, height)
    if long_side <= max_side:
        return width, height
    return max(1, round(width * max_side / long_side)), max(1, round(height * max_side / long_side))


@functools.lru_cache(maxsize=16)
def _weights(family: str, device: Any) -> tuple[Any, Any]:
    """The family's factors (C x 3) and bias (3) as float32 tensors on `device`, made once."""
    import torch

    latent_map = MAPS[family]
    return (torch.tensor(latent_map.factors, dtype=torch.float32, device=device),
            torch.tensor(latent_map.bias, dtype=torch.float32, device=device))


def latents_to_rgb(latents: Any, family: str | None = None, *, max_side: int = MAX_SIDE) -> Any:
    """The first image of `latents` (B x C x H x W or C x H x W; a torch tensor on any device, or a
    numpy array) as an H' x W' x 3 uint8 numpy array, at most `max_side` px on its long side.

    The map runs where the latents are (only the small RGB image comes to the CPU); latents larger
    than the preview are area-averaged down first, so the map runs on the preview's pixels only."""
    import torch

    with torch.no_grad():
        x = torch.as_tensor(latents)
        if x.ndim == 4:
            x = x[0]
        if x.ndim != 3:
            raise PreviewRefused(f"latents must be B x C x H x W or C x H x W, got shape {tuple(x.shape)}")
        channels, height, width = x.shape
        family = family_for(family, channels)
        latent_map = MAPS.get(family)
        if latent_map is None:
            raise PreviewRefused(f"no latent preview map for family {family!r}")
        if channels != latent_map.channels:
            raise PreviewRefused(f"family {family!r} has {latent_map.channels} latent channels, got {channels}")
        out_width, out_height = preview_size(width, height, max_side)
        x = x.detach().float()
        if (out_width, out_height) != (width, height):
            x = torch.nn.functional.interpolate(x[None], size=(out_height, out_width), mode="area")[0]
        factors, bias = _weights(family, x.device)
        rgb = torch.einsum("chw,cr->hwr", x, factors) + bias  # about [-1, 1]
        rgb = ((rgb + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
        return rgb.cpu().numpy()


def preview_jpeg(latents: Any, family: str | None = None, *, max_side: int = MAX_SIDE,
                 quality: int = JPEG_QUALITY) -> bytes:
    """The preview of `latents` (see latents_to_rgb) as JPEG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(latents_to_rgb(latents, family, max_side=max_side)).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def preview_b64(latents: Any, family: str | None = None) -> str:
    """The preview of `latents` as base64 JPEG: what job_progress.preview carries."""
    return base64.b64encode(preview_jpeg(latents, family)).decode("ascii")


def family_of_pipeline(pipeline: Any) -> str | None:
    """The family of a loaded model's diffusers pipeline (`pipeline.pipe`, or the object itself);
    None when it names none (the channel count then decides, see family_for)."""
    try:
        return family_of(getattr(pipeline, "pipe", None) or pipeline)
    except UnknownFamily:
        return None


MakePreview = Callable[[Any, "str | None"], str]


class JobPreviews:
    """One run of a job's previews, on the denoising thread: `preview(step, steps, latents)` makes
    one when `step` is a multiple of `every` (0: never). A preview that fails is logged once and the
    run goes on without previews: it never fails the job."""

    def __init__(self, every: int, pipeline: Any, *, job_id: str, make: MakePreview = preview_b64):
        self.every = max(0, every)
        self._pipeline = pipeline
        self._job_id = job_id
        self._make = make
        self.failed = False

    @property
    def on(self) -> bool:
        return self.every > 0 and not self.failed

    def preview(self, step: int, steps: int, latents: Any) -> str | None:
        """The step's preview (base64 JPEG), or None."""
        if not self.on or step % self.every:
            return None
        try:
            return self._make(latents, family_of_pipeline(self._pipeline))
        except Exception:
            self.failed = True
            log.warning("job %s: its preview at step %d of %d failed; the job goes on without previews",
                        self._job_id, step, steps, exc_info=True)
            return None
