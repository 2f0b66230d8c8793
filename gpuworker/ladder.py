"""The memory ladder (pure: no torch, no Django, no clock): what each model needs on each rung, the
rung each one takes in load order against what is free (`place_next`, folded by `plan_rungs`), and
where an out-of-memory error moves it. The rungs, the calibration and why: docs/design/memory-ladder.md."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from potocolom.protocol.rungs import MEMORY_MODES, MODE_AUTO, RUNG_FULL, RUNG_GROUP_OFFLOAD, RUNG_MODEL_OFFLOAD, RUNGS

MIB = 2**20
GROUP_RESIDENT_BLOCKS = 2  # under group offload: the block group running and the one prefetched
CFG_BATCH = 2  # classifier-free guidance runs the UNet on a batch of two (with and without prompt)
# activations alive at once per UNet level (skips, resnet temporaries): on an H200 an SD-1.5-sized
# UNet's working memory under model offload (peak less its weights) was 177 MiB at 512x512, 12.5 of
# them over the floor; 20 leaves room for the allocator
UNET_LIVE_TENSORS = 20
# full-resolution activations alive at once in a VAE block: on an H200 an SD-1.5-sized model's
# working memory (peak allocated less weights) was 9.4 of them at 512x512 and 9.5 at 1024x1024;
# 11 leaves room for the caching allocator's rounding. An estimate under the peak means an
# out-of-memory error and a demotion that lasts until the worker restarts.
VAE_LIVE_TENSORS = 11
# values alive at once per token of a transformer block (SD3, Flux: the joint attention's q, k, v and
# output, the MLP's 4x hidden, the residual stream and norms): an estimate not yet measured on a GPU
TRANSFORMER_LIVE_TENSORS = 12
TRANSFORMER_TEXT_TOKENS = 333  # SD3's joint sequence: 77 CLIP tokens and 256 T5 tokens
WORKING_FLOOR_BYTES = 64 * MIB  # scheduler state, latents, embeddings, allocator slack
RAM_RESERVE_BYTES = 1024 * MIB  # system RAM left to everything else when groups are kept in RAM


def mib(value: int | None) -> str:
    """Bytes as a short MiB figure for logs ("123 MiB", or "unknown")."""
    return "unknown" if value is None else f"{value / MIB:,.0f} MiB"


@dataclass(frozen=True)
class ComponentFootprint:
    """One component's weights at the dtype it runs in, and its block-level groups.

    top_level_bytes: what block-level group offload keeps in the component's own (unmatched)
    groups, on the device for as long as the component runs; largest_group_bytes: its largest
    block group (0 when it has none, e.g. a text encoder made of one unmatched group).
    """

    name: str
    weights_bytes: int
    top_level_bytes: int = 0
    largest_group_bytes: int = 0
    working_bytes: int = 0  # its activations while it runs, floor excluded (0: not modelled per component)

    @property
    def group_peak_bytes(self) -> int:
        """On the device while this component runs under group offload."""
        return min(self.weights_bytes, self.top_level_bytes + GROUP_RESIDENT_BLOCKS * self.largest_group_bytes)


@dataclass(frozen=True)
class Footprint:
    """What one model needs: its components' weights and the working memory of its largest image."""

    model_id: str
    components: tuple[ComponentFootprint, ...]
    working_bytes: int

    @property
    def weights_bytes(self) -> int:
        return sum(c.weights_bytes for c in self.components)

    @property
    def largest_component_bytes(self) -> int:
        return max((c.weights_bytes for c in self.components), default=0)

    @property
    def largest_group_bytes(self) -> int:
        return max((c.largest_group_bytes for c in self.components), default=0)

    def resident_bytes(self, rung: str) -> int:
        """Device memory the model holds between calls on `rung`."""
        return self.weights_bytes if rung == RUNG_FULL else 0

    def transient_bytes(self, rung: str) -> int:
        """Device memory the model takes only while it runs on `rung`.

        Under offload one component is on the device at a time, with its own activations: the VAE
        decodes after the UNet has left. Where the components carry their own working memory the
        peak is the largest component's (weights, or group peak, plus its activations) plus the
        floor; else the model's whole working memory is added to the largest component."""
        if rung == RUNG_FULL:
            return self.working_bytes
        if rung == RUNG_MODEL_OFFLOAD:
            return self._one_at_a_time(lambda c: c.weights_bytes)
        if rung == RUNG_GROUP_OFFLOAD:
            return self._one_at_a_time(lambda c: c.group_peak_bytes)
        raise ValueError(f"unknown rung {rung!r}")

    def _one_at_a_time(self, on_device: Callable[[ComponentFootprint], int]) -> int:
        if not any(c.working_bytes for c in self.components):
            return max((on_device(c) for c in self.components), default=0) + self.working_bytes
        return max(on_device(c) + c.working_bytes for c in self.components) + WORKING_FLOOR_BYTES

    def needs(self, rung: str) -> int:
        """Device memory the model needs on `rung`, alone on the device."""
        return self.resident_bytes(rung) + self.transient_bytes(rung)


@dataclass(frozen=True)
class RungChoice:
    """Where one model goes, and why. rung None: it fits on no rung and is not served."""

    model_id: str
    rung: str | None
    mode: str
    free_bytes: int | None  # what was free when the choice was made (None: no figure)
    needs: dict[str, int] = field(default_factory=dict)  # the bytes each rung tried would take now
    offload_to_disk: bool = False  # group offload with its groups on disk: RAM is too short

    @property
    def served(self) -> bool:
        return self.rung is not None

    @property
    def reason(self) -> str:
        """One log phrase: the rung and the figures it was chosen by."""
        tried = ", ".join(f"{rung} needs {mib(n)}" for rung, n in self.needs.items())
        if self.free_bytes is None:
            why = ("no VRAM figure (no CUDA device and no --vram-mib): runs as on full residency"
                   if self.mode == MODE_AUTO else f"pinned by MEMORY_MODE={self.mode}, no VRAM figure to check")
            return f"rung {self.rung}: {why}"
        where = f"{mib(self.free_bytes)} free; {tried}"
        if self.rung is None:
            pinned = f" (pinned by MEMORY_MODE={self.mode})" if self.mode != MODE_AUTO else ""
            return f"fits on no rung{pinned}: {where}"
        disk = "; groups offloaded to disk (system RAM too short)" if self.offload_to_disk else ""
        return f"rung {self.rung}: {where}{disk}"


def check_mode(mode: str) -> str:
    if mode not in MEMORY_MODES:
        raise ValueError(f"MEMORY_MODE must be one of {', '.join(MEMORY_MODES)}, got {mode!r}")
    return mode


def candidate_rungs(mode: str) -> tuple[str, ...]:
    """The rungs a model may take: all of them, highest first, under auto; only the pinned one else."""
    return RUNGS if check_mode(mode) == MODE_AUTO else (mode,)


def need_beside(footprint: Footprint, rung: str, transient_pool: int) -> int:
    """Bytes that must be free now for the model on `rung`, next to models already placed whose
    largest transient need is `transient_pool` (transients never overlap: one model runs at a time)."""
    return footprint.resident_bytes(rung) + max(transient_pool, footprint.transient_bytes(rung))


def group_offload_to_disk(weights_bytes: int, ram_free_bytes: int | None) -> bool:
    """Offloaded groups go to disk when system RAM cannot hold them with RAM_RESERVE_BYTES to spare."""
    return ram_free_bytes is not None and ram_free_bytes < weights_bytes + RAM_RESERVE_BYTES


def choose_rung(footprint: Footprint, *, free_bytes: int | None, mode: str = MODE_AUTO, transient_pool: int = 0,
                ram_free_bytes: int | None = None) -> RungChoice:
    """The highest rung `mode` allows that fits in `free_bytes` next to the models already placed.

    free_bytes None (no CUDA and no --vram-mib): nothing to check, so full residency under auto
    and the pinned rung otherwise. ram_free_bytes (None: unknown) decides group offload's disk.
    """
    rungs = candidate_rungs(mode)
    if free_bytes is None:
        rung = rungs[0]
        return RungChoice(footprint.model_id, rung, mode, None, {rung: footprint.needs(rung)},
                          rung == RUNG_GROUP_OFFLOAD and group_offload_to_disk(footprint.weights_bytes, ram_free_bytes))
    needs: dict[str, int] = {}
    for rung in rungs:
        needs[rung] = need_beside(footprint, rung, transient_pool)
        if needs[rung] <= free_bytes:
            to_disk = rung == RUNG_GROUP_OFFLOAD and group_offload_to_disk(footprint.weights_bytes, ram_free_bytes)
            return RungChoice(footprint.model_id, rung, mode, free_bytes, needs, to_disk)
    return RungChoice(footprint.model_id, None, mode, free_bytes, needs)


def host_bytes(footprint: Footprint, rung: str, offload_to_disk: bool) -> int:
    """System RAM the model holds on `rung` next to a CUDA device: offloaded weights wait there."""
    if rung == RUNG_FULL or offload_to_disk:
        return 0
    return footprint.weights_bytes


@dataclass(frozen=True)
class Placed:
    """What the models placed so far hold: the largest transient need (shared: one model runs at a
    time), and the device and host bytes they keep between calls."""

    transient_pool: int = 0
    resident_bytes: int = 0
    host_bytes: int = 0


def place_next(footprint: Footprint, placed: Placed, *, free_bytes: int | None, mode: str = MODE_AUTO,
               ram_free_bytes: int | None = None) -> tuple[RungChoice, Placed]:
    """The next model's rung next to the models `placed` (`free_bytes` and `ram_free_bytes`: what is
    free now, those models' holdings already taken out), and what all of them hold then."""
    choice = choose_rung(footprint, free_bytes=free_bytes, mode=mode, transient_pool=placed.transient_pool,
                         ram_free_bytes=ram_free_bytes)
    if choice.rung is None:
        return choice, placed
    return choice, Placed(max(placed.transient_pool, footprint.transient_bytes(choice.rung)),
                          placed.resident_bytes + footprint.resident_bytes(choice.rung),
                          placed.host_bytes + host_bytes(footprint, choice.rung, choice.offload_to_disk))


def plan_rungs(footprints: Iterable[Footprint], *, free_bytes: int | None, mode: str = MODE_AUTO,
               ram_free_bytes: int | None = None) -> list[RungChoice]:
    """place_next for each model in load order against one budget: a placed model's resident
    weights and RAM leave the budget, its transient need joins the shared pool."""
    choices, placed = [], Placed()
    for footprint in footprints:
        choice, placed = place_next(
            footprint, placed, mode=mode,
            free_bytes=None if free_bytes is None else free_bytes - placed.resident_bytes,
            ram_free_bytes=None if ram_free_bytes is None else ram_free_bytes - placed.host_bytes)
        choices.append(choice)
    return choices


def rung_after_oom(rung: str, mode: str) -> str | None:
    """Where an out-of-memory error moves a model: one rung down under auto; nowhere when its rung
    is pinned or it is already on the lowest (the job then fails)."""
    if check_mode(mode) != MODE_AUTO or rung not in RUNGS:
        return None
    lower = RUNGS.index(rung) + 1
    return RUNGS[lower] if lower < len(RUNGS) else None


def working_parts(*, width: int, height: int, vae_scale_factor: int, unet_channels: Sequence[int],
                  vae_channels: Sequence[int], dtype_bytes: int) -> tuple[int, int]:
    """(UNet's, VAE's) activations for one image of width x height, the floor excluded.

    UNet: at each level i (resolution halved i times from the latents) CFG_BATCH x channels[i] x
    latent pixels / 4**i values, UNET_LIVE_TENSORS of them alive at once. VAE: the decoder (and
    the encoder, mirrored) at level i works at the image's resolution / 2**i with channels[i];
    its largest level, VAE_LIVE_TENSORS times. Attention scores are left out: PyTorch's SDPA does
    not keep them whole.
    """
    image_pixels = width * height
    latent_pixels = image_pixels / max(1, vae_scale_factor) ** 2
    unet = CFG_BATCH * latent_pixels * sum(c / 4**i for i, c in enumerate(unet_channels)) * UNET_LIVE_TENSORS
    vae = image_pixels * max((c / 4**i for i, c in enumerate(vae_channels)), default=0.0) * VAE_LIVE_TENSORS
    return int(unet * dtype_bytes), int(vae * dtype_bytes)


def working_bytes(*, width: int, height: int, vae_scale_factor: int, unet_channels: Sequence[int],
                  vae_channels: Sequence[int], dtype_bytes: int) -> int:
    """Working memory of one image of width x height with every component on the device: the
    larger of the UNet's and the VAE's activations (`working_parts`), plus WORKING_FLOOR_BYTES."""
    return max(working_parts(width=width, height=height, vae_scale_factor=vae_scale_factor,
                             unet_channels=unet_channels, vae_channels=vae_channels,
                             dtype_bytes=dtype_bytes)) + WORKING_FLOOR_BYTES


def transformer_working(*, width: int, height: int, vae_scale_factor: int, patch_size: int, hidden_size: int,
                        dtype_bytes: int, text_tokens: int = TRANSFORMER_TEXT_TOKENS) -> int:
    """A transformer denoiser's (SD3's MMDiT, Flux's) activations for one image, the floor excluded:
    CFG_BATCH x its tokens (latent pixels over patch_size squared, and the text's) x hidden_size,
    TRANSFORMER_LIVE_TENSORS of them alive at once; attention scores left out (SDPA)."""
    latent_pixels = width * height / max(1, vae_scale_factor) ** 2
    tokens = latent_pixels / max(1, patch_size) ** 2 + text_tokens
    return int(CFG_BATCH * tokens * hidden_size * TRANSFORMER_LIVE_TENSORS * dtype_bytes)
