"""The worker loop against an in-process fake API: the worker socket as docs/protocol.md says."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import random
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from gpuworker.connection import Backoff, TokenRefused, WorkerConfig, worker_socket_url
from gpuworker.jobs import encode_png_b64
from gpuworker.timings import JobTiming, denoise_idle_gaps
from gpuworker.worker import GpuWorker
from tests.gpuworker.fake_api import WELCOME_SENT, FakeApi
from tests.gpuworker.support import TEST_SECONDS, GatedPipeline, run_async

SMALL_JOB = {"prompt": "a small red circle", "width": 64, "height": 64, "steps": 2, "seed": 3}


def make_worker(fake: FakeApi, pipelines: dict[str, Any], **kwargs: Any) -> GpuWorker:
    config = WorkerConfig(api_url=fake.url, token="secret", worker_id="test-host:0",
                          reconnect_initial_seconds=0.05, reconnect_max_seconds=0.2)
    return GpuWorker(config, pipelines, **kwargs)


@contextlib.asynccontextmanager
async def running(worker: GpuWorker) -> AsyncIterator[asyncio.Task[None]]:
    """The worker serving in the background; stopped (and awaited) on the way out."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, TEST_SECONDS)


def png_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return image.size


def types_about(fake: FakeApi, job_id: str) -> list[str]:
    return [m["type"] for m in fake.about(job_id)]


def test_it_says_hello_then_runs_a_job_to_a_png_of_the_requested_size(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            async with running(worker):
                hello = await fake.next_message("hello")
                job_id = await fake.job({**SMALL_JOB, "width": 128})
                result = await fake.next_message("job_result", job_id=job_id)

            assert fake.paths == ["/ws/worker/"]  # no token in the URL: it travels in a header
            assert fake.authorizations == ["Token secret"]
            assert hello["worker_id"] == "test-host:0" and hello["gpu"] is None
            assert hello["models"] == [{"model_id": "tiny-sd", "rung": "full", "realtime": False,
                                        "frame_ms_p95": None, "realtime_slots": 0}]
            assert types_about(fake, job_id) == ["job_started", "job_progress", "job_progress", "job_result"]
            progress = [(m["step"], m["steps"]) for m in fake.about(job_id) if m["type"] == "job_progress"]
            assert progress == [(1, 2), (2, 2)]
            assert [png_size(image) for image in result["images"]] == [(128, 64)]
            assert result["rung"] == "full" and result["gpu_ms"] > 0
            (timing,) = worker.timings
            assert timing.outcome == "succeeded"
            assert timing.received <= timing.denoise_start <= timing.denoise_end <= timing.encode_start  # type: ignore[operator]
            assert timing.encode_start <= timing.encode_end <= timing.sent  # type: ignore[operator]

    run_async(body())


def test_it_heartbeats_every_heartbeat_seconds_from_the_welcome(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(heartbeat_seconds=0.05, unknown_models=["tiny-sd"]) as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                first = await fake.next_message("heartbeat")
                second = await fake.next_message("heartbeat")
            welcome = next(m for m in fake.received if m["type"] == WELCOME_SENT)
            assert fake.index_of(welcome) < fake.index_of(first) < fake.index_of(second)

    run_async(body())


def test_it_sends_nothing_for_a_waiting_job_that_is_cancelled(gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                running_job = await fake.job(SMALL_JOB)
                waiting_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_progress", job_id=running_job, step=1)
                await fake.send({"type": "cancel", "job_id": waiting_job})
                await fake.barrier()  # the cancel was handled while the first job is parked
                gated_pipeline.gate.set()
                later_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_result", job_id=later_job)

            assert types_about(fake, running_job)[-1] == "job_result"
            assert fake.about(waiting_job) == []
            assert [(t.job_id, t.outcome) for t in worker.timings] == [
                (running_job, "succeeded"), (waiting_job, "cancelled"), (later_job, "succeeded")]
            assert worker.timings[1].denoise_start is None

    run_async(body())


def test_it_interrupts_the_running_job_when_it_is_cancelled(gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job({**SMALL_JOB, "steps": 5})
                await fake.next_message("job_progress", job_id=job_id, step=1)
                await fake.send({"type": "cancel", "job_id": job_id})
                await fake.barrier()
                gated_pipeline.gate.set()
                next_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_result", job_id=next_job)

            assert types_about(fake, job_id) == ["job_started", "job_progress"]  # nothing after the cancel
            assert worker.timings[0].outcome == "cancelled"

    run_async(body())


def test_it_ignores_a_job_it_already_holds(gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                await fake.next_message("job_started", job_id=job_id)
                await fake.job(SMALL_JOB, job_id=job_id)  # as after a reconnect
                await fake.barrier()
                gated_pipeline.gate.set()
                next_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_result", job_id=next_job)

            assert types_about(fake, job_id).count("job_started") == 1
            assert types_about(fake, job_id).count("job_result") == 1
            assert [t.job_id for t in worker.timings] == [job_id, next_job]

    run_async(body())


def test_it_refuses_sessions_without_realtime_and_ignores_their_messages(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                await fake.send({"type": "session_start", "session_id": "s-1", "model_id": "tiny-sd",
                                 "params": {"prompt": "p"}})
                refused = await fake.next_message("session_refused", session_id="s-1")
                await fake.send({"type": "frame", "session_id": "s-2", "seq": 1, "image": "AAAA", "params": {}})
                await fake.send({"type": "session_end", "session_id": "s-2"})
                await fake.barrier()

            assert "no realtime slots" in refused["reason"]
            assert [m for m in fake.received if m.get("session_id") == "s-2"] == []

    run_async(body())


def test_it_survives_bad_and_unknown_messages(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})) as task:
                await fake.next_message("hello")
                for raw in ("not json", "[1, 2]", '{"type": "bogus"}', '{"type": ["job"]}', '{"no": "type"}',
                            '{"type": "job"}', '{"type": "cancel", "job_id": 5}', '{"type": "session_start"}'):
                    await fake.send(raw)
                job_id = await fake.job(SMALL_JOB)
                await fake.next_message("job_result", job_id=job_id)
                assert not task.done()

    run_async(body())


def test_it_reports_a_failed_job_with_a_short_error(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                bad_params = await fake.job({"prompt": "p", "width": 100})
                unknown_model = await fake.job(SMALL_JOB, model_id="not-here")
                failed = await fake.next_message("job_failed", job_id=bad_params)
                unknown = await fake.next_message("job_failed", job_id=unknown_model)

            assert "width" in failed["error"] and len(failed["error"]) < 600
            assert "not-here" in unknown["error"]

    run_async(body())


def test_it_delivers_results_produced_while_the_api_was_down_after_the_next_welcome(tiny_pipeline: Any) -> None:
    api_down = threading.Event()
    encoded = threading.Event()

    def encode_once_the_api_is_down(images: Sequence[Any]) -> list[str]:
        assert api_down.wait(TEST_SECONDS)
        try:
            return encode_png_b64(images)
        finally:
            encoded.set()

    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, encode=encode_once_the_api_is_down)
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(SMALL_JOB)
                await fake.next_message("job_started", job_id=job_id)
                await fake.stop()  # the API dies
                api_down.set()
                assert await asyncio.to_thread(encoded.wait, TEST_SECONDS)  # the result exists, nowhere to go
                await fake.start()  # the API is back on the same port
                hello = await fake.next_message("hello", _connection=2)
                result = await fake.next_message("job_result", job_id=job_id)

            welcome = next(m for m in fake.received if m["type"] == WELCOME_SENT and m["_connection"] == 2)
            assert result["_connection"] == 2
            assert fake.index_of(hello) < fake.index_of(welcome) < fake.index_of(result)
            assert [png_size(image) for image in result["images"]] == [(64, 64)]
            assert worker.connection.welcomes == 2

    run_async(body())


def test_it_starts_denoising_the_next_job_before_the_previous_result_is_sent(tiny_pipeline: Any) -> None:
    second_started = threading.Event()
    calls: list[int] = []

    def slow_encode(images: Sequence[Any]) -> list[str]:
        calls.append(len(calls))
        if len(calls) == 1:  # hold the first result until the second job is denoising
            assert second_started.wait(TEST_SECONDS), "the second job never started while the first encoded"
        return encode_png_b64(images)

    async def body() -> None:
        async with FakeApi() as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, encode=slow_encode)
            async with running(worker):
                await fake.next_message("hello")
                first, second = await fake.job(SMALL_JOB), await fake.job(SMALL_JOB)
                started = await fake.next_message("job_started", job_id=second)
                second_started.set()
                first_result = await fake.next_message("job_result", job_id=first)
                await fake.next_message("job_result", job_id=second)

            assert fake.index_of(started) < fake.index_of(first_result)
            one, two = worker.timings
            assert one.denoise_end <= two.denoise_start < one.encode_end <= one.sent  # type: ignore[operator]
            (gap,) = denoise_idle_gaps(worker.timings)
            assert gap >= 0

    run_async(body())


def test_it_exits_with_a_clear_error_when_the_token_is_refused(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(refuse_token=True) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            with pytest.raises(TokenRefused, match="refused the worker token"):
                await worker.run()
            assert len(fake.paths) == 1  # no retry

    run_async(body())


@pytest.mark.parametrize(("api", "url"), [
    ("ws://127.0.0.1:8000", "ws://127.0.0.1:8000/ws/worker/"),
    ("ws://host:1/", "ws://host:1/ws/worker/"),
    ("http://host:1", "ws://host:1/ws/worker/"),
    ("wss://host/ws/worker/", "wss://host/ws/worker/"),
])
def test_it_builds_the_worker_socket_address(api: str, url: str) -> None:
    assert worker_socket_url(api) == url


def test_it_refuses_an_api_address_that_is_not_a_websocket() -> None:
    with pytest.raises(ValueError, match="ws://HOST:PORT"):
        worker_socket_url("127.0.0.1:8000")
    with pytest.raises(ValueError, match="no query string"):
        worker_socket_url("ws://host:1/?token=t")


def test_it_sends_the_token_in_the_authorization_header_a_checking_api_accepts(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(token="s3cret") as fake:
            config = WorkerConfig(api_url=fake.url, token="s3cret", worker_id="test-host:0")
            async with running(GpuWorker(config, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
            assert fake.authorizations == ["Token s3cret"] and fake.paths == ["/ws/worker/"]

    run_async(body())


def test_it_backs_off_exponentially_with_jitter_up_to_ten_seconds() -> None:
    backoff = Backoff(rng=random.Random(4))
    delays = [backoff.next_delay() for _ in range(8)]
    nominal = [0.5, 1, 2, 4, 8, 10, 10, 10]

    assert all(0.75 * n <= d <= 1.25 * n for d, n in zip(delays, nominal, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, so many workers do not reconnect in step
    backoff.reset()
    assert backoff.next_delay() <= 0.5 * 1.25


def test_it_measures_idle_gaps_only_between_back_to_back_jobs() -> None:
    timings = [
        JobTiming("a", "m", received=0.0, denoise_start=0.0, denoise_end=1.0),
        JobTiming("b", "m", received=0.5, denoise_start=1.25, denoise_end=2.0),  # waited: gap 0.25
        JobTiming("c", "m", received=5.0, denoise_start=5.0, denoise_end=6.0),  # arrived later: no gap
        JobTiming("d", "m", received=5.5, denoise_start=None),  # cancelled before it ran
    ]

    assert denoise_idle_gaps(timings) == [0.25]
