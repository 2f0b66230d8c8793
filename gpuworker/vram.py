"""What the memory ladder plans against: free VRAM (NVML, which sees other processes too, else
torch), system RAM (psutil), and the pretend budget of `--vram-mib` on a machine without CUDA;
docs/design/memory-ladder.md."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gpuworker.ladder import MIB

log = logging.getLogger(__name__)


def device_index(device: str) -> int:
    """0 for "cpu" and "cuda", N for "cuda:N"."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def cuda_memory(device: str) -> tuple[str, int, int]:
    """(name, total bytes, free bytes) of a CUDA device, from NVML or, failing that, from torch."""
    index = device_index(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return (name.decode() if isinstance(name, bytes) else str(name)), int(memory.total), int(memory.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML missing or refusing: torch still knows the basics
        log.debug("NVML gave no GPU memory figure (%s); asking torch", exc)
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return torch.cuda.get_device_name(index), int(total), int(free)


def available_ram_bytes() -> int | None:
    """System RAM available to new allocations (psutil), None when psutil cannot tell."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception as exc:  # psutil missing, or an odd platform
        log.warning("psutil gave no RAM figure (%s)", exc)
        return None


def give_back_device_memory(device: str) -> None:
    """Collect dropped modules and hand the allocator's cached blocks back to the device."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


class VramBudget:
    """What is free for the next model: the device's free memory now, or `--vram-mib` less the
    weights the worker already holds resident (the smaller of the two when both exist).

    `hold`/`release` keep the pretend budget in step with what models keep resident; a CUDA
    figure is read fresh each time (after the allocator's cache is given back).
    """

    def __init__(self, device: str, budget_mib: int | None = None, *,
                 probe: Callable[[str], tuple[str, int, int]] = cuda_memory):
        self.device = device
        self.budget_bytes = None if budget_mib is None else budget_mib * MIB
        self.held_bytes = 0
        self._probe = probe

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def free_bytes(self) -> int | None:
        """Free now; None when there is neither a CUDA device nor a budget."""
        figures = []
        if self.on_cuda:
            give_back_device_memory(self.device)
            figures.append(self._probe(self.device)[2])
        if self.budget_bytes is not None:
            figures.append(self.budget_bytes - self.held_bytes)
        return min(figures) if figures else None

    def hold(self, n_bytes: int) -> None:
        self.held_bytes += n_bytes

    def release(self, n_bytes: int) -> None:
        self.held_bytes = max(0, self.held_bytes - n_bytes)

    def gpu_info(self) -> dict[str, Any] | None:
        """hello.gpu: {"name", "total_mib", "free_mib"}; the pretend budget on CPU; None on CPU without one."""
        if self.on_cuda:
            name, total, free = self._probe(self.device)
            if self.budget_bytes is not None:
                total, free = min(total, self.budget_bytes), min(free, self.budget_bytes - self.held_bytes)
            return {"name": name, "total_mib": total // MIB, "free_mib": max(0, free) // MIB}
        if self.budget_bytes is None:
            return None
        return {"name": "cpu (pretend VRAM from --vram-mib)", "total_mib": self.budget_bytes // MIB,
                "free_mib": max(0, self.budget_bytes - self.held_bytes) // MIB}
