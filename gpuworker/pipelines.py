"""The Stable-Diffusion-style pipeline adapter over real diffusers pipelines: `check_inputs` turns
params into a checked request or fails loudly, `generate` runs numbered steps whose one step callback
calls the job's StepHooks, and `_call` is the one seam where out-of-memory is caught."""
from __future__ import annotations

import logging
import os
import random
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuworker.checkpoints import Checkpoint, Fingerprint, StartSeen, capture_checkpoint, denoising, fingerprint_for
from gpuworker.families import size_multiple
from gpuworker.footprints import default_size
from gpuworker.inputs import (
    ParamsRefused,
    check_schema,
    checked_integer,
    checked_number,
    checked_text,
    decode_image,
    short,
)
from gpuworker.installed import ModelOnDisk
from gpuworker.ladder import Footprint, group_offload_to_disk
from gpuworker.limits import Limits, allowed_maximum
from gpuworker.step_hooks import JobCancelled, PreemptedAtStep, StepBoundary, StepHooks
from gpuworker.vram import available_ram_bytes, give_back_device_memory
from gpuworker.weights import Modules, PipelineLoadError, offload_dir_for, place, read_modules, torch_dtype_for
from potocolom.protocol.browser import DEFAULT_STRENGTH
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

DEFAULT_STEPS = 20
DEFAULT_GUIDANCE_SCALE = 7.5
MAX_SEED = 2**32 - 1
SIZE_MULTIPLE = 8  # diffusers' Stable Diffusion pipelines reject sizes that are not multiples of 8
TEST_OOM_ENV = "POTOCOLOM_TEST_OOM"  # test only: see InjectedOutOfMemory

Fault = Callable[[str], None]  # called with the model_id before each job call of a pipeline (tests inject OOM)


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


class StepCallback:
    """The diffusers call's one `callback_on_step_end`: it tells the job's hooks each step boundary
    in the job's own steps (a resumed job's go on from the checkpoint's), with the job's state there.

    With a resumed job the scheduler holds its full schedule and the call runs the last
    num_timesteps of it, so the scheduler's index is counted from the schedule's end.
    """

    def __init__(self, hooks: StepHooks, pipe: Any, generator: Any, fingerprint: Fingerprint | None, *,
                 done_before: int):
        self.hooks = hooks
        self.generator = generator
        self._scheduler: Any = getattr(pipe, "scheduler", None)  # None: not loaded, and _call says so
        self._fingerprint = fingerprint
        self._done_before = done_before

    @property
    def on_start(self) -> StartSeen | None:
        """checkpoints.denoising's view of the boundary before the first step, when the hooks need it."""
        return self._before_first_step if self.hooks.captures else None

    def __call__(self, pipe: Any, index: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        step, steps = self._done_before + index + 1, self._done_before + int(pipe.num_timesteps)
        done = len(self._scheduler.timesteps) - int(pipe.num_timesteps) + index + 1
        self.hooks.step_end(self._boundary(step, steps, callback_kwargs["latents"], done))
        return callback_kwargs

    def _before_first_step(self, latents: Any, index: int) -> None:
        steps = self._done_before + len(self._scheduler.timesteps) - index
        self.hooks.before_first_step(self._boundary(self._done_before, steps, latents, index))

    def _boundary(self, step: int, steps: int, latents: Any, index: int) -> StepBoundary:
        def capture() -> Checkpoint | None:
            assert self._fingerprint is not None
            return capture_checkpoint(self._scheduler, latents, self.generator, index=index, step=step, steps=steps,
                                      fingerprint=self._fingerprint)

        return StepBoundary(step, steps, latents, capture)


class DiffusersPipeline:
    """A loaded Stable-Diffusion-style pipeline (txt2img, plus img2img sharing its modules) on a rung.

    `fault` is a test seam (see InjectedOutOfMemory); `footprint` what the memory ladder measured;
    `limits` the worker's caps on images, sizes and steps (limits.py; default: the environment's).
    """

    def __init__(self, model: ModelOnDisk, pipe: Any, img2img: Any | None, device: str, rung: str,
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
    def load(cls, model: ModelOnDisk, device: str, rung: str = RUNG_FULL, *, offload_dir: str | None = None,
             fault: Fault | None = None, footprint: Footprint | None = None,
             limits: Limits | None = None) -> DiffusersPipeline:
        """Read the model from its source and place it on `rung` on `device`."""
        return cls.placed(model, read_modules(model, device), device, rung, offload_dir=offload_dir, fault=fault,
                          footprint=footprint, limits=limits)

    @classmethod
    def placed(cls, model: ModelOnDisk, modules: Modules, device: str, rung: str, *,
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
            detail = short(" ".join(str(exc).split()))
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
            raise ParamsRefused(f"params must be a JSON object, got {type(params).__name__}")
        check_schema(self.model.params_schema, params)
        prompt = checked_text(params, "prompt", required=True)
        assert prompt is not None
        negative_prompt = checked_text(params, "negative_prompt", required=False)
        # Where the schema sets no maximum, MAX_IMAGE_SIDE and MAX_STEPS do: the memory ladder
        # placed the model for the largest size allowed, so nothing larger may run.
        schema, limits = self.model.params_schema, self.limits
        multiple = self._size_multiple  # 8; an SD3 or Flux transformer's latent patch may ask for more
        width = checked_integer(params, "width", self.default_size, multiple,
                                allowed_maximum(schema, "width", limits.max_image_side))
        height = checked_integer(params, "height", self.default_size, multiple,
                                 allowed_maximum(schema, "height", limits.max_image_side))
        for key, size in (("width", width), ("height", height)):
            if size % multiple:
                raise ParamsRefused(f"{key} must be a multiple of {multiple}, got {size}")
        most_steps = allowed_maximum(schema, "steps", limits.max_steps)
        steps = checked_integer(params, "steps", min(DEFAULT_STEPS, most_steps), 1, most_steps)
        guidance_scale = checked_number(params, "guidance_scale", DEFAULT_GUIDANCE_SCALE, 0.0, None)
        seed = checked_integer(params, "seed", random.randint(0, MAX_SEED), 0, MAX_SEED)
        strength = checked_number(params, "strength", DEFAULT_STRENGTH, 0.0, 1.0)
        init_image = None
        if params.get("init_image") is not None:
            if "img2img" not in self.model.capabilities:
                raise ParamsRefused(f"model {self.model.model_id} does not do img2img (init_image given)")
            if int(steps * strength) < 1:
                raise ParamsRefused(f"img2img runs int(steps x strength) steps: {steps} x {strength} is none")
            init_image = decode_image(params["init_image"], max_pixels=self.limits.max_image_pixels)
            if init_image.size != (width, height):
                init_image = init_image.resize((width, height), resample=3)  # 3: bicubic
        return GenerationRequest(prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
                                 steps=steps, guidance_scale=guidance_scale, seed=seed, strength=strength,
                                 init_image=init_image)

    def generate(self, params: Any, *, hooks: StepHooks | None = None,
                 resume: Checkpoint | None = None) -> list[Image]:
        """Run one job; its images, each exactly width x height, whatever `hooks` do at its step
        boundaries; `resume`d from a checkpoint, the images of the uninterrupted run."""
        import torch

        hooks = hooks or StepHooks()
        # 1. Check the params and fill in the defaults.
        request = self.check_inputs(params)
        # 2. What a checkpoint of this job is valid for: a resumed one must have been taken for it.
        fingerprint = self._fingerprint(request) if resume is not None or hooks.captures else None
        if resume is not None:
            assert fingerprint is not None
            resume.check_fits(fingerprint)
        # 3. A CPU generator: the same seed gives the same noise on any device (on resume: as it was).
        generator = torch.Generator("cpu").manual_seed(request.seed) if resume is None else resume.generator()
        # 4. txt2img, or img2img with an init image; a resumed img2img job is past the only step where
        #    they differ, so it goes on with txt2img.
        pipe = self.pipe if request.init_image is None or resume is not None else self.img2img
        callback = StepCallback(hooks, pipe, generator, fingerprint, done_before=0 if resume is None else resume.step)
        # 5. Denoise, the callback calling the hooks at each step boundary.
        output = self._denoise(pipe, request, callback, resume)
        # 6. Exactly the requested size (the VAE's output already is, for sizes the checks allow).
        size = (request.width, request.height)
        return [image if image.size == size else image.resize(size, resample=3) for image in output.images]

    def _denoise(self, pipe: Any, request: GenerationRequest, callback: StepCallback,
                 resume: Checkpoint | None) -> Any:
        """The diffusers call. An interrupted job has no result: nothing is decoded, and the offload
        hooks are put back as a finished call would."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "num_inference_steps": request.steps, "guidance_scale": request.guidance_scale,
            "generator": callback.generator, "callback_on_step_end": callback}
        if request.init_image is None or resume is not None:
            kwargs.update(height=request.height, width=request.width)
        else:
            kwargs.update(image=request.init_image, strength=request.strength)
        try:
            with denoising(pipe, resume=resume, on_start=callback.on_start):
                return self._call(pipe, **kwargs)
        except (JobCancelled, PreemptedAtStep):
            if pipe is not None:
                pipe.maybe_free_model_hooks()
            raise

    def _fingerprint(self, request: GenerationRequest) -> Fingerprint:
        """What a checkpoint of `request` on this pipeline is valid for (img2img shares the scheduler)."""
        if self.pipe is None:
            raise PipelineLoadError(f"model {self.model.model_id} is not loaded (its reload failed)")
        strength = None if request.init_image is None else request.strength
        return fingerprint_for(self.pipe.scheduler, steps=request.steps, strength=strength, width=request.width,
                               height=request.height, device=self.device, dtype=torch_dtype_for(self.device))

    def generate_frames(self, request: FrameRequest) -> list[Image]:
        """One batch of realtime frames in one img2img call: an image per frame, each width x height."""
        import torch

        if self.frames is None:
            raise ParamsRefused(f"model {self.model.model_id} does not do img2img, so it serves no frames")
        size = (request.width, request.height)
        images = [image if image.size == size else image.resize(size, resample=3) for image in request.images]
        # A generator per frame gives each frame the noise it would get alone: its pixels do not depend
        # on its batch (up to float rounding in the batched UNet).
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in request.seeds]
        output = self.frames(prompt=list(request.prompts), image=images, strength=request.strength,
                             num_inference_steps=request.steps, guidance_scale=request.guidance_scale,
                             generator=generators)
        return [image if image.size == size else image.resize(size, resample=3) for image in output.images]
