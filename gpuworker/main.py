"""Start a GPU worker from its options: find the installed models, load those it preloads onto the
ladder, measure their step time and realtime slots, connect and serve until SIGINT or SIGTERM (no
Django here); docs/protocol.md, "Operator commands", and docs/operations.md."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuworker.connection import WorkerConfig
from gpuworker.installed import ModelOnDisk, UnknownModelError, discover_models, parse_model_ids
from gpuworker.limits import Limits
from gpuworker.loading import Loaded, load_pipelines, measure_step_ms, placed_now, realtime_capacity
from gpuworker.models_on_demand import InstalledCatalog, ModelsOnDemand, dtype_bytes_for
from gpuworker.pipelines import InjectedOutOfMemory
from gpuworker.quiet import quiet_libraries
from gpuworker.vram import VramBudget, device_index
from gpuworker.weights import PipelineLoadError
from gpuworker.worker import GpuWorker
from potocolom.protocol.manifests import ManifestError
from potocolom.protocol.rungs import MEMORY_MODES, RUNG_FULL

log = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """The worker cannot start: bad options, no models installed, or a model that does not load."""


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's command line, parsed (see runworker_gpu)."""

    api: str
    token: str
    models_dir: Path
    models: list[str] | None = None  # --models narrows the installed models
    memory_mode: str = "auto"  # MEMORY_MODE: auto, or a pinned rung (ladder.MEMORY_MODES)
    device: str | None = None  # None: cuda when available, else cpu
    vram_mib: int | None = None  # a VRAM budget in MiB for the memory ladder (pretend VRAM without CUDA)
    worker_id: str | None = None
    threads: int | None = None
    frame_budget_ms: float = 500.0  # FRAME_BUDGET_MS: the per-frame p95 that realtime slots are sized to
    realtime: bool = True  # False (--no-realtime): measure nothing, serve no sessions
    max_batch: int | None = None  # --max-batch: at most this many frames per pipeline call (1: batching off)
    limits: Limits | None = None  # MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MAX_STEPS (None: from the environment)
    drain_seconds: float = 30.0  # --drain-seconds: SIGTERM gives everything back and exits within this
    preload: list[str] | None = None  # --preload: None (all) every model of --models, [] (none) none, or these


PRELOAD_ALL, PRELOAD_NONE = "all", "none"


def parse_preload(text: str) -> list[str] | None:
    """`--preload all` (None: every installed model), `none` ([]), or model ids, comma-separated;
    ValueError for anything else."""
    if text.strip() == PRELOAD_ALL:
        return None
    if text.strip() == PRELOAD_NONE:
        return []
    ids = parse_model_ids(text)
    if not ids or PRELOAD_ALL in ids or PRELOAD_NONE in ids:
        raise ValueError(f"--preload must be all, none or model ids, comma-separated; got {text!r}")
    return ids


def preloaded(models: list[ModelOnDisk], preload: list[str] | None) -> list[ModelOnDisk]:
    """The models to load at start, in load order; WorkerStartError for an id not installed."""
    if preload is None:
        return models
    by_id = {model.model_id: model for model in models}
    unknown = [model_id for model_id in preload if model_id not in by_id]
    if unknown:
        raise WorkerStartError(f"--preload names model(s) not installed (after --models): {', '.join(unknown)} "
                               f"(installed: {', '.join(by_id) or 'none'})")
    wanted = set(preload)
    return [model for model in models if model.model_id in wanted]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}:{device_index(device)}"


def _check(options: WorkerOptions, device: str) -> None:
    if options.memory_mode not in MEMORY_MODES:
        raise WorkerStartError(f"--memory-mode must be one of {', '.join(MEMORY_MODES)}, got {options.memory_mode!r}")
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise WorkerStartError(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise WorkerStartError(f"--device {device}, but torch sees no CUDA device here; use --device cpu")


def measure_realtime(pipelines: dict[str, Any], budget_ms: float) -> dict[str, Any]:
    """Each full-rung img2img model's RealtimeCapacity (slots.measure_capacity), by model_id."""
    capacities = {}
    for model_id, pipeline in pipelines.items():
        capacity = realtime_capacity(model_id, pipeline, budget_ms)
        if capacity is not None:
            capacities[model_id] = capacity
    return capacities


def measure_step_times(pipelines: dict[str, Any]) -> dict[str, float]:
    """Each full-rung model's step time (loading.measure_step_ms), by model_id."""
    step_ms = {}
    for model_id, pipeline in pipelines.items():
        if pipeline.rung == RUNG_FULL and (measured := measure_step_ms(pipeline)) is not None:
            log.info("%s: one denoising step at %dx%d takes %.1f ms", model_id, pipeline.default_size,
                     pipeline.default_size, measured)
            step_ms[model_id] = measured
    return step_ms


def build_worker(options: WorkerOptions) -> GpuWorker:
    """Load the installed models and make the GpuWorker (not yet connected)."""
    # 1. The manifests first: a wrong --models fails in a blink, before torch is even imported.
    models = installed_models(options)
    preload = preloaded(models, options.preload)
    # 2. torch, the device and what it has free.
    device = start_device(options)
    budget = VramBudget(device, options.vram_mib)
    # 3. The models preloaded onto the ladder, in load order.
    try:
        limits = options.limits or Limits.from_env()
        fault = InjectedOutOfMemory.from_env()  # a test seam: None unless POTOCOLOM_TEST_OOM is set
        loaded = load_pipelines(preload, device, mode=options.memory_mode, budget=budget, fault=fault, limits=limits)
    except (PipelineLoadError, ValueError) as exc:
        raise WorkerStartError(str(exc)) from exc
    catalog = InstalledCatalog.read(models, dtype_bytes=dtype_bytes_for(device), max_side=limits.max_image_side)
    log_preloaded(preload, models, loaded)
    # 4. What is measured of each on the full rung: its step time and its realtime slots.
    catalog.step_ms.update(measure_step_times(loaded.pipelines))
    realtime = measure_realtime(loaded.pipelines, options.frame_budget_ms) if options.realtime else {}
    catalog.capacity.update(realtime)  # a preloaded model unloaded and loaded again is not measured again
    on_demand = ModelsOnDemand(catalog, device=device, budget=budget, memory_mode=options.memory_mode,
                               frame_budget_ms=options.frame_budget_ms if options.realtime else None, fault=fault,
                               limits=limits)
    # 5. The worker, whose hello says the memory free as it is then.
    worker = _make_worker(options, device, budget, loaded.pipelines, realtime, limits, on_demand)
    rungs = ", ".join(f"{model_id} ({pipeline.rung})" for model_id, pipeline in loaded.pipelines.items()) or "no model"
    log.info("worker %s serves %s on %s, MEMORY_MODE %s, VRAM budget %s", worker.config.worker_id, rungs, device,
             options.memory_mode, f"{options.vram_mib} MiB" if options.vram_mib is not None else "not set")
    if loaded.refused:
        log.warning("not served (fit on no rung): %s", ", ".join(loaded.refused))
    return worker


def installed_models(options: WorkerOptions) -> list[ModelOnDisk]:
    """The installed models after --models; WorkerStartError when there are none or a manifest is bad."""
    try:
        models = discover_models(options.models_dir, options.models)
    except (ManifestError, UnknownModelError) as exc:
        raise WorkerStartError(str(exc)) from exc
    if not models:
        raise WorkerStartError(f"no models installed in {options.models_dir} (expected DIR/*/manifest.json)")
    return models


def start_device(options: WorkerOptions) -> str:
    """torch set up for the worker (imported only now: a wrong --models fails before its seconds of
    import), and the device it runs on, checked."""
    import torch

    quiet_libraries()  # before the first pipeline is read: no progress bars, no torchvision notice
    if options.threads:
        torch.set_num_threads(options.threads)
    device = options.device or default_device()
    _check(options, device)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context first, so the free figure already counts it
    return device


def log_preloaded(preload: list[ModelOnDisk], models: list[ModelOnDisk], loaded: Loaded) -> None:
    if not preload:
        log.info("--preload none: connecting with no model loaded; %d installed, loaded when the API asks",
                 len(models))
    elif not loaded.pipelines:
        # It stays connected with nothing to serve (an empty models list): the operator sees it in
        # the API, and a restart with more memory or smaller models is all it takes.
        reasons = "; ".join(f"{model_id}: {why}" for model_id, why in loaded.refused.items())
        log.error("no model fits this worker's memory (%s); connecting with none to serve", reasons)


def _make_worker(options: WorkerOptions, device: str, budget: VramBudget, pipelines: dict[str, Any],
                 realtime: dict[str, Any], limits: Limits, on_demand: ModelsOnDemand) -> GpuWorker:
    worker: GpuWorker | None = None

    def current_gpu() -> dict[str, Any] | None:
        """hello.gpu now: a demoted or unloaded model no longer holds its weights against a
        --vram-mib budget, and one loaded on demand does (the worker's pipelines, once it exists)."""
        budget.held_bytes = placed_now(worker.pipelines if worker is not None else pipelines).resident_bytes
        return budget.gpu_info()

    worker_id = options.worker_id or default_worker_id(device)
    try:
        config = WorkerConfig(api_url=options.api, token=options.token, worker_id=worker_id, gpu=current_gpu())
        worker = GpuWorker(config, pipelines, realtime=realtime, memory_mode=options.memory_mode,
                           gpu_info=current_gpu, limits=limits, drain_seconds=options.drain_seconds,
                           on_demand=on_demand)
    except ValueError as exc:
        raise WorkerStartError(str(exc)) from exc
    worker.frames.cap_batches(options.max_batch)
    return worker


async def serve(worker: GpuWorker) -> int:
    """Run the worker until SIGINT (stop at once and close the socket) or SIGTERM (drain: give the
    held jobs and sessions back, then stop; a second SIGTERM stops at once); the exit status
    (worker.exit_status: 0 stopped or drained, 1 the drain's deadline passed, 2 a second SIGTERM)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, worker.stop)
    loop.add_signal_handler(signal.SIGTERM, worker.terminate)
    try:
        await worker.run()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return worker.exit_status


def run_worker(options: WorkerOptions) -> int:
    """Start and serve; the exit status (see serve). Raises WorkerStartError, or
    connection.TokenRefused when the token is refused."""
    worker = build_worker(options)
    return asyncio.run(serve(worker))
