"""Models loaded and unloaded while the worker serves, when the API asks: what is installed and what
each rung of it needs (`InstalledCatalog`, the v2 hello's `installed`), and `ModelsOnDemand`, which
answers load_model and unload_model in order on a loader thread; docs/protocol.md, "Placement across workers"."""
from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuworker.footprints import pipeline_footprint, saved_footprint
from gpuworker.frames import FrameRunner
from gpuworker.installed import ModelOnDisk
from gpuworker.ladder import MIB, Footprint, Placed, RungChoice, need_beside, place_next
from gpuworker.limits import Limits
from gpuworker.loading import measure_step_ms, placed_now, realtime_capacity
from gpuworker.pipelines import DiffusersPipeline, Fault
from gpuworker.sessions import SessionDesk
from gpuworker.slots import RealtimeCapacity
from gpuworker.vram import VramBudget, available_ram_bytes, give_back_device_memory
from gpuworker.weights import Modules, PipelineLoadError, offload_dir_for, read_modules
from potocolom.protocol.entries import InstalledEntry
from potocolom.protocol.fields import Message
from potocolom.protocol.rungs import MODE_AUTO, RUNG_FULL, RUNGS
from potocolom.protocol.worker import ModelLoaded, ModelLoadFailed, ModelUnloaded

log = logging.getLogger(__name__)

MAX_QUEUED_LOADS = 8  # load_model orders waiting behind the one loading; more are refused at once
DRAINING = "draining"  # model_load_failed.error while the worker drains
ERROR_CHARS = 400  # model_load_failed.error is a short message (the contract cuts at 500)
LOAD, UNLOAD = "load", "unload"


class LoadRefused(Exception):
    """A load_model the worker will not carry out (the message says why: memory, rung, drain)."""


def mib_up(n_bytes: int) -> int:
    """Bytes as whole MiB, rounded up: the API must never think a model needs less than it does."""
    return -(-n_bytes // MIB)


def mib_down(n_bytes: int | None) -> str:
    """Free bytes as whole MiB, rounded down, for messages ("547 MiB", or "unknown")."""
    return "unknown" if n_bytes is None else f"{max(0, n_bytes) // MIB} MiB"


def needs_mib(footprint: Footprint, transient_pool: int = 0) -> dict[str, int]:
    """installed.needs_mib: for every rung, the MiB that must be free for the model to go there
    beside models whose largest transient need is `transient_pool` (ladder.need_beside: the
    figure the ladder checks on load, so the API never asks for a load it would refuse)."""
    return {rung: mib_up(need_beside(footprint, rung, transient_pool)) for rung in RUNGS}


def dtype_bytes_for(device: str) -> int:
    """The bytes of a floating weight as the worker loads it on `device` (float16 on CUDA, float32 else)."""
    return 2 if device.startswith("cuda") else 4


@dataclass
class InstalledCatalog:
    """The installed models (after --models) by model_id, each one's footprint read from its saved
    files (once, at start: the weights are not read), and what was measured of each on the full
    rung: its step time and its realtime slots. Both are the model's on this device, not the
    load's: kept when it is demoted or unloaded, and not measured again when it is loaded again
    (the measuring takes seconds, the slots most of them, and the API waits for model_loaded)."""

    models: dict[str, ModelOnDisk]
    saved: dict[str, Footprint] = field(default_factory=dict)  # models whose files could not be read are left out
    step_ms: dict[str, float] = field(default_factory=dict)
    capacity: dict[str, RealtimeCapacity] = field(default_factory=dict)

    @classmethod
    def read(cls, models: Iterable[ModelOnDisk], *, dtype_bytes: int, max_side: int) -> InstalledCatalog:
        catalog = cls({model.model_id: model for model in models})
        for model_id, model in catalog.models.items():
            try:
                catalog.saved[model_id] = saved_footprint(model_id, model.source, model.params_schema,
                                                          dtype_bytes=dtype_bytes, max_side=max_side)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                log.warning("model %s is left out of hello.installed: its files in %s cannot be read (%s)",
                            model_id, model.source, exc)
        return catalog

    def entries(self, pipelines: Mapping[str, Any]) -> tuple[InstalledEntry, ...]:
        """hello.installed: each model with its needs beside the other loaded models, from its
        measured footprint when it is loaded, else from its saved files."""
        entries = []
        for model_id in self.models:
            loaded = pipelines.get(model_id)
            footprint = getattr(loaded, "footprint", None) or self.saved.get(model_id)
            if footprint is None:
                continue
            others = {m: p for m, p in pipelines.items() if m != model_id}
            entries.append(InstalledEntry(model_id, needs_mib(footprint, placed_now(others).transient_pool),
                                          self.step_ms.get(model_id)))
        return tuple(entries)


def rung_for_load(footprint: Footprint, placed: Placed, *, free_bytes: int | None, memory_mode: str = MODE_AUTO,
                  asked: str | None = None, ram_free_bytes: int | None = None) -> RungChoice:
    """Where a load_model goes (pure): the highest rung MEMORY_MODE allows that fits beside what
    is `placed` (ladder.place_next), or only the `asked` rung; LoadRefused when it does not fit."""
    if asked is not None and memory_mode not in (MODE_AUTO, asked):
        raise LoadRefused(f"{footprint.model_id}: rung {asked} was asked, but MEMORY_MODE pins rung {memory_mode}")
    choice, _ = place_next(footprint, placed, free_bytes=free_bytes, mode=asked or memory_mode,
                           ram_free_bytes=ram_free_bytes)
    if choice.rung is not None:
        return choice
    if asked is not None:
        raise LoadRefused(f"{footprint.model_id} needs {mib_up(choice.needs[asked])} MiB on rung {asked}, "
                          f"{mib_down(free_bytes)} free")
    raise LoadRefused(f"{footprint.model_id} {choice.reason}")


class Host(Protocol):
    """What ModelsOnDemand needs of the worker (worker.GpuWorker)."""

    pipelines: dict[str, Any]
    frames: FrameRunner
    sessions: SessionDesk

    @property
    def draining(self) -> bool: ...

    def model_work(self, model_id: str) -> tuple[int, int]: ...

    def gpu_now(self) -> dict[str, Any] | None: ...

    def send_message(self, message: Message) -> None: ...


@dataclass
class PipelineOnRung:
    """A model placed by the loader thread, with what was measured there."""

    pipeline: DiffusersPipeline
    choice: RungChoice
    step_ms: float | None
    capacity: RealtimeCapacity | None


Read = Callable[[ModelOnDisk, str], Modules]


class ModelsOnDemand:
    """Answers load_model and unload_model, in the order they came, one at a time.

    The reading, placing and measuring happen on the "model-load" thread, never on the event loop
    nor the denoising thread: jobs and frames of the other models go on meanwhile. The tables a
    model lives in (the worker's pipelines, which the denoising loop shares, the frame runner's
    and the session desk's) change on the event loop only, once the model is placed or before it
    is freed. `frame_budget_ms` None: realtime off (nothing measured). `read` is the seam that
    reads a model's modules (tests hold a load there).
    """

    def __init__(self, catalog: InstalledCatalog, *, device: str, budget: VramBudget, memory_mode: str = MODE_AUTO,
                 frame_budget_ms: float | None = None, fault: Fault | None = None, limits: Limits | None = None,
                 read: Read = read_modules, max_queued: int = MAX_QUEUED_LOADS):
        self.catalog = catalog
        self.device = device
        self.budget = budget
        self.memory_mode = memory_mode
        self.frame_budget_ms = frame_budget_ms
        self.limits = limits or Limits.from_env()
        self._fault = fault
        self._read = read
        self._max_queued = max_queued
        self._ops: collections.deque[tuple[str, str, str | None]] = collections.deque()
        self._closing: dict[str, RealtimeCapacity | None] = {}  # unload asked while it had work
        self._host: Host | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: ThreadPoolExecutor | None = None

    # --- the event loop's side ------------------------------------------------------------------

    def bind(self, host: Host) -> None:
        self._host = host

    def start(self) -> None:
        """In the running event loop (GpuWorker.run): the worker of the queue, and its thread."""
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self._task = asyncio.create_task(self._work(), name="models-on-demand")

    async def stop(self) -> None:
        """Stop taking orders; a load under way finishes on its thread, unregistered."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def installed(self, pipelines: Mapping[str, Any]) -> tuple[InstalledEntry, ...]:
        return self.catalog.entries(pipelines)

    def closing(self, model_id: str) -> bool:
        """Unload was asked while the model had work: it takes no new job and no new session."""
        return model_id in self._closing

    def ask_load(self, model_id: str, rung: str | None) -> None:
        """load_model: refused at once when not installed, draining, or too many wait; else queued
        (a load already queued last for the model answers this one too)."""
        host = self._bound()
        if model_id not in self.catalog.models:
            self._failed(model_id, f"model {model_id} is not installed on this worker")
        elif host.draining:
            self._failed(model_id, DRAINING)
        elif self._last_queued(model_id) == LOAD:
            log.info("load_model %s is already queued; its answer answers this one too", model_id)
        elif sum(1 for kind, _, _ in self._ops if kind == LOAD) >= self._max_queued:
            self._failed(model_id, f"{self._max_queued} model loads are already waiting on this worker")
        else:
            self._queue(LOAD, model_id, rung)

    def ask_unload(self, model_id: str) -> None:
        """unload_model: queued behind the loads asked before it; a model loaded now takes no new
        job and no new session from this moment (unless a load of it is still queued)."""
        host = self._bound()
        if model_id in host.pipelines and model_id not in self._closing and self._last_queued(model_id) != LOAD:
            self._closing[model_id] = host.sessions.close_model(model_id)
        self._queue(UNLOAD, model_id, None)

    def work_ended(self) -> None:
        """A job was let go or a session ended: a model waiting to be unloaded may go now."""
        host = self._bound()
        for model_id in list(self._closing):
            if host.model_work(model_id) == (0, 0) and self._last_queued(model_id) is None:
                self._queue(UNLOAD, model_id, None)

    def _bound(self) -> Host:
        assert self._host is not None, "ModelsOnDemand.bind(worker) first"
        return self._host

    def _queue(self, kind: str, model_id: str, rung: str | None) -> None:
        self._ops.append((kind, model_id, rung))
        if self._wake is not None:
            self._wake.set()

    def _last_queued(self, model_id: str) -> str | None:
        return next((kind for kind, queued, _ in reversed(self._ops) if queued == model_id), None)

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            while not self._ops:
                self._wake.clear()
                await self._wake.wait()
            kind, model_id, rung = self._ops.popleft()
            try:
                await (self._load(model_id, rung) if kind == LOAD else self._unload(model_id))
            except Exception:  # never let one order end the queue
                log.exception("%s of model %s failed unexpectedly", kind, model_id)
                if kind == LOAD:
                    self._failed(model_id, f"an unexpected error loading model {model_id}")

    async def _load(self, model_id: str, rung: str | None) -> None:
        host = self._bound()
        if model_id in host.pipelines:
            if model_id in self._closing:  # asked back before it could go: it stays, and takes work again
                host.sessions.add_model(model_id, host.pipelines[model_id].rung, self._closing.pop(model_id))
            log.info("load_model %s: already loaded, on rung %s", model_id, host.pipelines[model_id].rung)
            self._loaded_answer(model_id)
            return
        if host.draining:
            self._failed(model_id, DRAINING)
            return
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        assert self._thread is not None
        result = await loop.run_in_executor(self._thread, self._load_here, self.catalog.models[model_id], rung,
                                            dict(host.pipelines), self.catalog.step_ms.get(model_id),
                                            self.catalog.capacity.get(model_id))
        if isinstance(result, str):
            log.warning("loading %s for the API failed: %s", model_id, result)
            self._failed(model_id, result)
            return
        pipeline = result.pipeline
        host.pipelines[model_id] = pipeline
        if result.step_ms is not None:
            self.catalog.step_ms[model_id] = result.step_ms
        if result.capacity is not None:
            self.catalog.capacity[model_id] = result.capacity
            host.frames.add_model(model_id, pipeline, result.capacity.slots)
        host.sessions.add_model(model_id, pipeline.rung, result.capacity)
        gpu = self._loaded_answer(model_id)
        log.info("%s loaded in %.1f s on rung %s (step %s ms, %d realtime slot(s)); %s MiB free", model_id,
                 time.perf_counter() - started, pipeline.rung,
                 "unknown" if result.step_ms is None else f"{result.step_ms:.1f}",
                 result.capacity.slots if result.capacity is not None else 0, _free(gpu))

    async def _unload(self, model_id: str) -> None:
        host = self._bound()
        if model_id not in host.pipelines:
            log.info("unload_model %s: not loaded here", model_id)
            host.send_message(ModelUnloaded(model_id, host.gpu_now()))
            return
        jobs, sessions = host.model_work(model_id)
        if jobs or sessions:
            if model_id not in self._closing:
                self._closing[model_id] = host.sessions.close_model(model_id)
            log.warning("unload_model %s while it holds %d job(s) and %d live session(s): it takes no new "
                        "work, and is unloaded once they end", model_id, jobs, sessions)
            return
        self._closing.pop(model_id, None)
        pipeline = host.pipelines.pop(model_id)
        host.frames.remove_model(model_id)
        host.sessions.remove_model(model_id)
        assert self._thread is not None
        # Its modules, hooks and offload folder go on the loader thread (gc and the allocator's
        # cache take a while); the answer's free memory is read after.
        await asyncio.get_running_loop().run_in_executor(self._thread, pipeline.release)
        del pipeline
        gpu = host.gpu_now()
        host.send_message(ModelUnloaded(model_id, gpu))
        log.info("%s unloaded; %s MiB free", model_id, _free(gpu))

    def _loaded_answer(self, model_id: str) -> dict[str, Any] | None:
        host = self._bound()
        gpu = host.gpu_now()
        host.send_message(ModelLoaded(host.sessions.hello_entry(model_id, host.pipelines[model_id].rung), gpu))
        return gpu

    def _failed(self, model_id: str, error: str) -> None:
        host = self._bound()
        host.send_message(ModelLoadFailed(model_id, error[:ERROR_CHARS], host.gpu_now()))

    # --- the loader thread's side -----------------------------------------------------------------

    def _load_here(self, model: ModelOnDisk, rung: str | None, loaded: Mapping[str, Any],
                   step_ms: float | None = None, capacity: RealtimeCapacity | None = None) -> PipelineOnRung | str:
        """On the loader thread: the model placed and measured (unless `step_ms` and `capacity`
        were measured at an earlier load), or why not (everything it took given back)."""
        try:
            return self._place(model, rung, loaded, step_ms, capacity)
        except (LoadRefused, PipelineLoadError) as exc:
            error = str(exc)
        except Exception as exc:  # out of memory while placing, a broken file: the worker goes on
            error = f"model {model.model_id}: {' '.join(str(exc).split()) or type(exc).__name__}"
        # Out of the except block: the frames that held the modules read are gone.
        give_back_device_memory(self.device)
        return error

    def _choose(self, footprint: Footprint, placed: Placed, rung: str | None) -> RungChoice:
        self.budget.held_bytes = placed.resident_bytes  # what main's current_gpu counts too
        ram = available_ram_bytes()
        ram_free = None if ram is None else ram + footprint.weights_bytes - placed.host_bytes
        return rung_for_load(footprint, placed, free_bytes=self.budget.free_bytes(), memory_mode=self.memory_mode,
                             asked=rung, ram_free_bytes=ram_free)

    def _place(self, model: ModelOnDisk, rung: str | None, loaded: Mapping[str, Any],
               known_step_ms: float | None = None, known_capacity: RealtimeCapacity | None = None) -> PipelineOnRung:
        model_id = model.model_id
        placed = placed_now(loaded)
        saved = self.catalog.saved.get(model_id)
        if saved is not None:  # refused before a byte of weights is read
            planned = self._choose(saved, placed, rung)
            assert planned.rung is not None
            log.info("loading %s on rung %s for the API (needs %d MiB, %s free)", model_id, planned.rung,
                     mib_up(planned.needs.get(planned.rung, saved.needs(planned.rung))),
                     mib_down(planned.free_bytes))
        else:
            log.info("loading %s for the API (its needs are not known before it is read)", model_id)
        modules = self._read(model, self.device)
        footprint = pipeline_footprint(model_id, modules.pipe, model.params_schema,
                                       max_side=self.limits.max_image_side)
        choice = self._choose(footprint, placed, rung)  # measured: what start-up would have decided
        assert choice.rung is not None
        offload_dir = offload_dir_for(model_id, choice.offload_to_disk)
        try:
            pipeline = DiffusersPipeline.placed(model, modules, self.device, choice.rung, offload_dir=offload_dir,
                                                fault=self._fault, footprint=footprint, limits=self.limits)
        except BaseException:
            if offload_dir is not None:
                shutil.rmtree(offload_dir, ignore_errors=True)
            raise
        del modules
        step_ms = capacity = None
        if pipeline.rung == RUNG_FULL:  # measured on full only; a model measured before is not again
            step_ms = known_step_ms if known_step_ms is not None else measure_step_ms(pipeline)
            if self.frame_budget_ms is not None:
                capacity = (known_capacity if known_capacity is not None
                            else realtime_capacity(model_id, pipeline, self.frame_budget_ms))
        return PipelineOnRung(pipeline, choice, step_ms, capacity)


def _free(gpu: dict[str, Any] | None) -> str:
    return "unknown" if not gpu else str(gpu.get("free_mib"))
