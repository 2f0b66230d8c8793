"""A denoising job's state at a step boundary (latents, scheduler state, CPU generator state) as one
safetensors blob that a later call resumes from to give the uninterrupted run's pixels, and `denoising`,
which narrows one pipeline call to resume; docs/protocol.md, `job_checkpoint` and `preempt`."""
from __future__ import annotations

import base64
import binascii
import hashlib
import inspect
import json
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = 1
MAX_CHECKPOINT_CHARS = 8 * 2**20  # the wire's limit on a checkpoint's base64 text (docs/protocol.md)
MAX_BLOB_BYTES = MAX_CHECKPOINT_CHARS // 4 * 3  # the largest blob whose base64 fits that limit
_HEADER_KEY = "potocolom.checkpoint"
_LATENTS, _GENERATOR, _HISTORY = "latents", "generator", "history."

# What each scheduler's step reads besides its config and the schedule set_timesteps rebuilds.
# Only these exact classes: a subclass may keep state of its own that we would not carry.
_INDEXED = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "LCMScheduler",
            "FlowMatchEulerDiscreteScheduler")  # the step index (each draws its noise from the generator)
_BY_TIMESTEP = ("DDIMScheduler",)  # nothing: its step reads only the timestep it is given
_MULTISTEP = ("DPMSolverMultistepScheduler",)  # the step index, model_outputs and lower_order_nums
SUPPORTED_SCHEDULERS = _INDEXED + _BY_TIMESTEP + _MULTISTEP

StartSeen = Callable[["torch.Tensor", int], None]  # (latents before the first step, scheduler index)


class CheckpointRefused(ValueError):
    """A checkpoint blob that is malformed, too large, or of another format."""


class CheckpointMismatch(CheckpointRefused):
    """A checkpoint taken for another job shape, scheduler, device or software: it cannot resume this job."""


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint is valid for: resuming under anything else would not give the same pixels."""

    scheduler: str  # the scheduler's class name
    scheduler_config: str  # a digest of its config (solver order, sigmas, ...)
    steps: int  # num_inference_steps
    strength: float | None  # img2img's strength (where its schedule starts); None for txt2img
    width: int
    height: int
    torch: str
    diffusers: str
    device: str  # "cpu", or "cuda:" and the GPU's name: kernels differ between GPU models
    dtype: str

    def differences(self, other: Fingerprint) -> list[str]:
        """Each field that differs, said as `name: ours != theirs`."""
        return [f"{field.name}: {getattr(self, field.name)!r} != {getattr(other, field.name)!r}"
                for field in fields(self) if getattr(self, field.name) != getattr(other, field.name)]


@dataclass(frozen=True)
class SchedulerState:
    """A scheduler's own state at a step boundary, beyond what set_timesteps rebuilds from its config."""

    index: int  # steps of the full schedule done: the index of the next step
    lower_order_nums: int = 0  # DPMSolver multistep: how many earlier outputs its next update may use
    history: tuple[torch.Tensor | None, ...] = ()  # DPMSolver multistep: its model_outputs


@dataclass(frozen=True)
class Checkpoint:
    """A job's state at the boundary after `step` of its `steps` denoising steps (both as progress
    counts them: an img2img job's steps are the int(steps x strength) it runs)."""

    step: int
    steps: int
    latents: torch.Tensor  # on the CPU, in the pipeline's dtype
    scheduler: SchedulerState
    generator_state: torch.Tensor  # torch.Generator("cpu").get_state(): uint8
    fingerprint: Fingerprint

    def check_fits(self, fingerprint: Fingerprint) -> None:
        """Raise CheckpointMismatch unless this checkpoint was taken for `fingerprint`."""
        differences = self.fingerprint.differences(fingerprint)
        if differences:
            raise CheckpointMismatch("the checkpoint was taken for another job or worker ("
                                     + "; ".join(differences) + ", checkpoint != this job)")

    def generator(self) -> torch.Generator:
        """A CPU generator in the state it had at this boundary."""
        import torch

        generator = torch.Generator("cpu")
        generator.set_state(self.generator_state.clone())
        return generator

    def to_blob(self) -> bytes:
        """The checkpoint as safetensors bytes; CheckpointRefused when over MAX_BLOB_BYTES."""
        # safetensors, not torch.save: no pickle at all, so a malformed or hostile blob can never run
        # code, and its header is bounded JSON that from_blob checks field by field.
        from safetensors.torch import save

        tensors = {_LATENTS: self.latents, _GENERATOR: self.generator_state}
        for position, output in enumerate(self.scheduler.history):
            if output is not None:
                tensors[f"{_HISTORY}{position}"] = output
        header = {"format": FORMAT, "step": self.step, "steps": self.steps, "channels_last": _channels_last(tensors),
                  "scheduler": {"index": self.scheduler.index, "lower_order_nums": self.scheduler.lower_order_nums,
                                "history": [output is not None for output in self.scheduler.history]},
                  "fingerprint": asdict(self.fingerprint)}
        metadata = {_HEADER_KEY: json.dumps(header, separators=(",", ":"))}
        blob = save({name: tensor.contiguous() for name, tensor in tensors.items()}, metadata=metadata)
        if len(blob) > MAX_BLOB_BYTES:
            raise CheckpointRefused(f"the checkpoint is {len(blob)} bytes, more than {MAX_BLOB_BYTES}")
        return blob

    def to_base64(self) -> str:
        """The blob as the wire's base64 text (at most MAX_CHECKPOINT_CHARS)."""
        return base64.b64encode(self.to_blob()).decode("ascii")

    @classmethod
    def from_base64(cls, text: Any) -> Checkpoint:
        """The checkpoint in the wire's base64 text; CheckpointRefused for anything else."""
        if not isinstance(text, str):
            raise CheckpointRefused(f"a checkpoint must be a base64 string, got {type(text).__name__}")
        if len(text) > MAX_CHECKPOINT_CHARS:
            raise CheckpointRefused(f"the checkpoint is {len(text)} characters, more than {MAX_CHECKPOINT_CHARS}")
        try:
            blob = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointRefused("the checkpoint is not valid base64") from None
        return cls.from_blob(blob)

    @classmethod
    def from_blob(cls, blob: Any) -> Checkpoint:
        """Read a blob written by to_blob, checking its size, header and tensors; CheckpointRefused else."""
        if not isinstance(blob, (bytes, bytearray)):
            raise CheckpointRefused(f"a checkpoint blob must be bytes, got {type(blob).__name__}")
        if len(blob) > MAX_BLOB_BYTES:
            raise CheckpointRefused(f"the checkpoint is {len(blob)} bytes, more than {MAX_BLOB_BYTES}")
        header = _read_header(bytes(blob))
        tensors = _read_tensors(bytes(blob))
        return _checkpoint_from(header, tensors)


def fingerprint_for(scheduler: Any, *, steps: int, strength: float | None, width: int, height: int,
                    device: str, dtype: Any) -> Fingerprint:
    """The fingerprint of a job run by `scheduler` on `device` in `dtype`."""
    import diffusers
    import torch

    config = {key: value for key, value in dict(scheduler.config).items() if not key.startswith("_")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Fingerprint(scheduler=type(scheduler).__name__, scheduler_config=digest, steps=steps, strength=strength,
                       width=width, height=height, torch=torch.__version__, diffusers=diffusers.__version__,
                       device=device_kind(device), dtype=str(dtype))


def device_kind(device: str) -> str:
    """"cpu", or the device type and, for CUDA, the GPU's name (the same model gives the same kernels)."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return kind


def _scheduler_class(scheduler: Any) -> str | None:
    """The name of one of the supported diffusers classes that `scheduler` is exactly, else None."""
    import diffusers

    name = type(scheduler).__name__
    if name in SUPPORTED_SCHEDULERS and type(scheduler) is getattr(diffusers, name, None):
        return name
    return None


def capture_scheduler(scheduler: Any, index: int) -> SchedulerState | None:
    """The state of `scheduler` after `index` steps of its full schedule, or None when it cannot be
    resumed exactly (a class not listed, a multi-order scheduler, an index its own disagrees with)."""
    name = _scheduler_class(scheduler)
    if name is None or getattr(scheduler, "order", 1) != 1 or not 0 <= index <= len(scheduler.timesteps):
        return None
    if name in _BY_TIMESTEP:
        return SchedulerState(index=index)
    # Before a call's first step the scheduler has no step index yet, only where it will begin.
    where = scheduler.step_index if scheduler.step_index is not None else (scheduler.begin_index or 0)
    if where != index:
        return None  # the pipeline and the scheduler disagree on where the job is: do not guess
    if name in _INDEXED:
        return SchedulerState(index=index)
    history = tuple(None if output is None else output.detach().to("cpu", copy=True)
                    for output in scheduler.model_outputs)
    return SchedulerState(index=index, lower_order_nums=int(scheduler.lower_order_nums), history=history)


def restore_scheduler(scheduler: Any, state: SchedulerState, device: Any) -> None:
    """Put `state` back on a scheduler whose set_timesteps has just run for the job's full schedule
    (set_timesteps resets the index and the history, so this comes after it)."""
    name = _scheduler_class(scheduler)
    if name is None:
        raise CheckpointMismatch(f"scheduler {type(scheduler).__name__} cannot be resumed")
    if name in _BY_TIMESTEP:
        return
    scheduler.set_begin_index(state.index)
    if name in _MULTISTEP:
        if len(state.history) != len(scheduler.model_outputs):
            raise CheckpointMismatch(f"the checkpoint holds {len(state.history)} model outputs, the scheduler "
                                     f"keeps {len(scheduler.model_outputs)}")
        scheduler.model_outputs = [None if output is None else output.to(device) for output in state.history]
        scheduler.lower_order_nums = state.lower_order_nums


def capture_checkpoint(scheduler: Any, latents: torch.Tensor, generator: torch.Generator, *, index: int, step: int,
                       steps: int, fingerprint: Fingerprint) -> Checkpoint | None:
    """A checkpoint of the boundary after `step` of `steps` (the scheduler's `index`), or None when
    its scheduler cannot be resumed exactly. Everything is copied: the job may go on."""
    state = capture_scheduler(scheduler, index)
    if state is None:
        return None
    return Checkpoint(step=step, steps=steps, latents=latents.detach().to("cpu", copy=True), scheduler=state,
                      generator_state=generator.get_state(), fingerprint=fingerprint)


def _first_index(scheduler: Any, timestep: Any) -> int:
    """Where this call's schedule starts: img2img set the scheduler's begin index (or, for a scheduler
    without one, passed its first timestep to prepare_latents); txt2img starts at 0."""
    begin = getattr(scheduler, "begin_index", None)
    if begin is not None:
        return int(begin)
    if timestep is None:
        return 0
    import torch

    first = torch.as_tensor(timestep).flatten()[0].to(scheduler.timesteps.device)
    return int((scheduler.timesteps == first).nonzero()[0, 0])


@contextmanager
def denoising(pipe: Any, *, resume: Checkpoint | None = None, on_start: StartSeen | None = None) -> Iterator[None]:
    """For one call of `pipe`: resume it from `resume` (a txt2img pipeline called with the job's full
    num_inference_steps), and/or tell `on_start` the latents and scheduler index before its first step."""
    if resume is None and on_start is None:
        yield
        return
    call = _NarrowedCall(pipe, resume, on_start)
    try:
        yield
    finally:
        call.undo()


class _NarrowedCall:
    """The two methods a pipeline calls before its first step, narrowed on these two objects for one call.

    The scheduler's set_timesteps then hands the pipeline only the timesteps left, and the pipeline's
    prepare_latents returns the captured latents as they were (not multiplied by init_noise_sigma
    again, which is not exact in floats). The captured scheduler state goes back in whichever of the
    two comes second: SD and SDXL set their timesteps first, and prepare_latents puts the full
    schedule back too; SD3's txt2img prepares its latents first (its steps read the sigmas by the
    begin index, never the sliced timesteps, which `undo` replaces with the full schedule). Once the
    state is back, a set_begin_index of the pipeline's own (SDXL's txt2img sets 0 before its loop)
    counts from where the schedule it was handed begins: the resumed index is added.
    """

    def __init__(self, pipe: Any, resume: Checkpoint | None, on_start: StartSeen | None):
        scheduler = pipe.scheduler
        if "prepare_latents" in vars(pipe) or {"set_timesteps", "set_begin_index"} & set(vars(scheduler)):
            raise RuntimeError("a pipeline call is already being resumed or watched")
        self.pipe, self.scheduler, self.resume, self.on_start = pipe, scheduler, resume, on_start
        self.real_prepare, self.real_set_timesteps = pipe.prepare_latents, scheduler.set_timesteps
        self.signature = inspect.signature(self.real_prepare)
        self.full_schedule: list[Any] = []  # each schedule set_timesteps made (one, for a call we can resume)
        self.prepared: list[tuple[Any, Any]] = []  # (latents, device) once prepare_latents has run
        pipe.prepare_latents = self.prepare_latents
        scheduler.set_timesteps = self.set_timesteps

    def undo(self) -> None:
        """The methods back as they were, and no sliced schedule left after the call."""
        del self.pipe.prepare_latents
        del self.scheduler.set_timesteps
        if "set_begin_index" in vars(self.scheduler):
            del self.scheduler.set_begin_index
        if self.full_schedule:
            self.scheduler.timesteps = self.full_schedule[0]

    def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
        self.real_set_timesteps(*args, **kwargs)
        self.full_schedule.append(self.scheduler.timesteps)
        if self.resume is not None:
            if len(self.full_schedule) != 1:
                raise self._cannot_resume()
            if self.prepared:  # latents first (SD3): the state goes back now, after set_timesteps reset it
                self._restore_state(self.prepared[0][1])
            self.scheduler.timesteps = self.scheduler.timesteps[self.resume.scheduler.index:]
        if self.prepared and self.on_start is not None and len(self.full_schedule) == 1:
            self.on_start(self.prepared[0][0], self._start_index(None))

    def prepare_latents(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self.signature.bind(*args, **kwargs).arguments
        latents = self.real_prepare(*args, **kwargs) if self.resume is None else self._resumed_latents(arguments)
        self.prepared.append((latents, arguments.get("device")))
        if self.full_schedule and self.on_start is not None:
            self.on_start(latents, self._start_index(arguments.get("timestep")))
        return latents

    def _resumed_latents(self, arguments: dict[str, Any]) -> Any:
        assert self.resume is not None
        if len(self.full_schedule) > 1 or self.prepared or "latents" not in self.signature.parameters:
            raise self._cannot_resume()
        if self.full_schedule:  # timesteps first (SD, SDXL): the full schedule and the state go back now
            self.scheduler.timesteps = self.full_schedule[0]
            self._restore_state(arguments["device"])
        return self.resume.latents.to(device=arguments["device"], dtype=arguments["dtype"])

    def _restore_state(self, device: Any) -> None:
        assert self.resume is not None
        restore_scheduler(self.scheduler, self.resume.scheduler, device)
        real_set_begin = getattr(self.scheduler, "set_begin_index", None)
        if real_set_begin is not None:
            offset = self.resume.scheduler.index

            def set_begin_index(begin_index: int = 0) -> None:
                real_set_begin(begin_index + offset)

            self.scheduler.set_begin_index = set_begin_index

    def _start_index(self, timestep: Any) -> int:
        return self.resume.scheduler.index if self.resume is not None else _first_index(self.scheduler, timestep)

    def _cannot_resume(self) -> RuntimeError:
        return RuntimeError(f"{type(self.pipe).__name__} does not set its timesteps once and prepare its latents "
                            "once, so it cannot be resumed")


def _channels_last(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors laid out channels-last. Their layout is kept because it changes the
    pixels: img2img's latents come channels-last out of the VAE encoder, DDIM's step keeps that layout,
    and the VAE decoder's convolutions round differently on it (1 level in a pixel on the tiny model)."""
    import torch

    return sorted(name for name, tensor in tensors.items()
                  if tensor.dim() == 4 and not tensor.is_contiguous()
                  and tensor.is_contiguous(memory_format=torch.channels_last))


def _read_header(blob: bytes) -> dict[str, Any]:
    """The JSON header in a safetensors blob's metadata, read without trusting its lengths."""
    if len(blob) < 8:
        raise CheckpointRefused("the checkpoint is too short to be one")
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise CheckpointRefused("the checkpoint's header runs past its end: it is truncated or not a checkpoint")
    try:
        outer = json.loads(blob[8:8 + length])
        header = json.loads(outer["__metadata__"][_HEADER_KEY])
    except (ValueError, KeyError, TypeError):
        raise CheckpointRefused("the checkpoint has no readable header: it is not a potocolom checkpoint") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise CheckpointRefused(f"the checkpoint's format is {found!r}, this worker reads {FORMAT}")
    return header


def _read_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointRefused(f"the checkpoint's tensors cannot be read: {str(exc)[:200]}") from None


def _int(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointRefused(f"the checkpoint's {what} must be an integer of at least {low}, got {value!r}")
    return value


def _fingerprint_from(value: Any) -> Fingerprint:
    names = {field.name for field in fields(Fingerprint)}
    if not isinstance(value, dict) or set(value) != names:
        raise CheckpointRefused("the checkpoint's fingerprint is missing or has other fields")
    for name in ("scheduler", "scheduler_config", "torch", "diffusers", "device", "dtype"):
        if not isinstance(value[name], str):
            raise CheckpointRefused(f"the checkpoint's fingerprint {name} must be a string")
    strength = value["strength"]
    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float))):
        raise CheckpointRefused("the checkpoint's fingerprint strength must be a number or null")
    return Fingerprint(**{**value, "steps": _int(value["steps"], "steps", 1), "width": _int(value["width"], "width", 1),
                          "height": _int(value["height"], "height", 1),
                          "strength": None if strength is None else float(strength)})


def _checkpoint_from(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Checkpoint:
    import torch

    step, steps = _int(header.get("step"), "step"), _int(header.get("steps"), "steps", 1)
    if step > steps:
        raise CheckpointRefused(f"the checkpoint's step {step} is past its steps {steps}")
    state = header.get("scheduler")
    if not isinstance(state, dict) or not isinstance(state.get("history"), list):
        raise CheckpointRefused("the checkpoint's scheduler state is missing")
    present = state["history"]
    expected = {_LATENTS, _GENERATOR} | {f"{_HISTORY}{i}" for i, there in enumerate(present) if there is True}
    if set(tensors) != expected or not all(isinstance(there, bool) for there in present):
        raise CheckpointRefused(f"the checkpoint holds tensors {sorted(tensors)}, its header says {sorted(expected)}")
    channels_last = header.get("channels_last")
    if not isinstance(channels_last, list) or not set(channels_last) <= set(tensors) - {_GENERATOR}:
        raise CheckpointRefused("the checkpoint's channels_last must list some of its 4-d tensors")
    for name in channels_last:
        if tensors[name].dim() != 4:
            raise CheckpointRefused(f"the checkpoint's channels_last lists {name}, which is not 4-d")
        tensors[name] = tensors[name].contiguous(memory_format=torch.channels_last)
    latents, generator_state = tensors[_LATENTS], tensors[_GENERATOR]
    if latents.dim() != 4 or not latents.is_floating_point():
        raise CheckpointRefused(f"the checkpoint's latents must be a 4-d float tensor, got {tuple(latents.shape)}")
    if generator_state.dtype != torch.uint8 or generator_state.dim() != 1:
        raise CheckpointRefused("the checkpoint's generator state must be a 1-d uint8 tensor")
    history = tuple(tensors[f"{_HISTORY}{i}"] if there else None for i, there in enumerate(present))
    scheduler = SchedulerState(index=_int(state.get("index"), "scheduler index"),
                               lower_order_nums=_int(state.get("lower_order_nums"), "lower_order_nums"),
                               history=history)
    return Checkpoint(step=step, steps=steps, latents=latents, scheduler=scheduler, generator_state=generator_state,
                      fingerprint=_fingerprint_from(header.get("fingerprint")))
