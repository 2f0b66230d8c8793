"""The v2 worker socket from the worker's side, against the in-process fake API: the hello's
protocol and held jobs, final messages kept until job_ack (sent again after a reconnect and every
heartbeat), cancel answered at the next step boundary with no image decoded, and the bounds."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuworker.outbox import Outbox, Outgoing
from tests.gpuworker.fake_api import WELCOME_SENT, FakeApi
from tests.gpuworker.support import GatedPipeline, run_async
from tests.gpuworker.test_worker import SMALL_JOB, make_worker, running, types_about

ONE_STEP = {**SMALL_JOB, "steps": 1}


@pytest.fixture
def own_pipeline(models_dir: Path) -> Any:
    """The tiny model loaded afresh (a test may watch its modules without touching the shared one)."""
    from gpuworker.installed import discover_models
    from gpuworker.pipelines import DiffusersPipeline

    (model,) = discover_models(models_dir)
    return DiffusersPipeline.load(model, "cpu")


@pytest.fixture
def decodes(own_pipeline: Any) -> Iterator[list[int]]:
    """Counts the VAE decoder's calls on `own_pipeline` (a forward pre-hook, removed after)."""
    calls: list[int] = []
    handle = own_pipeline.pipe.vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    handle.remove()


def welcome_index(fake: FakeApi, connection: int) -> int:
    return next(i for i, m in enumerate(fake.received) if m["type"] == WELCOME_SENT and m["_connection"] == connection)


def test_a_v2_hello_says_protocol_2_and_lists_the_jobs_it_holds(gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline})
            async with running(worker):
                first = await fake.next_message("hello")
                running_job = await fake.job(SMALL_JOB)
                waiting_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_progress", job_id=running_job, step=1)
                await fake.barrier()  # both jobs are held now
                await fake.stop()
                await fake.start()
                second = await fake.next_message("hello", _connection=2)
                gated_pipeline.gate.set()
                await fake.next_message("job_result", job_id=running_job)
                await fake.next_message("job_result", job_id=waiting_job)
                await fake.stop()  # both ended, neither acknowledged: the next hello still lists them
                await fake.start()
                third = await fake.next_message("hello", _connection=3)

            assert (first["protocol"], first["jobs"]) == (2, [])
            assert second["protocol"] == 2 and second["jobs"] == [running_job, waiting_job]
            assert third["jobs"] == [running_job, waiting_job]

    run_async(body())


def test_it_sends_a_final_message_again_after_a_reconnect_until_it_is_acknowledged(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(ONE_STEP)
                first = await fake.next_message("job_result", job_id=job_id)
                await fake.stop()  # the API dies before it acknowledged the result
                await fake.start()
                hello = await fake.next_message("hello", _connection=2)
                again = await fake.next_message("job_result", job_id=job_id, _connection=2)
                await fake.ack(job_id)
                await fake.barrier()
                assert worker.unacknowledged == []
                await fake.stop()
                await fake.start()
                after_ack = await fake.next_message("hello", _connection=3)
                await fake.barrier()

            assert hello["jobs"] == [job_id]
            assert fake.index_of(again) > welcome_index(fake, 2)  # right after the welcome
            assert again["images"] == first["images"]
            assert after_ack["jobs"] == []
            assert [m["_connection"] for m in fake.about(job_id) if m["type"] == "job_result"] == [1, 2]

    run_async(body())


def test_it_sends_an_unacknowledged_final_message_every_heartbeat_period(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False, heartbeat_seconds=0.05) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(ONE_STEP)
                first = await fake.next_message("job_result", job_id=job_id)
                again = await fake.next_message("job_result", job_id=job_id)  # no ack: it comes again
                await fake.ack(job_id)
                await fake.barrier()
                sent = len([m for m in fake.about(job_id) if m["type"] == "job_result"])
                acked_at = len(fake.received)
                beats = 0
                while beats < 3:  # three more periods: nothing more about an acknowledged job
                    beat = await fake.next_message("heartbeat")
                    beats += fake.index_of(beat) >= acked_at
                await fake.barrier()

            heartbeats_between = [m for m in fake.received[fake.index_of(first):fake.index_of(again)]
                                  if m["type"] == "heartbeat"]
            assert heartbeats_between  # it went again at a heartbeat, not in a busy loop
            assert len([m for m in fake.about(job_id) if m["type"] == "job_result"]) == sent
            assert worker.unacknowledged == []

    run_async(body())


def test_against_a_v1_api_a_result_is_sent_once_and_forgotten(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi() as fake:  # a v1 API: its welcome has no protocol, and it never acks
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(ONE_STEP)
                await fake.next_message("job_result", job_id=job_id)
                await fake.barrier()
                assert worker.connection.protocol == 1 and worker.unacknowledged == []
                await fake.stop()
                await fake.start()
                hello = await fake.next_message("hello", _connection=2)
                await fake.barrier()

            assert hello["jobs"] == []
            assert types_about(fake, job_id) == ["job_started", "job_progress", "job_result"]

    run_async(body())


def test_a_v2_cancel_stops_the_running_job_at_the_next_step_without_decoding(own_pipeline: Any,
                                                                             decodes: list[int]) -> None:
    gated = GatedPipeline(own_pipeline)

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": gated})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job({**SMALL_JOB, "steps": 50})
                await fake.next_message("job_progress", job_id=job_id, step=1)
                await fake.send({"type": "cancel", "job_id": job_id})
                await fake.barrier()
                gated.gate.set()
                failed = await fake.next_message("job_failed", job_id=job_id)
                assert decodes == []  # the cancelled job's latents were never decoded
                next_job = await fake.job(ONE_STEP)
                await fake.next_message("job_result", job_id=next_job)

            assert failed["error"] == "cancelled"
            assert types_about(fake, job_id) == ["job_started", "job_progress", "job_failed"]  # step 1 of 50 only
            assert decodes == [1]  # the next job decoded as usual: the pipeline is whole
            assert worker.unacknowledged == []  # the fake acknowledged both

    try:
        run_async(body())
    finally:
        gated.gate.set()


def test_a_v2_cancel_of_a_waiting_job_is_answered_at_once_and_kept_until_acknowledged(
        gated_pipeline: GatedPipeline) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": gated_pipeline})
            async with running(worker):
                await fake.next_message("hello")
                running_job = await fake.job(SMALL_JOB)
                waiting_job = await fake.job(SMALL_JOB)
                await fake.next_message("job_progress", job_id=running_job, step=1)
                await fake.send({"type": "cancel", "job_id": waiting_job})
                failed = await fake.next_message("job_failed", job_id=waiting_job)  # while the other is parked
                await fake.stop()
                await fake.start()
                hello = await fake.next_message("hello", _connection=2)
                again = await fake.next_message("job_failed", job_id=waiting_job, _connection=2)
                gated_pipeline.gate.set()
                await fake.next_message("job_result", job_id=running_job)

            assert failed["error"] == again["error"] == "cancelled"
            assert hello["jobs"] == [running_job, waiting_job]
            assert types_about(fake, waiting_job) == ["job_failed", "job_failed"]  # it never started
            assert worker.timings[1].denoise_start is None

    run_async(body())


def test_it_keeps_at_most_the_capped_number_of_unacknowledged_results(tiny_pipeline: Any,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, outbox=Outbox(max_finals=2))
            async with running(worker):
                await fake.next_message("hello")
                jobs = [await fake.job(ONE_STEP) for _ in range(4)]
                for job_id in jobs:
                    await fake.next_message("job_result", job_id=job_id)
                await fake.stop()
                await fake.start()
                hello = await fake.next_message("hello", _connection=2)
                resent = [await fake.next_message("job_result", job_id=job_id, _connection=2) for job_id in jobs[2:]]
                await fake.barrier()

            assert worker.unacknowledged == jobs[2:], (worker.unacknowledged, hello["jobs"], jobs)
            assert hello["jobs"] == jobs[2:], (hello["jobs"], jobs)
            assert [m["job_id"] for m in fake.received if m["type"] == "job_result" and m["_connection"] == 2] == [
                m["job_id"] for m in resent]
            assert caplog.text.count("dropping the unacknowledged job_result") == 2

    with caplog.at_level(logging.WARNING, logger="gpuworker.outbox"):
        run_async(body())


def test_it_keeps_timings_of_the_latest_jobs_only(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, keep_timings=3)
            async with running(worker):
                await fake.next_message("hello")
                jobs = []
                for _ in range(7):
                    jobs.append(await fake.job(ONE_STEP))
                    await fake.next_message("job_result", job_id=jobs[-1])
                    assert len(worker.timings) <= 3

            assert [t.job_id for t in worker.timings] == jobs[-3:]
            assert worker.unacknowledged == []

    run_async(body())


def final(job_id: str, size: int = 10) -> Outgoing:
    return Outgoing("job_result", "x" * size, None, job_id)


def test_the_outbox_drops_the_oldest_final_message_past_its_byte_cap() -> None:
    outbox = Outbox(max_finals=10, max_final_bytes=25)
    for job_id in ("a", "b", "c"):
        outbox.append(final(job_id))

    assert outbox.final_ids == ["b", "c"]
    assert not outbox.wanted(outbox.peek())  # type: ignore[arg-type]  # a's queued copy goes nowhere


def test_the_outbox_resends_only_what_was_sent_before_the_last_heartbeat() -> None:
    outbox = Outbox()
    early, late = final("a"), final("b")
    for out in (early, late):
        outbox.append(out)
        outbox.popleft()
    outbox.sent(early, now=1.0, await_ack=True)
    outbox.sent(late, now=2.5, await_ack=True)

    assert outbox.resend_sent_before(2.0) == 1 and outbox.peek() is early
    assert outbox.ack("a") is early and not outbox.wanted(early)
    assert outbox.final_ids == ["b"]
