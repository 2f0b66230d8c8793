"""Start a GPU worker from its options: find the installed models, load them, connect, serve.

`manage.py runworker_gpu` parses flags into WorkerOptions and calls run_worker; nothing else here
knows about Django. torch and diffusers are imported only once run_worker starts.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.gpu.models import discover_models

log = logging.getLogger(__name__)

MEMORY_MODES = ("auto", "full", "model_offload", "group_offload")
IMPLEMENTED_RUNGS = ("full",)  # the memory ladder (offload rungs) comes in a later issue


class WorkerStartError(RuntimeError):
    """The worker cannot start: bad options, no models, or a model that does not load."""


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's command line, parsed (see runworker_gpu)."""

    api: str
    token: str
    models_dir: Path
    models: list[str] | None = None  # --models narrows the installed models
    memory_mode: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    vram_mib: int | None = None  # a pretend VRAM budget (used by the memory ladder)
    worker_id: str | None = None
    threads: int | None = None
    frame_budget_ms: float = 500.0  # FRAME_BUDGET_MS: the per-frame p95 that realtime slots are sized to
    realtime: bool = True  # False (--no-realtime): measure nothing, serve no sessions


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_index(device: str) -> int:
    """0 for "cpu" and "cuda", N for "cuda:N"."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def default_worker_id(device: str) -> str:
    return f"{socket.gethostname()}:{device_index(device)}"


def gpu_info(device: str) -> dict[str, Any] | None:
    """{"name", "total_mib", "free_mib"} of the CUDA device from NVML (torch as a fallback); None on CPU."""
    if not device.startswith("cuda"):
        return None
    index = device_index(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {"name": name.decode() if isinstance(name, bytes) else str(name),
                    "total_mib": int(memory.total) // 2**20, "free_mib": int(memory.free) // 2**20}
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or refusing: torch still knows the basics
        log.warning("NVML gave no GPU info (%s); asking torch", exc)
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return {"name": torch.cuda.get_device_name(index), "total_mib": total // 2**20, "free_mib": free // 2**20}


def _check(options: WorkerOptions, device: str) -> None:
    if options.memory_mode not in MEMORY_MODES:
        raise WorkerStartError(f"--memory-mode must be one of {', '.join(MEMORY_MODES)}, got {options.memory_mode!r}")
    if options.memory_mode not in ("auto", *IMPLEMENTED_RUNGS):
        log.warning("--memory-mode %s is not implemented yet: every model runs on rung full", options.memory_mode)
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise WorkerStartError(f"--device must be cuda, cuda:N or cpu, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise WorkerStartError(f"--device {device}, but torch sees no CUDA device here; use --device cpu")


def measure_realtime(pipelines: dict[str, Any], budget_ms: float) -> dict[str, Any]:
    """Each full-rung img2img model's RealtimeCapacity (frames.measure_capacity), by model_id."""
    from workers.gpu.frames import describe, measure_capacity
    from workers.gpu.pipelines import RUNG_FULL

    capacities = {}
    for model_id, pipeline in pipelines.items():
        if pipeline.rung != RUNG_FULL or pipeline.frames is None:
            continue
        capacity = measure_capacity(pipeline, pipeline.model.params_schema, pipeline.default_size, budget_ms)
        log.info("%s", describe(model_id, capacity, budget_ms))
        capacities[model_id] = capacity
    return capacities


def build_client(options: WorkerOptions) -> Any:
    """Load the installed models and make the WorkerClient (not yet connected)."""
    from workers.gpu.models import ManifestError, UnknownModelError

    # The manifests first: a wrong --models fails in a blink, before torch is even imported.
    try:
        models = discover_models(options.models_dir, options.models)
    except (ManifestError, UnknownModelError) as exc:
        raise WorkerStartError(str(exc)) from exc
    if not models:
        raise WorkerStartError(f"no models installed in {options.models_dir} (expected DIR/*/manifest.json)")

    import torch

    from workers.gpu.client import WorkerClient, WorkerConfig
    from workers.gpu.pipelines import PipelineLoadError, load_pipelines

    if options.threads:
        torch.set_num_threads(options.threads)
    device = options.device or default_device()
    _check(options, device)
    try:
        pipelines = load_pipelines(models, device)
    except PipelineLoadError as exc:
        raise WorkerStartError(str(exc)) from exc
    realtime = measure_realtime(pipelines, options.frame_budget_ms) if options.realtime else {}
    worker_id = options.worker_id or default_worker_id(device)
    try:
        config = WorkerConfig(api_url=options.api, token=options.token, worker_id=worker_id, gpu=gpu_info(device))
        client = WorkerClient(config, pipelines, realtime=realtime)
    except ValueError as exc:
        raise WorkerStartError(str(exc)) from exc
    log.info("worker %s serves %s on %s (vram budget %s MiB)", worker_id, ", ".join(pipelines), device,
             options.vram_mib if options.vram_mib is not None else "not set")
    return client


async def serve(client: Any) -> None:
    """Run the client until SIGINT or SIGTERM (then stop at once and close the socket)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, client.stop)
    try:
        await client.run()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run_worker(options: WorkerOptions) -> None:
    """Start and serve; raises WorkerStartError, or client.TokenRefused when the token is refused."""
    client = build_client(options)
    asyncio.run(serve(client))
