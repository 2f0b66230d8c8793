"""The Stable-Diffusion-style pipeline adapter over real diffusers pipelines: `check_inputs` turns
params into a checked request or fails loudly, `generate` runs numbered steps with progress and
interruption in the step callback, and `_call` is the one seam where out-of-memory is caught."""
from __future__ import annotations

import io
import logging
import os
import random
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuworker.checkpoints import Checkpoint, Fingerprint, capture_checkpoint, denoising, fingerprint_for
from gpuworker.families import family_of, size_multiple  # noqa: F401  (family_of re-exported: for previews)
from gpuworker.footprints import default_size
from gpuworker.installed import InstalledModel
from gpuworker.ladder import Footprint, group_offload_to_disk
from gpuworker.limits import Limits, allowed_maximum
from gpuworker.vram import available_ram_bytes, give_back_device_memory
from gpuworker.weights import (  # noqa: F401  (re-exported: the adapter's public names)
    Modules,
    PipelineLoadError,
    img2img_class,
    offload_dir_for,
    place,
    read_modules,
    torch_dtype_for,
)
from potocolom.protocol.browser import DEFAULT_STRENGTH
from potocolom.protocol.images import FORMATS, ImageRefused, checked_image
from potocolom.protocol.params import params_error
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

DEFAULT_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 7.5
MAX_SEED = 2**32 - 1
SIZE_MULTIPLE = 8  # diffusers' Stable Diffusion pipelines reject sizes that are not multiples of 8
TEST_OOM_ENV = "POTOCOLOM_TEST_OOM"  # test only: see InjectedOutOfMemory
_MESSAGE_CHARS = 300  # error messages travel in job_failed; an echoed init_image must not

OnStep = Callable[[int, int], None]
OnLatents = Callable[[int, int, Any], None]  # (step, steps, latents) just before on_step: previews.py
ShouldStop = Callable[[], bool]
OnCheckpoint = Callable[[Checkpoint | None], None]
Fault = Callable[[str], None]  # called with the model_id before each job call of a pipeline (tests inject OOM)


class InvalidParams(ValueError):
    """A job's params that this pipeline cannot run."""


class JobCancelled(Exception):
    """The job was interrupted on request, at a step boundary, before its image was decoded."""


class _StopAtStep(Exception):
    """Raised from the step callback to leave the diffusers call at once: `pipe._interrupt` only
    skips the remaining steps, and the VAE would still decode (seconds at 512x512 on a GPU)."""


class JobPreempted(Exception):
    """The job was stopped on request at a step boundary to run later from `checkpoint` (None when its
    scheduler cannot be resumed exactly: it then restarts from step 0), before its image was decoded."""

    def __init__(self, step: int, steps: int, checkpoint: Checkpoint | None):
        super().__init__(f"preempted after step {step} of {steps}")
        self.step, self.steps, self.checkpoint = step, steps, checkpoint


class OutOfMemory(RuntimeError):
    """The device ran out of memory while a job ran (torch.OutOfMemoryError, memory given back)."""


@dataclass(frozen=True)
class FrameRequest:
    """One batched img2img call for realtime frames: one prompt, init image and seed per frame.

    `strength` is one per call (diffusers takes one); frames.py groups frames so that every
    frame's own strength gives the same denoising steps as this one (see frames.denoise_steps).
    """

    prompts: list[str]
    images: list[Image]
    seeds: list[int]
    width: int
    height: int
    steps: int
    guidance_scale: float
    strength: float


@dataclass(frozen=True)
class GenerationRequest:
    """A job's params after `check_inputs`, with the defaults filled in."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    strength: float
    init_image: Image | None  # already resized to width x height; None means txt2img


def _short(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


def _integer(params: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParams(f"{key} must be an integer, got {_short(repr(value))}")
    if not low <= value <= high:
        raise InvalidParams(f"{key} must be between {low} and {high}, got {value}")
    return value


def _number(params: dict[str, Any], key: str, default: float, low: float, high: float | None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParams(f"{key} must be a number, got {_short(repr(value))}")
    if value < low or (high is not None and value > high):
        raise InvalidParams(f"{key} must be between {low} and {high if high is not None else 'any'}, got {value}")
    return float(value)


def _text(params: dict[str, Any], key: str, *, required: bool) -> str | None:
    value = params.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise InvalidParams(f"{key} must be a string, got {_short(repr(value))}")
    return value


def checked_image_bytes(value: Any, *, max_pixels: int, what: str = "init_image") -> bytes:
    """The bytes of a base64 (or `data:` URL) PNG, JPEG or WebP declaring at most `max_pixels`
    pixels, checked from its header alone (a bomb is refused in microseconds); InvalidParams else."""
    if not isinstance(value, str):
        raise InvalidParams(f"{what} must be a base64 string, got {type(value).__name__}")
    try:
        data, _ = checked_image(value, max_pixels=max_pixels)
    except ImageRefused as exc:
        raise InvalidParams(f"{what}: {exc}") from None
    return data


def open_image(data: bytes, *, max_pixels: int, what: str = "init_image") -> Image:
    """Decode checked bytes (checked_image_bytes) to an RGB PIL image, PNG, JPEG or WebP only."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data), formats=list(FORMATS)) as opened:
            pixels = opened.width * opened.height
            if pixels <= max_pixels:  # checked already: never decode a bomb, whoever calls this
                return opened.convert("RGB")
    except (ValueError, UnidentifiedImageError, OSError, PILImage.DecompressionBombError) as exc:
        raise InvalidParams(f"{what} is not a readable image: {_short(str(exc))}") from None
    raise InvalidParams(f"{what}: the image declares {pixels} pixels, more than {max_pixels}")


def decode_image(value: Any, *, max_pixels: int, what: str = "init_image") -> Image:
    """An RGB PIL image from base64 (PNG, JPEG or WebP) with or without a `data:` URL prefix,
    refused from its header when it declares more than `max_pixels` pixels."""
    return open_image(checked_image_bytes(value, max_pixels=max_pixels, what=what), max_pixels=max_pixels,
                      what=what)


def check_schema(schema: dict[str, Any], params: Any) -> None:
    """Validate params against the manifest's params_schema (potocolom.protocol.params) with a short message."""
    error = params_error(schema, params)
    if error is not None:
        where, message = error
        raise InvalidParams(f"{where}: {_short(message)}")


class InjectedOutOfMemory:
    """Test only: raises torch.OutOfMemoryError in place of the next `count` job calls of `model_id`.

    CUDA out-of-memory errors cannot be had on a CPU machine, so tests inject them at the one seam
    where a job calls its pipeline (DiffusersPipeline._call). In-process tests pass one to
    DiffusersPipeline; a test running a real worker process sets POTOCOLOM_TEST_OOM=MODEL_ID:COUNT
    (read once, by the worker's start-up: `from_env`). Never set it in production.
    """

    def __init__(self, counts: dict[str, int]):
        self.counts = dict(counts)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> InjectedOutOfMemory | None:
        text = environ.get(TEST_OOM_ENV, "").strip()
        if not text:
            return None
        counts = {}
        for part in text.split(","):
            model_id, _, count = part.strip().rpartition(":")
            if not model_id or not count.isdigit():
                raise ValueError(f"{TEST_OOM_ENV} must be MODEL_ID:COUNT[,...], got {text!r}")
            counts[model_id] = int(count)
        log.warning("%s is set: injecting out-of-memory errors into jobs (%s); a test setting only", TEST_OOM_ENV,
                    text)
        return cls(counts)

    def __call__(self, model_id: str) -> None:
        import torch

        with self._lock:
            left = self.counts.get(model_id, 0)
            if left <= 0:
                return
            self.counts[model_id] = left - 1
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by a test, {left - 1} more to come)")


class DiffusersPipeline:
    """A loaded Stable-Diffusion-style pipeline (txt2img, plus img2img sharing its modules) on a rung.

    `fault` is a test seam (see InjectedOutOfMemory); `footprint` what the memory ladder measured;
    `limits` the worker's caps on images, sizes and steps (limits.py; default: the environment's).
    """

    def __init__(self, model: InstalledModel, pipe: Any, img2img: Any | None, device: str, rung: str,
                 frames: Any | None = None, *, fault: Fault | None = None, footprint: Footprint | None = None,
                 offload_dir: str | None = None, limits: Limits | None = None):
        self.model = model
        self.limits = limits or Limits.from_env()
        self.pipe = pipe
        self.img2img = img2img
        self.frames = frames  # img2img for realtime frames, with its own scheduler (see generate_frames)
        self.device = device
        self.rung = rung
        self.fault = fault
        self.footprint = footprint
        self.offload_dir = offload_dir  # group offload's safetensors files, when on disk
        self._default_size: int | None = None
        self._size_multiple = SIZE_MULTIPLE
        if pipe is not None:
            self._default_size = default_size(pipe)
            self._size_multiple = size_multiple(pipe, SIZE_MULTIPLE)

    @classmethod
    def load(cls, model: InstalledModel, device: str, rung: str = RUNG_FULL, *, offload_dir: str | None = None,
             fault: Fault | None = None, footprint: Footprint | None = None,
             limits: Limits | None = None) -> DiffusersPipeline:
        """Read the model from its source and place it on `rung` on `device`."""
        return cls.placed(model, read_modules(model, device), device, rung, offload_dir=offload_dir, fault=fault,
                          footprint=footprint, limits=limits)

    @classmethod
    def placed(cls, model: InstalledModel, modules: Modules, device: str, rung: str, *,
               offload_dir: str | None = None, fault: Fault | None = None,
               footprint: Footprint | None = None, limits: Limits | None = None) -> DiffusersPipeline:
        """Place modules already read (read_modules) on `rung`."""
        place(modules.pipes, device, rung, offload_dir=offload_dir)
        return cls(model, modules.pipe, modules.img2img, device, rung, modules.frames, fault=fault,
                   footprint=footprint, offload_dir=offload_dir, limits=limits)

    def release(self) -> None:
        """Drop this model's modules and give their device memory back (the other models stay)."""

        self.pipe = self.img2img = self.frames = None
        give_back_device_memory(self.device)
        if self.offload_dir is not None:
            shutil.rmtree(self.offload_dir, ignore_errors=True)
            self.offload_dir = None

    def move_to(self, rung: str) -> None:
        """Free the modules, read the model again from its source and place it on `rung` (after an
        out-of-memory error: a clean reload leaves no hooks or half-moved modules behind)."""
        self.release()
        to_disk = (rung == RUNG_GROUP_OFFLOAD and self.footprint is not None
                   and group_offload_to_disk(self.footprint.weights_bytes, available_ram_bytes()))
        offload_dir = offload_dir_for(self.model.model_id, to_disk)
        modules = read_modules(self.model, self.device)
        place(modules.pipes, self.device, rung, offload_dir=offload_dir)
        self.pipe, self.img2img, self.frames = modules.pipe, modules.img2img, modules.frames
        self.rung, self.offload_dir = rung, offload_dir

    def _call(self, pipe: Any, **kwargs: Any) -> Any:
        """The one place a job calls its diffusers pipeline. torch's out-of-memory error leaves as
        OutOfMemory once the failed call's memory is given back; a test's fault is raised here."""
        import torch

        if pipe is None:
            raise PipelineLoadError(f"model {self.model.model_id} is not loaded (its reload failed)")
        try:
            if self.fault is not None:
                self.fault(self.model.model_id)
            return pipe(**kwargs)
        except torch.OutOfMemoryError as exc:
            detail = _short(" ".join(str(exc).split()))
        # Out of the except block: the failed call's frames, and the tensors they held, are gone.
        give_back_device_memory(self.device)
        raise OutOfMemory(detail)

    @property
    def default_size(self) -> int:
        """The pipeline's own default width and height: UNet sample size times the VAE's scale.

        Kept from the first load: params are checked on the event loop, also while the denoising
        thread reloads the model on another rung (when its modules are briefly gone)."""
        if self._default_size is None:
            self._default_size = default_size(self.pipe)
        return self._default_size

    def check_inputs(self, params: Any) -> GenerationRequest:
        """Validate a job's params against the manifest schema and what the pipeline can run."""
        if not isinstance(params, dict):
            raise InvalidParams(f"params must be a JSON object, got {type(params).__name__}")
        check_schema(self.model.params_schema, params)
        prompt = _text(params, "prompt", required=True)
        assert prompt is not None
        negative_prompt = _text(params, "negative_prompt", required=False)
        # Where the schema sets no maximum, MAX_IMAGE_SIDE and MAX_STEPS do: the memory ladder
        # placed the model for the largest size allowed, so nothing larger may run.
        schema, limits = self.model.params_schema, self.limits
        multiple = self._size_multiple  # 8; an SD3 or Flux transformer's latent patch may ask for more
        width = _integer(params, "width", self.default_size, multiple,
                         allowed_maximum(schema, "width", limits.max_image_side))
        height = _integer(params, "height", self.default_size, multiple,
                          allowed_maximum(schema, "height", limits.max_image_side))
        for key, size in (("width", width), ("height", height)):
            if size % multiple:
                raise InvalidParams(f"{key} must be a multiple of {multiple}, got {size}")
        steps = _integer(params, "steps", min(DEFAULT_STEPS, allowed_maximum(schema, "steps", limits.max_steps)), 1,
                         allowed_maximum(schema, "steps", limits.max_steps))
        guidance_scale = _number(params, "guidance_scale", DEFAULT_GUIDANCE_SCALE, 0.0, None)
        seed = _integer(params, "seed", random.randint(0, MAX_SEED), 0, MAX_SEED)
        strength = _number(params, "strength", DEFAULT_STRENGTH, 0.0, 1.0)
        init_image = None
        if params.get("init_image") is not None:
            if "img2img" not in self.model.capabilities:
                raise InvalidParams(f"model {self.model.model_id} does not do img2img (init_image given)")
            if int(steps * strength) < 1:
                raise InvalidParams(f"img2img runs int(steps x strength) steps: {steps} x {strength} is none")
            init_image = decode_image(params["init_image"], max_pixels=self.limits.max_image_pixels)
            if init_image.size != (width, height):
                init_image = init_image.resize((width, height), resample=3)  # 3: bicubic
        return GenerationRequest(prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
                                 steps=steps, guidance_scale=guidance_scale, seed=seed, strength=strength,
                                 init_image=init_image)

    def generate(self, params: Any, *, on_step: OnStep | None = None, should_stop: ShouldStop | None = None,
                 resume: Checkpoint | None = None, capture: ShouldStop | None = None,
                 on_checkpoint: OnCheckpoint | None = None, preempt: ShouldStop | None = None,
                 on_latents: OnLatents | None = None) -> list[Image]:
        """Run one job; return its images, each exactly width x height.

        A seeded txt2img job is exactly this diffusers call (defaults: steps 20, guidance 7.5,
        width and height `default_size`, negative_prompt None):

            pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                 num_inference_steps=steps, guidance_scale=guidance_scale,
                 generator=torch.Generator("cpu").manual_seed(seed)).images

        with `pipe = StableDiffusionPipeline.from_pretrained(source)` on CPU (float32). On CUDA the
        worker loads with `dtype=torch.float16` and `pipe.to(device)`; compare against that. An img2img
        job (init_image given) is `img2img(prompt=..., negative_prompt=..., image=init_image,
        strength=strength (default 0.8), num_inference_steps=steps, guidance_scale=...,
        generator=...)` with `img2img = StableDiffusionImg2ImgPipeline.from_pipe(pipe)` and the
        init image resized to width x height (bicubic).
        The step callback changes nothing in the latents, so the pixels are the same.

        on_step(step, steps) is called after each denoising step (1-based); when should_stop()
        turns true the call is left at that step boundary (raising out of the step callback, so the
        VAE never decodes) and JobCancelled is raised. on_latents(step, steps, latents), when given,
        comes just before each on_step with the step's latents (read only: a job's preview).

        Checkpoints (checkpoints.py): at each step boundary, from the one before the first step to
        the one after the last, preempt() is polled (when given): true leaves the call there with
        JobPreempted, carrying a checkpoint (None when the scheduler cannot be resumed exactly);
        else capture() is polled: true hands on_checkpoint a checkpoint (or None) and the job goes
        on. `resume` continues a job from a checkpoint taken for the same params, scheduler, device
        and software (CheckpointMismatch otherwise): its steps run from step k+1, on_step counts on
        from k+1, and the images are those of the uninterrupted run. A resumed img2img job runs on
        the txt2img pipeline: past its start, the img2img denoising loop is the same.
        """
        import torch

        # 1. Check the params and fill in the defaults.
        request = self.check_inputs(params)
        fingerprint = None
        if resume is not None or capture is not None or preempt is not None:
            fingerprint = self._fingerprint(request)
        if resume is not None:
            assert fingerprint is not None
            resume.check_fits(fingerprint)
        # 2. A CPU generator: the same seed gives the same noise on any device (on resume: as it was).
        generator = torch.Generator("cpu").manual_seed(request.seed) if resume is None else resume.generator()
        done_before = 0 if resume is None else resume.step
        pipe = self.pipe if request.init_image is None or resume is not None else self.img2img
        scheduler: Any = getattr(pipe, "scheduler", None)  # None: not loaded, and _call says so

        # 3. At a step boundary: leave with a checkpoint when preempted, or hand one on when asked.
        def at_boundary(step: int, steps: int, latents: Any, index: int) -> None:
            def checkpoint() -> Checkpoint | None:
                assert fingerprint is not None
                return capture_checkpoint(scheduler, latents, generator, index=index, step=step, steps=steps,
                                          fingerprint=fingerprint)

            if preempt is not None and preempt():
                raise JobPreempted(step, steps, checkpoint())
            if capture is not None and capture() and on_checkpoint is not None:
                on_checkpoint(checkpoint())

        def start_seen(latents: Any, index: int) -> None:
            at_boundary(done_before, done_before + len(scheduler.timesteps) - index, latents, index)

        # 4. Report each step, and leave the call at the step boundary when asked to stop.
        def step_end(pipe: Any, index: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            if should_stop is not None and should_stop():
                raise _StopAtStep()
            step, steps = done_before + index + 1, done_before + int(pipe.num_timesteps)
            if on_latents is not None:
                on_latents(step, steps, callback_kwargs["latents"])
            if on_step is not None:
                on_step(step, steps)
            if should_stop is not None and should_stop():
                raise _StopAtStep()  # asked while on_step ran (frames between steps, a cancel)
            if capture is not None or preempt is not None:
                # The scheduler holds the job's full schedule; this call runs its last num_timesteps.
                done = len(scheduler.timesteps) - int(pipe.num_timesteps) + index + 1
                at_boundary(step, steps, callback_kwargs["latents"], done)
            return callback_kwargs

        common = {"prompt": request.prompt, "negative_prompt": request.negative_prompt,
                  "num_inference_steps": request.steps, "guidance_scale": request.guidance_scale,
                  "generator": generator, "callback_on_step_end": step_end}
        watching = capture is not None or preempt is not None
        # 5. Denoise: txt2img without an init image, img2img with one. An interrupted job has no
        #    result: nothing is decoded, and the offload hooks are put back as a finished call would.
        try:
            with denoising(pipe, resume=resume, on_start=start_seen if watching else None):
                if request.init_image is None or resume is not None:
                    output = self._call(pipe, height=request.height, width=request.width, **common)
                else:
                    output = self._call(pipe, image=request.init_image, strength=request.strength, **common)
        except _StopAtStep:
            if pipe is not None:
                pipe.maybe_free_model_hooks()
            raise JobCancelled() from None
        except JobPreempted:
            if pipe is not None:
                pipe.maybe_free_model_hooks()
            raise
        # 6. Exactly the requested size (the VAE's output already is, for sizes the checks allow).
        size = (request.width, request.height)
        return [image if image.size == size else image.resize(size, resample=3) for image in output.images]

    def _fingerprint(self, request: GenerationRequest) -> Fingerprint:
        """What a checkpoint of `request` on this pipeline is valid for (img2img shares the scheduler)."""
        if self.pipe is None:
            raise PipelineLoadError(f"model {self.model.model_id} is not loaded (its reload failed)")
        strength = None if request.init_image is None else request.strength
        return fingerprint_for(self.pipe.scheduler, steps=request.steps, strength=strength, width=request.width,
                               height=request.height, device=self.device, dtype=torch_dtype_for(self.device))

    def generate_frames(self, request: FrameRequest) -> list[Image]:
        """Run one batch of realtime frames; return one image per frame, each width x height.

        It is one diffusers call on the frames pipeline (img2img sharing the loaded modules):

            frames(prompt=prompts, image=images, strength=strength, num_inference_steps=steps,
                   guidance_scale=guidance_scale,
                   generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds])

        with each init image resized to width x height (bicubic). A per-frame generator gives each
        frame the noise it would get alone, so a frame's pixels do not depend on its batch
        (up to float rounding in the batched UNet).
        """
        import torch

        if self.frames is None:
            raise InvalidParams(f"model {self.model.model_id} does not do img2img, so it serves no frames")
        size = (request.width, request.height)
        images = [image if image.size == size else image.resize(size, resample=3) for image in request.images]
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in request.seeds]
        output = self.frames(prompt=list(request.prompts), image=images, strength=request.strength,
                             num_inference_steps=request.steps, guidance_scale=request.guidance_scale,
                             generator=generators)
        return [image if image.size == size else image.resize(size, resample=3) for image in output.images]
