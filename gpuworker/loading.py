"""Loading the installed models onto the memory ladder one by one in load order (read, measured, given
a rung against what is free, placed; one that fits on no rung is left out), and what is measured
once a model is placed: its step time and realtime slots; docs/design/memory-ladder.md."""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuworker.footprints import pipeline_footprint
from gpuworker.installed import ModelOnDisk
from gpuworker.ladder import Placed, RungChoice, host_bytes, mib, place_next
from gpuworker.limits import Limits
from gpuworker.pipelines import DEFAULT_GUIDANCE_SCALE, DiffusersPipeline, Fault
from gpuworker.slots import RealtimeCapacity, describe, measure_capacity
from gpuworker.vram import VramBudget, available_ram_bytes, give_back_device_memory
from gpuworker.weights import offload_dir_for, read_modules
from potocolom.protocol.rungs import MODE_AUTO, RUNG_FULL

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """The pipelines served, by model_id in load order, and the models that fit nowhere (with why)."""

    pipelines: dict[str, DiffusersPipeline] = field(default_factory=dict)
    choices: dict[str, RungChoice] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def load_pipelines(models: list[ModelOnDisk], device: str, *, mode: str = MODE_AUTO,
                   budget: VramBudget | None = None, fault: Fault | None = None,
                   limits: Limits | None = None) -> Loaded:
    """Every model that fits, placed on its rung; raises PipelineLoadError for one that cannot be read.
    Footprints cover the largest size each model allows (`limits.max_image_side` where its schema
    sets no maximum), and the pipelines refuse anything larger."""
    budget = budget or VramBudget(device)
    limits = limits or Limits.from_env()
    loaded = Loaded()
    placed = Placed()
    for model in models:
        started = time.perf_counter()
        log.info("loading %s (%s) from %s for %s", model.model_id, model.pipeline, model.source, device)
        modules = read_modules(model, device)
        footprint = pipeline_footprint(model.model_id, modules.pipe, model.params_schema,
                                       max_side=limits.max_image_side)
        ram = available_ram_bytes()
        # The weights just read sit in RAM already: they are what offloaded groups would keep there.
        ram_free = None if ram is None else ram + footprint.weights_bytes - placed.host_bytes
        # The budget's free figure already leaves out what placed models keep on the device.
        choice, placed = place_next(footprint, placed, free_bytes=budget.free_bytes(), mode=mode,
                                    ram_free_bytes=ram_free)
        loaded.choices[model.model_id] = choice
        if choice.rung is None:
            log.error("model %s is not served: it %s (weights %s, largest component %s, largest block group %s, "
                      "working %s)", model.model_id, choice.reason, mib(footprint.weights_bytes),
                      mib(footprint.largest_component_bytes), mib(footprint.largest_group_bytes),
                      mib(footprint.working_bytes))
            loaded.refused[model.model_id] = choice.reason
            del modules
            give_back_device_memory(device)
            continue
        offload_dir = offload_dir_for(model.model_id, choice.offload_to_disk)
        loaded.pipelines[model.model_id] = DiffusersPipeline.placed(
            model, modules, device, choice.rung, offload_dir=offload_dir, fault=fault, footprint=footprint,
            limits=limits)
        budget.hold(footprint.resident_bytes(choice.rung))
        log.info("model %s on %s: %s (weights %s, working %s); placed in %.1f s%s", model.model_id, device,
                 choice.reason, mib(footprint.weights_bytes), mib(footprint.working_bytes),
                 time.perf_counter() - started, f"; groups in {offload_dir}" if offload_dir else "")
    return loaded


def placed_now(pipelines: Mapping[str, Any]) -> Placed:
    """What the loaded models hold now, as the ladder counts it (ladder.Placed): what the next
    model is placed beside. A pipeline without a measured footprint (a test's stand-in) holds nothing."""
    held = [(p.footprint, p.rung, getattr(p, "offload_dir", None) is not None)
            for p in pipelines.values() if getattr(p, "footprint", None) is not None]
    return Placed(transient_pool=max((f.transient_bytes(rung) for f, rung, _ in held), default=0),
                  resident_bytes=sum(f.resident_bytes(rung) for f, rung, _ in held),
                  host_bytes=sum(host_bytes(f, rung, to_disk) for f, rung, to_disk in held))


STEP_MS_STEPS = 3  # the timed call's steps: the clock runs from the end of the first to the end of the last


def measure_step_ms(pipeline: DiffusersPipeline) -> float | None:
    """One denoising step at the model's default size on its rung, in ms (hello's step_ms): a
    one-step warm-up call, then the steps after the first of a STEP_MS_STEPS-step call, timed at
    the step callbacks (no text encoding, no decode: latents out). The diffusers pipeline is called
    directly, so a test's injected fault (pipelines.InjectedOutOfMemory) is left to the jobs. None
    when it cannot run (logged): the API then uses its default."""
    import torch

    size = pipeline.default_size
    marks: list[float] = []

    def step_end(pipe: Any, index: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        marks.append(time.perf_counter())
        return callback_kwargs

    common = {"prompt": "a measurement", "height": size, "width": size, "guidance_scale": DEFAULT_GUIDANCE_SCALE,
              "output_type": "latent"}
    try:
        pipeline.pipe(num_inference_steps=1, generator=torch.Generator("cpu").manual_seed(0), **common)
        pipeline.pipe(num_inference_steps=STEP_MS_STEPS, generator=torch.Generator("cpu").manual_seed(0),
                      callback_on_step_end=step_end, **common)
    except Exception as exc:  # out of memory on a tight device, an odd pipeline: no figure, still served
        log.warning("model %s: its step time could not be measured (%s)", pipeline.model.model_id,
                    " ".join(str(exc).split())[:200] or type(exc).__name__)
        marks = []
    if len(marks) < 2:
        give_back_device_memory(pipeline.device)
        return None
    return round((marks[-1] - marks[0]) * 1000 / (len(marks) - 1), 3)


def realtime_capacity(model_id: str, pipeline: DiffusersPipeline, budget_ms: float) -> RealtimeCapacity | None:
    """The model's realtime slots (slots.measure_capacity) when it is on the full rung and does
    img2img; None else, or when the measurement fails (logged: it serves no sessions then)."""
    if pipeline.rung != RUNG_FULL or pipeline.frames is None:
        return None
    try:
        capacity = measure_capacity(pipeline, pipeline.model.params_schema, pipeline.default_size, budget_ms)
    except Exception as exc:
        log.warning("model %s: realtime frames could not be measured (%s); it serves no sessions", model_id,
                    " ".join(str(exc).split())[:200] or type(exc).__name__)
        give_back_device_memory(pipeline.device)
        return None
    log.info("%s", describe(model_id, capacity, budget_ms))
    return capacity
