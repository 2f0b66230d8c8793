"""Out of memory during a job, against the in-process fake API with the real tiny pipeline.

CUDA cannot run out of memory on this machine, so a torch.OutOfMemoryError is injected at the one
seam where a job calls its diffusers pipeline (InjectedOutOfMemory, passed to the pipeline).
"""
from __future__ import annotations

import base64
import io
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpuworker.installed import ModelOnDisk, discover_models
from gpuworker.pipelines import DiffusersPipeline, InjectedOutOfMemory
from gpuworker.slots import RealtimeCapacity
from potocolom.protocol.rungs import RUNG_FULL, RUNG_GROUP_OFFLOAD, RUNG_MODEL_OFFLOAD
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import run_async
from tests.gpuworker.test_worker import SMALL_JOB, make_worker, running

ONE_SLOT = RealtimeCapacity(frame_ms_p95=150.0, slots=1, width=64, height=64, steps=2, measured={})


@pytest.fixture(scope="module")
def tiny_model(models_dir: Path) -> ModelOnDisk:
    (model,) = discover_models(models_dir)
    return model


@pytest.fixture(scope="module")
def expected_png_pixels(tiny_pipeline: DiffusersPipeline) -> np.ndarray:
    """SMALL_JOB's pixels on full residency, through the same PNG round trip."""
    (image,) = tiny_pipeline.generate(SMALL_JOB)
    return np.asarray(image.convert("RGB"))


def png_pixels(b64: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB"))


def loaded(model: ModelOnDisk, rung: str = RUNG_FULL, ooms: int = 0) -> DiffusersPipeline:
    """A fresh tiny pipeline whose next `ooms` job calls run out of memory."""
    return DiffusersPipeline.load(model, "cpu", rung, fault=InjectedOutOfMemory({model.model_id: ooms}))


def test_it_moves_the_model_down_reloads_it_retries_the_job_and_says_rung_changed(
        tiny_model: ModelOnDisk, expected_png_pixels: np.ndarray) -> None:
    pipeline = loaded(tiny_model, ooms=1)
    other = loaded(replace(tiny_model, model_id="tiny-b"))

    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline, "tiny-b": other})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                changed = await fake.next_message("rung_changed")
                result = await fake.next_message("job_result", job_id=job_id)
                other_id = await fake.job(SMALL_JOB, model_id="tiny-b")
                other_result = await fake.next_message("job_result", job_id=other_id)

            assert changed == {"type": "rung_changed", "model_id": "tiny-sd", "rung": "model_offload",
                               "realtime": False, "frame_ms_p95": None, "realtime_slots": 0, "_connection": 1}
            assert fake.index_of(changed) < fake.index_of(result)
            assert result["rung"] == "model_offload" and result["gpu_ms"] > 0
            assert np.array_equal(png_pixels(result["images"][0]), expected_png_pixels)  # the same seed, same pixels
            assert [m["type"] for m in fake.about(job_id)].count("job_started") == 1
            assert pipeline.rung == RUNG_MODEL_OFFLOAD
            # The other model was never touched, and ran on.
            assert other.rung == RUNG_FULL and other_result["rung"] == "full"
            assert worker.hello_message()["models"][0]["rung"] == "model_offload"
            assert worker.timings[0].rung == "model_offload" and worker.timings[0].outcome == "succeeded"
            assert "on rung model_offload, gpu" in worker.timings[0].summary()

    run_async(body())


def test_a_second_out_of_memory_error_on_the_retry_fails_the_job(tiny_model: ModelOnDisk) -> None:
    pipeline = loaded(tiny_model, ooms=2)

    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": pipeline})):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                failed = await fake.next_message("job_failed", job_id=job_id)
                next_id = await fake.job(SMALL_JOB)
                result = await fake.next_message("job_result", job_id=next_id)

            assert failed["error"].startswith("out of memory again on rung model_offload after moving down from full:")
            assert [m["rung"] for m in fake.received if m["type"] == "rung_changed"] == ["model_offload"]
            assert result["rung"] == "model_offload"  # the model stays where it moved to

    run_async(body())


@pytest.mark.parametrize("mode", [RUNG_FULL, RUNG_MODEL_OFFLOAD, RUNG_GROUP_OFFLOAD])
def test_a_pinned_rung_never_moves_and_the_job_fails_with_a_clear_error(tiny_model: ModelOnDisk,
                                                                         mode: str) -> None:
    pipeline = loaded(tiny_model, mode, ooms=1)

    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": pipeline}, memory_mode=mode)):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                failed = await fake.next_message("job_failed", job_id=job_id)
                next_id = await fake.job(SMALL_JOB)
                result = await fake.next_message("job_result", job_id=next_id)

            assert failed["error"].startswith(f"out of memory on rung {mode}, pinned by MEMORY_MODE={mode}:")
            assert "injected by a test" in failed["error"]
            assert not [m for m in fake.received if m["type"] == "rung_changed"]
            assert pipeline.rung == mode and result["rung"] == mode

    run_async(body())


def test_on_the_lowest_rung_an_out_of_memory_error_fails_the_job(tiny_model: ModelOnDisk) -> None:
    pipeline = loaded(tiny_model, RUNG_GROUP_OFFLOAD, ooms=1)

    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": pipeline})):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                failed = await fake.next_message("job_failed", job_id=job_id)

            assert failed["error"].startswith("out of memory on rung group_offload, the lowest there is:")
            assert pipeline.rung == RUNG_GROUP_OFFLOAD

    run_async(body())


def test_leaving_full_residency_ends_the_models_live_sessions_and_its_realtime(tiny_model: ModelOnDisk) -> None:
    pipeline = loaded(tiny_model, ooms=1)

    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline}, realtime={"tiny-sd": ONE_SLOT})
            async with running(worker):
                hello = await fake.next_message("hello")
                live = str(uuid.uuid4())
                assert (await fake.session_start(live))["type"] == "session_accepted"
                await fake.job(SMALL_JOB)
                changed = await fake.next_message("rung_changed")
                later = await fake.session_start(str(uuid.uuid4()))

            assert hello["models"][0]["realtime"] is True
            assert (changed["rung"], changed["realtime"], changed["realtime_slots"]) == ("model_offload", False, 0)
            assert not worker.sessions.holds(live)
            assert later["type"] == "session_refused" and "no realtime slots" in later["reason"]

    run_async(body())


def test_the_injected_fault_is_read_from_one_test_only_variable() -> None:
    fault = InjectedOutOfMemory.from_env({"POTOCOLOM_TEST_OOM": "tiny-sd:2, other:1"})

    assert InjectedOutOfMemory.from_env({}) is None
    assert fault is not None and fault.counts == {"tiny-sd": 2, "other": 1}
    with pytest.raises(ValueError, match="POTOCOLOM_TEST_OOM must be MODEL_ID:COUNT"):
        InjectedOutOfMemory.from_env({"POTOCOLOM_TEST_OOM": "tiny-sd"})
