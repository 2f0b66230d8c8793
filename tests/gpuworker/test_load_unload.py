"""Models loaded and unloaded on the API's word (placement across machines, issue 12), against the
in-process fake API and the real tiny pipeline: the v2 hello's `installed` with each rung's needs,
load_model answered by model_loaded (with step_ms and the memory now free) or model_load_failed
(the worker serving on), unload_model by model_unloaded with every byte back, a load that never
holds up live frames, and an unload that waits for the model's last session."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

from gpuworker.footprints import saved_footprint
from gpuworker.installed import ModelOnDisk, discover_models
from gpuworker.ladder import MIB, ComponentFootprint, Footprint, Placed
from gpuworker.main import WorkerOptions, build_worker
from gpuworker.models_on_demand import InstalledCatalog, LoadRefused, ModelsOnDemand, needs_mib, rung_for_load
from gpuworker.pipelines import DiffusersPipeline
from gpuworker.tiny import tiny_manifest
from gpuworker.vram import VramBudget
from gpuworker.weights import Modules, read_modules
from potocolom.protocol.rungs import RUNGS
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import TEST_SECONDS, run_async
from tests.gpuworker.test_commands import manage
from tests.gpuworker.test_sessions import RED, TWO_SLOTS
from tests.gpuworker.test_worker import SMALL_JOB, make_worker, running

FLOAT32_BYTES = 4  # the tiny model's weights on CPU


@pytest.fixture(scope="module")
def two_models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models dir with tiny-a and tiny-b: two manifests, both on the tiny model's saved files."""
    root = tmp_path_factory.mktemp("two-models")
    for model_id in ("tiny-a", "tiny-b"):
        (root / model_id).mkdir()
        manifest = {**tiny_manifest(), "model_id": model_id, "source": str(models_dir / "tiny")}
        (root / model_id / "manifest.json").write_text(json.dumps(manifest))
    return root


def options(fake: FakeApi, models_dir: Path, **chosen: Any) -> WorkerOptions:
    return WorkerOptions(**{"api": fake.url, "token": "secret", "models_dir": models_dir, "device": "cpu",
                            "worker_id": "load-test:0", "realtime": False, "memory_mode": "auto", **chosen})


def needs_rounded_up(model: ModelOnDisk) -> dict[str, int]:
    """What the ladder says the model needs on each rung, alone on the device, in MiB rounded up."""
    footprint = saved_footprint(model.model_id, model.source, model.params_schema, dtype_bytes=FLOAT32_BYTES,
                                max_side=512)
    return {rung: math.ceil(footprint.needs(rung) / MIB) for rung in RUNGS}


def test_with_preload_none_it_loads_nothing_and_says_what_it_has_installed(two_models: Path) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = build_worker(options(fake, two_models, preload=[], vram_mib=1000))
            async with running(worker):
                hello = await fake.next_message("hello")

        a, b = discover_models(two_models)
        assert hello["models"] == [] and hello["gpu"]["free_mib"] == 1000
        assert hello["installed"] == [{"model_id": "tiny-a", "needs_mib": needs_rounded_up(a), "step_ms": None},
                                      {"model_id": "tiny-b", "needs_mib": needs_rounded_up(b), "step_ms": None}]
        assert hello["installed"][0]["needs_mib"]["full"] > 500  # its working memory at 512x512

    run_async(body())


def test_it_loads_a_model_serves_it_and_unloads_it_giving_every_byte_back(two_models: Path) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = build_worker(options(fake, two_models, preload=[], vram_mib=1000))
            async with running(worker):
                hello = await fake.next_message("hello")
                await fake.send({"type": "load_model", "model_id": "tiny-a"})
                loaded = await fake.next_message("model_loaded", model_id="tiny-a")
                weights = worker.pipelines["tiny-a"].footprint.weights_bytes
                unet = weakref.ref(worker.pipelines["tiny-a"].pipe.unet)
                served = await fake.job(SMALL_JOB, model_id="tiny-a")
                result = await fake.next_message("job_result", job_id=served)

                await fake.send({"type": "unload_model", "model_id": "tiny-a"})
                unloaded = await fake.next_message("model_unloaded", model_id="tiny-a")
                gc.collect()
                after = await fake.job(SMALL_JOB, model_id="tiny-a")
                failed = await fake.next_message("job_failed", job_id=after)
                await fake.send({"type": "unload_model", "model_id": "tiny-a"})  # again: answered all the same
                again = await fake.next_message("model_unloaded", model_id="tiny-a")

        assert {k: loaded[k] for k in ("rung", "realtime", "realtime_slots")} == {
            "rung": "full", "realtime": False, "realtime_slots": 0}
        assert loaded["step_ms"] > 0  # measured at load, on the full rung
        assert hello["gpu"]["free_mib"] - loaded["gpu"]["free_mib"] == math.ceil(weights / MIB)
        assert result["rung"] == "full" and result["images"]
        assert unloaded["gpu"] == again["gpu"] == hello["gpu"]  # every byte back
        assert unet() is None  # nothing holds the model's modules any more
        assert failed["error"] == "model 'tiny-a' is not served by this worker"
        assert "tiny-a" not in worker.pipelines

    run_async(body())


def test_a_model_loaded_again_keeps_its_step_time_and_slots_without_measuring_them_again(
        two_models: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = build_worker(options(fake, two_models, preload=[], vram_mib=1000, realtime=True))
            async with running(worker):
                await fake.next_message("hello")
                answers = []
                for _ in range(2):
                    await fake.send({"type": "load_model", "model_id": "tiny-a"})
                    answers.append(await fake.next_message("model_loaded", model_id="tiny-a"))
                    await fake.send({"type": "unload_model", "model_id": "tiny-a"})
                    await fake.next_message("model_unloaded", model_id="tiny-a")
                await fake.send({"type": "load_model", "model_id": "tiny-a"})
                answers.append(await fake.next_message("model_loaded", model_id="tiny-a"))
                session = await fake.session_start("s-1", model_id="tiny-a")

        first, *again = answers
        assert first["step_ms"] > 0 and first["realtime"] and first["realtime_slots"] >= 1
        for answer in again:
            assert {k: answer[k] for k in ("rung", "step_ms", "realtime", "realtime_slots")} == {
                k: first[k] for k in ("rung", "step_ms", "realtime", "realtime_slots")}
        assert session["type"] == "session_accepted"  # the slots kept are served
        measured = [r for r in caplog.records if "realtime slot(s) within" in r.getMessage()]
        assert len(measured) == 1  # the frames were timed at the first load only

    with caplog.at_level(logging.INFO, logger="gpuworker.loading"):
        run_async(body())


def test_a_preloaded_model_loaded_again_keeps_what_was_measured_at_start(
        two_models: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = build_worker(options(fake, two_models, preload=["tiny-a"], vram_mib=1000, realtime=True))
            async with running(worker):
                hello = await fake.next_message("hello")
                await fake.send({"type": "unload_model", "model_id": "tiny-a"})
                await fake.next_message("model_unloaded", model_id="tiny-a")
                await fake.send({"type": "load_model", "model_id": "tiny-a"})
                again = await fake.next_message("model_loaded", model_id="tiny-a")

        (at_start,) = hello["models"]
        assert at_start["realtime_slots"] >= 1
        assert {k: again[k] for k in ("step_ms", "realtime", "realtime_slots")} == {
            k: at_start[k] for k in ("step_ms", "realtime", "realtime_slots")}
        assert len([r for r in caplog.records if "realtime slot(s) within" in r.getMessage()]) == 1

    with caplog.at_level(logging.INFO, logger="gpuworker.loading"):
        run_async(body())


def test_a_load_that_does_not_fit_fails_with_why_and_the_worker_serves_on(two_models: Path) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            # 556 MiB: tiny-a fits (553 MiB on full), and tiny-b beside it on no rung.
            worker = build_worker(options(fake, two_models, preload=["tiny-a"], vram_mib=556))
            async with running(worker):
                hello = await fake.next_message("hello")
                await fake.send({"type": "load_model", "model_id": "tiny-b", "rung": "full"})
                on_full = await fake.next_message("model_load_failed", model_id="tiny-b")
                await fake.send({"type": "load_model", "model_id": "tiny-b"})
                anywhere = await fake.next_message("model_load_failed", model_id="tiny-b")
                await fake.send({"type": "load_model", "model_id": "not-installed"})
                missing = await fake.next_message("model_load_failed", model_id="not-installed")
                job_id = await fake.job(SMALL_JOB, model_id="tiny-a")
                result = await fake.next_message("job_result", job_id=job_id)

        (entry,) = hello["models"]
        assert entry["model_id"] == "tiny-a" and entry["step_ms"] > 0  # preloaded on full: measured
        installed = {e["model_id"]: e for e in hello["installed"]}
        assert installed["tiny-a"]["step_ms"] == entry["step_ms"] and installed["tiny-b"]["step_ms"] is None
        assert on_full["error"] == "tiny-b needs 553 MiB on rung full, 547 MiB free"
        assert anywhere["error"].startswith("tiny-b fits on no rung: 548 MiB free; full needs 552 MiB")
        assert missing["error"] == "model not-installed is not installed on this worker"
        assert on_full["gpu"] == anywhere["gpu"] == missing["gpu"] == hello["gpu"]  # nothing held by a failed load
        assert result["rung"] == "full" and "tiny-b" not in worker.pipelines

    run_async(body())


def test_frames_of_a_live_session_run_while_another_model_loads(two_models: Path, tiny_pipeline: Any) -> None:
    reading, go_on = threading.Event(), threading.Event()

    def held_read(model: ModelOnDisk, device: str) -> Modules:
        reading.set()
        if not go_on.wait(TEST_SECONDS):
            raise TimeoutError("the test never let the load go on")
        return read_modules(model, device)

    catalog = InstalledCatalog.read(discover_models(two_models), dtype_bytes=FLOAT32_BYTES, max_side=512)
    on_demand = ModelsOnDemand(catalog, device="cpu", budget=VramBudget("cpu"), read=held_read)

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=TWO_SLOTS, on_demand=on_demand)
            async with running(worker):
                await fake.next_message("hello")
                assert (await fake.session_start("s-1"))["type"] == "session_accepted"
                await fake.send({"type": "load_model", "model_id": "tiny-b"})
                assert await asyncio.to_thread(reading.wait, TEST_SECONDS), "the load never started"

                await fake.frame("s-1", 1, RED)
                first = await fake.next_message("frame_result", session_id="s-1")
                await fake.frame("s-1", 2, RED)
                second = await fake.next_message("frame_result", session_id="s-1")
                loaded_meanwhile = [m for m in fake.received if m["type"] == "model_loaded"]
                go_on.set()
                loaded = await fake.next_message("model_loaded", model_id="tiny-b")

        assert (first["seq"], second["seq"]) == (1, 2) and loaded_meanwhile == []
        assert loaded["rung"] == "full" and loaded["gpu"] is None  # no --vram-mib on CPU: no figure

    try:
        run_async(body())
    finally:
        go_on.set()


def test_an_unload_waits_for_the_last_session_and_takes_no_new_work_meanwhile(models_dir: Path) -> None:
    (model,) = discover_models(models_dir)
    pipeline = DiffusersPipeline.load(model, "cpu")  # its own: the unload frees it
    catalog = InstalledCatalog.read([model], dtype_bytes=FLOAT32_BYTES, max_side=512)
    on_demand = ModelsOnDemand(catalog, device="cpu", budget=VramBudget("cpu"))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline}, realtime=TWO_SLOTS, on_demand=on_demand)
            async with running(worker):
                await fake.next_message("hello")
                assert (await fake.session_start("s-1"))["type"] == "session_accepted"
                await fake.send({"type": "unload_model", "model_id": "tiny-sd"})
                refused = await fake.session_start("s-2")
                job_id = await fake.job(SMALL_JOB)
                failed = await fake.next_message("job_failed", job_id=job_id)
                await fake.frame("s-1", 1, RED)
                frame = await fake.next_message("frame_result", session_id="s-1")
                unloaded_meanwhile = [m for m in fake.received if m["type"] == "model_unloaded"]

                await fake.send({"type": "session_end", "session_id": "s-1"})
                unloaded = await fake.next_message("model_unloaded", model_id="tiny-sd")

        assert refused["type"] == "session_refused" and frame["seq"] == 1 and unloaded_meanwhile == []
        assert failed["error"] == "model 'tiny-sd' is not served by this worker"
        assert unloaded["gpu"] is None and worker.pipelines == {} and pipeline.pipe is None

    run_async(body())


def test_preload_refuses_a_model_that_is_not_installed(models_dir: Path) -> None:
    async def body() -> None:
        for preload, error in (("tiny-sd,nope", "--preload names model(s) not installed (after --models): nope "
                                                "(installed: tiny-sd)"),
                               (" , ", "--preload must be all, none or model ids, comma-separated")):
            process = await manage("runworker_gpu", "--api", "ws://127.0.0.1:9", "--token", "t", "--device", "cpu",
                                   "--models-dir", str(models_dir), "--preload", preload)
            _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)
            assert process.returncode != 0 and error in stderr.decode(), stderr.decode()[-2000:]

    run_async(body())


# 300 MiB of weights (unet 200, vae 100), 100 MiB of working memory: full needs 400 MiB alone.
SMALL = Footprint("small", (ComponentFootprint("unet", 200 * MIB, 20 * MIB, 30 * MIB),
                            ComponentFootprint("vae", 100 * MIB, 100 * MIB, 0)), 100 * MIB)


def test_needs_are_the_ladders_figures_beside_what_is_loaded_rounded_up() -> None:
    assert needs_mib(SMALL) == {"full": 400, "model_offload": 300, "group_offload": 200}
    assert needs_mib(SMALL, transient_pool=350 * MIB) == {"full": 650, "model_offload": 350, "group_offload": 350}
    odd = Footprint("odd", (ComponentFootprint("unet", MIB + 1),), 0)
    assert needs_mib(odd)["full"] == 2  # a byte over is a MiB more


@pytest.mark.parametrize(("free_mib", "mode", "asked", "rung_or_error"), [
    pytest.param(1000, "auto", None, "full", id="room: the highest rung"),
    pytest.param(350, "auto", None, "model_offload", id="short: the next rung down"),
    pytest.param(350, "auto", "group_offload", "group_offload", id="the asked rung when it fits"),
    pytest.param(350, "auto", "full", "small needs 400 MiB on rung full, 350 MiB free", id="the asked rung only"),
    pytest.param(100, "auto", None, "small fits on no rung: 100 MiB free", id="nowhere"),
    pytest.param(1000, "model_offload", "full", "small: rung full was asked, but MEMORY_MODE pins rung model_offload",
                 id="never against a pinned MEMORY_MODE"),
    pytest.param(1000, "group_offload", None, "group_offload", id="the pinned rung"),
])
def test_a_load_goes_to_the_highest_rung_that_fits_or_only_the_asked_one(free_mib: int, mode: str, asked: str | None,
                                                                         rung_or_error: str) -> None:
    try:
        choice = rung_for_load(SMALL, Placed(), free_bytes=free_mib * MIB, memory_mode=mode, asked=asked)
    except LoadRefused as exc:
        assert str(exc).startswith(rung_or_error)
    else:
        assert choice.rung == rung_or_error


def test_a_load_beside_a_loaded_model_counts_its_weights_and_the_shared_working_memory() -> None:
    beside = Placed(transient_pool=500 * MIB, resident_bytes=300 * MIB)
    with pytest.raises(LoadRefused, match="small needs 800 MiB on rung full, 700 MiB free"):
        rung_for_load(SMALL, beside, free_bytes=700 * MIB, asked="full")
