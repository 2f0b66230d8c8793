"""Loading the installed models onto the memory ladder, one by one in load order: each is read onto
the CPU, measured (footprints.py), given its rung by the pure plan (ladder.place_next) against what
is free now, and placed there; one that fits on no rung is left out, with the reason in the log."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from potocolom.protocol.rungs import MODE_AUTO
from workers.gpu.footprints import pipeline_footprint
from workers.gpu.installed import InstalledModel
from workers.gpu.ladder import Placed, RungChoice, mib, place_next
from workers.gpu.limits import Limits
from workers.gpu.pipelines import DiffusersPipeline, Fault, offload_dir_for, read_modules
from workers.gpu.vram import VramBudget, available_ram_bytes, give_back_device_memory

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """The pipelines served, by model_id in load order, and the models that fit nowhere (with why)."""

    pipelines: dict[str, DiffusersPipeline] = field(default_factory=dict)
    choices: dict[str, RungChoice] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def load_pipelines(models: list[InstalledModel], device: str, *, mode: str = MODE_AUTO,
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
