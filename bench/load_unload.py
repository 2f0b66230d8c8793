"""Loading and unloading a model on the API's word, on a real device (placement across machines,
issue 12): how long a load takes, the step time the worker reports, and whether an unload gives
the device memory back.

The real worker (gpuworker.main.build_worker, `--preload none`) serves a fake API's socket
(tests.gpuworker.fake_api: the wire messages, nothing else) with one installed model: on CUDA a
random-weight pipeline sized like Stable Diffusion 1.5 (bench/gpu_ladder.py, 2.1 GB in float16),
on CPU the tiny model. The API side sends load_model (each rung in turn, full again at the end),
one job per load, and unload_model, and prints per cycle:

- load s: load_model sent to model_loaded received (reading, placing and, on full, measuring the
  step time and the realtime slots); the first load reads the weights cold (the files' page cache
  dropped with posix_fadvise), later ones from the page cache. Beside it the time bench/placement.py
  assumes for a load of that size (bench.placement.load_seconds);
- step ms: model_loaded's step_ms (measured at load, on full only), and the job's gpu_ms per step;
- free MiB: the worker's own figure (hello, model_loaded, model_unloaded: NVML on CUDA);
- allocated / reserved: torch's caching allocator in this process (the worker's), in MiB.

The baseline is the same run's free memory before each load: after each unload the worker must
be back to it, give or take what is not the model's (the CUDA context's lazily loaded kernels,
cuBLAS workspaces: shown separately), and every later cycle exactly where the first ended (no
leak). The exit status is 1 when a check fails.

    python bench/load_unload.py                         # CUDA: about 2 minutes on an H200
    python bench/load_unload.py --device cpu --cycles 1 # the tiny model on CPU (pretend VRAM)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.placement import load_seconds  # noqa: E402
from tests.gpuworker.fake_api import FakeApi  # noqa: E402

MIB = 2**20
RUNG_ORDER = ("full", "model_offload", "group_offload")
LEAK_TOLERANCE_MIB = 2  # NVML rounds; a leaked model would be hundreds of MiB
WAIT_SECONDS = 300.0


def drop_page_cache(directory: Path) -> int:
    """Ask the kernel to forget the cached pages of every file under `directory` (written back
    first), so the next read comes from the disk; the bytes asked for."""
    total = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += path.stat().st_size
            finally:
                os.close(fd)
    return total


def allocator(cuda: bool) -> tuple[float, float]:
    """(allocated, reserved) MiB in torch's caching allocator; zeros on CPU."""
    if not cuda:
        return 0.0, 0.0
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / MIB, torch.cuda.memory_reserved() / MIB


def nvml_free_mib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    from gpuworker.vram import cuda_memory

    return cuda_memory(device)[2] / MIB


def build_model(root: Path, device: str) -> tuple[str, int]:
    """The installed model under root/<id>; its id and the size of its files."""
    if device.startswith("cuda"):
        from bench.gpu_ladder import make_sd15_sized_model

        manifest = make_sd15_sized_model(root / "sd15-random", device)
    else:
        from gpuworker.tiny import make_tiny_model

        manifest = make_tiny_model(root / "tiny-sd")
    model_id = json.loads(manifest.read_text())["model_id"]
    files = sum(p.stat().st_size for p in manifest.parent.rglob("*") if p.is_file())
    return model_id, files


async def cycles(args: argparse.Namespace, device: str, root: Path, model_id: str) -> list[dict[str, Any]]:
    from gpuworker.main import WorkerOptions, build_worker

    cuda = device.startswith("cuda")
    rows: list[dict[str, Any]] = []
    async with FakeApi(protocol=2) as fake:
        options = WorkerOptions(api=fake.url, token="secret", models_dir=root, device=device, worker_id="bench:0",
                                realtime=args.realtime, memory_mode="auto", preload=[],
                                vram_mib=None if cuda else args.vram_mib)
        worker = build_worker(options)
        task = asyncio.create_task(worker.run())
        try:
            hello = await fake.next_message("hello", WAIT_SECONDS)
            (installed,) = hello["installed"]
            print(f"hello: gpu {hello['gpu']}; {model_id} needs {installed['needs_mib']} MiB; "
                  f"allocated/reserved {allocator(cuda)} MiB")
            before_free = hello["gpu"]["free_mib"] if hello["gpu"] else None
            rungs = [RUNG_ORDER[i % len(RUNG_ORDER)] for i in range(args.cycles * len(RUNG_ORDER))] + ["full"]
            for number, rung in enumerate(rungs, 1):
                cold = number == 1
                if cold:
                    drop_page_cache(root / model_id)
                alloc_before, reserved_before = allocator(cuda)
                started = time.perf_counter()
                await fake.send({"type": "load_model", "model_id": model_id, "rung": rung})
                loaded = await fake.next_message_of(("model_loaded", "model_load_failed"), WAIT_SECONDS,
                                                    model_id=model_id)
                load_s = time.perf_counter() - started
                if loaded["type"] == "model_load_failed":
                    raise SystemExit(f"load {number} ({rung}) failed: {loaded['error']}")
                alloc_loaded, _ = allocator(cuda)
                job_id = await fake.job({"prompt": "a lighthouse at dusk", "width": args.size, "height": args.size,
                                         "steps": args.steps, "seed": number}, model_id=model_id)
                result = await fake.next_message_of(("job_result", "job_failed"), WAIT_SECONDS, job_id=job_id)
                if result["type"] == "job_failed":
                    raise SystemExit(f"the job on {rung} failed: {result['error']}")
                await fake.send({"type": "unload_model", "model_id": model_id})
                unloaded = await fake.next_message("model_unloaded", WAIT_SECONDS, model_id=model_id)
                alloc_after, reserved_after = allocator(cuda)
                rows.append({
                    "n": number, "rung": loaded["rung"], "cold": cold, "load_s": load_s,
                    "needs_full": installed["needs_mib"]["full"],
                    "step_ms": loaded.get("step_ms"), "job_ms_per_step": (result.get("gpu_ms") or 0) / args.steps,
                    "free_before": before_free, "free_loaded": (loaded["gpu"] or {}).get("free_mib"),
                    "free_after": (unloaded["gpu"] or {}).get("free_mib"),
                    "alloc_before": alloc_before, "reserved_before": reserved_before, "alloc_loaded": alloc_loaded,
                    "alloc_after": alloc_after, "reserved_after": reserved_after,
                    "slots": loaded.get("realtime_slots"),
                })
                before_free = rows[-1]["free_after"]
            if cuda:  # what is left that is not the model's: cuBLAS workspaces, the allocator's cache
                import torch

                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
                print(f"after the last unload, cuBLAS workspaces cleared and the cache emptied: "
                      f"{nvml_free_mib(device):.0f} MiB free, allocated/reserved {allocator(cuda)} MiB")
        finally:
            worker.stop()
            await asyncio.wait_for(task, WAIT_SECONDS)
    return rows


def report(rows: list[dict[str, Any]]) -> list[str]:
    """Print the table; the failed checks."""
    def num(value: Any, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    print(f"\n{'#':>2} {'rung':<14}{'load s':>8}{'model s':>8}{'step ms':>9}{'job ms/step':>12}{'slots':>6}"
          f"{'free before':>12}{'loaded':>8}{'after':>8}{'alloc before':>13}{'loaded':>8}{'after':>8}"
          f"{'reserved after':>15}")
    for r in rows:
        name = r["rung"] + (" cold" if r["cold"] else "")
        print(f"{r['n']:>2} {name:<14}{r['load_s']:>8.2f}{load_seconds(r['needs_full']):>8.2f}"
              f"{num(r['step_ms'], '.1f'):>9}{r['job_ms_per_step']:>12.1f}{num(r['slots']):>6}"
              f"{num(r['free_before']):>12}{num(r['free_loaded']):>8}{num(r['free_after']):>8}"
              f"{r['alloc_before']:>13.1f}{r['alloc_loaded']:>8.1f}{r['alloc_after']:>8.1f}{r['reserved_after']:>15.1f}")
    warm = [r for r in rows if r["rung"] == "full" and not r["cold"]]
    if warm:  # what bench/placement.py should assume: this time, scaled by the models' needs
        seconds = sum(r["load_s"] for r in warm) / len(warm)
        assumed = load_seconds(warm[0]["needs_full"])
        print(f"warm loads on full take {seconds:.2f} s against the {assumed:.2f} s bench/placement.py "
              f"assumes; to replay with this: bench/placement.py --load-fixed-seconds 0 "
              f"--load-mib-per-second {warm[0]['needs_full'] / seconds:.0f}")
    failed = []
    first_after = rows[0]["free_after"]
    for r in rows:
        if r["free_after"] is not None and r["free_before"] is not None:
            gap = r["free_before"] - r["free_after"]
            print(f"cycle {r['n']}: {gap:.0f} MiB less free after the unload than before the load")
            if r["n"] > 1 and abs(r["free_after"] - first_after) > LEAK_TOLERANCE_MIB:
                failed.append(f"cycle {r['n']} ends at {r['free_after']} MiB free, the first at {first_after}")
        if r["alloc_after"] > rows[0]["alloc_after"] + 1:
            failed.append(f"cycle {r['n']}: {r['alloc_after']:.1f} MiB allocated after the unload "
                          f"(the first cycle ended at {rows[0]['alloc_after']:.1f})")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--cycles", type=int, default=2, help="rounds over the three rungs (then full once more)")
    parser.add_argument("--size", type=int, default=None, help="the jobs' image size (512 on CUDA, 64 on CPU)")
    parser.add_argument("--steps", type=int, default=20, help="the jobs' denoising steps")
    parser.add_argument("--vram-mib", type=int, default=4096, help="pretend VRAM on CPU")
    parser.add_argument("--realtime", action=argparse.BooleanOptionalAction, default=True,
                        help="measure realtime slots on each full load, as a worker does by default")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.size = args.size or (512 if device.startswith("cuda") else 64)
    if not device.startswith("cuda"):
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device.startswith("cuda") else ""))
    with tempfile.TemporaryDirectory(prefix="load-unload-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model_id, files = build_model(root, device)
        print(f"{model_id}: {files / MIB:,.0f} MiB of files, built in {time.perf_counter() - started:.1f} s")
        rows = asyncio.run(cycles(args, device, root, model_id))
    failed = report(rows)
    for line in failed:
        print("FAILED:", line)
    print("all checks passed" if not failed else f"{len(failed)} check(s) failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
