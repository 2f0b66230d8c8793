"""Live drawing sessions against the in-process fake API: slots, refusals, batched frames.

To know that frames are queued together, the denoising thread is parked inside a job's step
(GatedPipeline); frames run between that job's steps once the gate opens. No timing assumptions.
"""
from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

from gpuworker.slots import RealtimeCapacity
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import TEST_SECONDS, GatedPipeline, run_async
from tests.gpuworker.test_worker import SMALL_JOB, make_worker, running

TWO_SLOTS = {"tiny-sd": RealtimeCapacity(frame_ms_p95=210.5, slots=2, width=64, height=64, steps=2, measured={})}


def png_b64(rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


RED, BLUE = png_b64((220, 20, 20)), png_b64((20, 20, 220))


def jpeg_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "JPEG"
        return image.size


async def park_in_a_job(fake: FakeApi, pipeline: GatedPipeline) -> str:
    """Start a two-step job and wait until the denoising thread is parked in its first step: past
    the step's report and the frames run after it, so that frames sent now wait for the gate."""
    job_id = await fake.job(SMALL_JOB)
    await fake.next_message("job_progress", job_id=job_id, step=1)
    assert await asyncio.to_thread(pipeline.parked.wait, TEST_SECONDS), "the job never reached the gate"
    return job_id


def test_it_advertises_realtime_with_its_measured_frame_time_and_slots(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=TWO_SLOTS)):
                hello = await fake.next_message("hello")

            assert hello["models"] == [{"model_id": "tiny-sd", "rung": "full", "realtime": True,
                                        "frame_ms_p95": 210.5, "realtime_slots": 2}]

    run_async(body())


def test_it_accepts_sessions_while_it_has_slots_and_refuses_the_rest_with_a_reason(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=TWO_SLOTS)):
                await fake.next_message("hello")
                first = await fake.session_start("s-1")
                second = await fake.session_start("s-2", {"width": 128, "height": 64, "steps": 3})
                again = await fake.session_start("s-1")  # a repeated start takes no second slot
                full = await fake.session_start("s-3")
                await fake.send({"type": "session_end", "session_id": "s-1"})
                freed = await fake.session_start("s-3")
                not_integer = await fake.session_start("s-4", {"width": "64"})
                not_allowed = await fake.session_start("s-5", {"steps": 0})
                unknown = await fake.session_start("s-6", model_id="not-here")

            assert [m["type"] for m in (first, second, again, freed)] == ["session_accepted"] * 4
            assert full["type"] == "session_refused" and "no free realtime slot" in full["reason"]
            assert not_integer["type"] == "session_refused" and "width must be an integer" in not_integer["reason"]
            assert not_allowed["type"] == "session_refused" and "steps" in not_allowed["reason"]
            assert unknown["type"] == "session_refused" and "not-here" in unknown["reason"]

    run_async(body())


def test_it_refuses_sessions_for_a_model_without_realtime_slots(tiny_pipeline: Any) -> None:
    no_slots = {"tiny-sd": RealtimeCapacity(frame_ms_p95=900.0, slots=0, width=64, height=64, steps=2, measured={})}

    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=no_slots)):
                hello = await fake.next_message("hello")
                refused = await fake.session_start("s-1")
                await fake.frame("s-1", 1, RED)  # a frame of a session it does not hold
                await fake.send({"type": "session_end", "session_id": "s-1"})
                await fake.barrier()

            assert hello["models"][0] == {"model_id": "tiny-sd", "rung": "full", "realtime": False,
                                          "frame_ms_p95": 900.0, "realtime_slots": 0}
            assert refused["type"] == "session_refused" and "no realtime slots" in refused["reason"]
            assert fake.frames_of("s-1") == []

    run_async(body())


def test_it_batches_frames_of_two_sessions_and_runs_only_the_newest_of_each(
        gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline}, realtime=TWO_SLOTS)
            async with running(worker):
                await fake.next_message("hello")
                await fake.session_start("a")
                await fake.session_start("b")
                job_id = await park_in_a_job(fake, gated_pipeline)
                await fake.frame("a", 1, RED, prompt="old")
                await fake.frame("b", 7, BLUE, prompt="a blue sea", strength=0.6)
                await fake.frame("a", 2, RED, prompt="a red cat", strength=0.9)
                await fake.barrier()  # all three are queued while the thread is parked
                gated_pipeline.gate.set()
                a = await fake.next_message("frame_result", session_id="a")
                b = await fake.next_message("frame_result", session_id="b")
                await fake.next_message("job_result", job_id=job_id)

            assert (a["seq"], a["batch_size"], b["seq"], b["batch_size"]) == (2, 2, 7, 2)
            assert [m["seq"] for m in fake.frames_of("a")] == [2]  # seq 1 was replaced, never run
            assert jpeg_size(a["image"]) == jpeg_size(b["image"]) == (64, 64)
            assert a["gpu_ms"] == b["gpu_ms"] > 0
            assert worker.frames.batch_sizes == [2]
            ((started, _),) = worker.frames.runs
            (job,) = worker.timings
            assert job.denoise_start < started < job.denoise_end  # type: ignore[operator]  # between its steps

    run_async(body())


def test_it_sends_no_frames_of_an_ended_session_and_skips_undecodable_ones(gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline}, realtime=TWO_SLOTS)
            async with running(worker):
                await fake.next_message("hello")
                for session_id in ("a", "b"):
                    await fake.session_start(session_id)
                job_id = await park_in_a_job(fake, gated_pipeline)
                await fake.frame("a", 1, RED)
                await fake.frame("b", 1, base64.b64encode(b"not an image").decode())
                await fake.send({"type": "session_end", "session_id": "a"})
                await fake.frame("a", 2, RED)  # after its end: ignored
                await fake.barrier()
                gated_pipeline.gate.set()
                await fake.next_message("job_result", job_id=job_id)
                await fake.frame("b", 2, BLUE)  # the session lives on after a bad frame
                b = await fake.next_message("frame_result", session_id="b")
                c = await fake.session_start("c")  # a's slot is free again

            assert fake.frames_of("a") == []
            assert [(m["seq"], m["batch_size"]) for m in fake.frames_of("b")] == [(2, 1)]
            assert b["seq"] == 2 and c["type"] == "session_accepted"
            assert worker.frames.batch_sizes == [1]

    run_async(body())


def test_it_forgets_its_sessions_when_the_connection_drops(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=TWO_SLOTS)
            async with running(worker):
                await fake.next_message("hello")
                await fake.session_start("a")
                await fake.session_start("b")
                await fake.stop()
                await fake.start()
                await fake.next_message("hello", _connection=2)
                again = await fake.session_start("c")
                await fake.frame("a", 1, RED)  # a session of the lost connection
                await fake.barrier()

            assert again["type"] == "session_accepted"
            assert not worker.sessions.holds("a") and fake.frames_of("a") == []

    run_async(body())
