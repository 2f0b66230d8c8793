"""Start a GPU worker from its options: find the installed models, load those it preloads onto the
ladder, measure their step time and realtime slots, connect and serve (loading and unloading more
when the API asks: models_on_demand.py) until SIGINT or SIGTERM. No Django here."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuworker.client import WorkerClient
from gpuworker.connection import WorkerConfig
from gpuworker.installed import InstalledModel, UnknownModelError, discover_models, parse_model_ids
from gpuworker.limits import Limits
from gpuworker.loading import load_pipelines, measure_step_ms, placed_now, realtime_capacity
from gpuworker.models_on_demand import InstalledCatalog, ModelsOnDemand, dtype_bytes_for
from gpuworker.pipelines import InjectedOutOfMemory, PipelineLoadError
from gpuworker.quiet import quiet_libraries
from gpuworker.vram import VramBudget, device_index
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


def preloaded(models: list[InstalledModel], preload: list[str] | None) -> list[InstalledModel]:
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


def build_client(options: WorkerOptions) -> Any:
    """Load the installed models and make the WorkerClient (not yet connected)."""
    # The manifests first: a wrong --models fails in a blink, before torch is even imported.
    try:
        models = discover_models(options.models_dir, options.models)
    except (ManifestError, UnknownModelError) as exc:
        raise WorkerStartError(str(exc)) from exc
    if not models:
        raise WorkerStartError(f"no models installed in {options.models_dir} (expected DIR/*/manifest.json)")
    preload = preloaded(models, options.preload)

    import torch  # only now: a wrong --models fails before torch's seconds of import

    quiet_libraries()  # before the first pipeline is read: no progress bars, no torchvision notice
    if options.threads:
        torch.set_num_threads(options.threads)
    device = options.device or default_device()
    _check(options, device)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # the CUDA context first, so the free figure already counts it
    budget = VramBudget(device, options.vram_mib)
    try:
        limits = options.limits or Limits.from_env()
        fault = InjectedOutOfMemory.from_env()  # a test seam: None unless POTOCOLOM_TEST_OOM is set
        loaded = load_pipelines(preload, device, mode=options.memory_mode, budget=budget, fault=fault, limits=limits)
    except (PipelineLoadError, ValueError) as exc:
        raise WorkerStartError(str(exc)) from exc
    pipelines = loaded.pipelines
    catalog = InstalledCatalog.read(models, dtype_bytes=dtype_bytes_for(device), max_side=limits.max_image_side)
    if not preload:
        log.info("--preload none: connecting with no model loaded; %d installed, loaded when the API asks",
                 len(models))
    elif not pipelines:
        # It stays connected with nothing to serve (an empty models list): the operator sees it in
        # the API, and a restart with more memory or smaller models is all it takes.
        reasons = "; ".join(f"{model_id}: {why}" for model_id, why in loaded.refused.items())
        log.error("no model fits this worker's memory (%s); connecting with none to serve", reasons)
    catalog.step_ms.update(measure_step_times(pipelines))
    realtime = measure_realtime(pipelines, options.frame_budget_ms) if options.realtime else {}
    catalog.capacity.update(realtime)  # a preloaded model unloaded and loaded again is not measured again
    worker_id = options.worker_id or default_worker_id(device)
    on_demand = ModelsOnDemand(catalog, device=device, budget=budget, memory_mode=options.memory_mode,
                               frame_budget_ms=options.frame_budget_ms if options.realtime else None, fault=fault,
                               limits=limits)
    client: WorkerClient | None = None

    def current_gpu() -> dict[str, Any] | None:
        """hello.gpu now: a demoted or unloaded model no longer holds its weights against a
        --vram-mib budget, and one loaded on demand does (the client's pipelines, once it exists)."""
        budget.held_bytes = placed_now(client.pipelines if client is not None else pipelines).resident_bytes
        return budget.gpu_info()

    try:
        config = WorkerConfig(api_url=options.api, token=options.token, worker_id=worker_id, gpu=current_gpu())
        client = WorkerClient(config, pipelines, realtime=realtime, memory_mode=options.memory_mode,
                              gpu_info=current_gpu, limits=limits, drain_seconds=options.drain_seconds,
                              on_demand=on_demand)
    except ValueError as exc:
        raise WorkerStartError(str(exc)) from exc
    client.frames.cap_batches(options.max_batch)
    rungs = ", ".join(f"{model_id} ({pipeline.rung})" for model_id, pipeline in pipelines.items()) or "no model"
    log.info("worker %s serves %s on %s, MEMORY_MODE %s, VRAM budget %s", worker_id, rungs, device,
             options.memory_mode, f"{options.vram_mib} MiB" if options.vram_mib is not None else "not set")
    if loaded.refused:
        log.warning("not served (fit on no rung): %s", ", ".join(loaded.refused))
    return client


async def serve(client: Any) -> int:
    """Run the client until SIGINT (stop at once and close the socket) or SIGTERM (drain: give the
    held jobs and sessions back, then stop; a second SIGTERM stops at once); the exit status
    (client.exit_status: 0 stopped or drained, 1 the drain's deadline passed, 2 a second SIGTERM)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, client.stop)
    loop.add_signal_handler(signal.SIGTERM, client.terminate)
    try:
        await client.run()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return int(client.exit_status)


def run_worker(options: WorkerOptions) -> int:
    """Start and serve; the exit status (see serve). Raises WorkerStartError, or
    connection.TokenRefused when the token is refused."""
    client = build_client(options)
    return asyncio.run(serve(client))
