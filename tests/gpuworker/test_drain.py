"""Drain (SIGTERM) from the worker's side, against the in-process fake API and the real tiny
pipeline: `terminate()` (what the SIGTERM handler calls) says `draining` first, gives back the
running job at its next step boundary with its checkpoint (which resumes elsewhere to the
uninterrupted run's image) and a waiting one with step 0 and null, ends live sessions with
session_ended, and run() returns with exit status 0 once the API acknowledged it all; unacknowledged
answers hold it until the deadline (exit status 1); a second terminate() stops at once (2)."""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from gpuworker.checkpoints import Checkpoint
from gpuworker.drain import EXIT_DRAIN_TIMED_OUT, EXIT_DRAINED, EXIT_STOPPED_AT_ONCE
from tests.gpuworker import test_preemption as preemption
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import TEST_SECONDS, run_async
from tests.gpuworker.test_commands import manage, worker_args
from tests.gpuworker.test_preemption import JOB_A, JOB_B, resumed_elsewhere
from tests.gpuworker.test_sessions import TWO_SLOTS
from tests.gpuworker.test_worker import make_worker, running, types_about

parking, uninterrupted = preemption.parking, preemption.uninterrupted  # the preemption tests' fixtures


def test_a_drain_says_draining_then_gives_back_both_jobs_and_exits_0_once_acknowledged(
        parking: Any, tiny_pipeline: Any, uninterrupted: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 2))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker) as task:
                await fake.next_message("hello")
                running_job = await fake.job(JOB_A, priority=0, account="k1")
                waiting_job = await fake.job(JOB_B, priority=0, account="k2")
                await fake.next_message("job_progress", job_id=running_job, step=2)
                await fake.barrier()  # both held

                worker.terminate()

                waiting = await fake.next_message("job_preempted", job_id=waiting_job)  # the other still parked
                pipeline.go_on(JOB_A["prompt"], 2)
                answer = await fake.next_message("job_preempted", job_id=running_job)
                await asyncio.wait_for(task, TEST_SECONDS)  # it stops by itself, once acknowledged
                assert worker.exit_status == EXIT_DRAINED and worker.unacknowledged == []

            draining = await fake.next_message("draining")
            assert fake.index_of(draining) < fake.index_of(waiting) < fake.index_of(answer)
            assert waiting == {"type": "job_preempted", "job_id": waiting_job, "step": 0, "steps": 2,
                               "checkpoint": None, "_connection": 1}
            assert (answer["step"], answer["steps"]) == (2, 4)
            assert Checkpoint.from_base64(answer["checkpoint"]).step == 2
            result, _ = await resumed_elsewhere(tiny_pipeline, running_job, JOB_A,
                                                {"step": 2, "checkpoint": answer["checkpoint"]})
            assert result["images"] == uninterrupted(JOB_A)

    run_async(body())


def test_a_drain_ends_live_sessions_with_session_ended(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, realtime=TWO_SLOTS)
            async with running(worker) as task:
                await fake.next_message("hello")
                assert (await fake.session_start("s-1"))["type"] == "session_accepted"  # after the welcome

                worker.terminate()

                ended = await fake.next_message("session_ended", session_id="s-1")
                await asyncio.wait_for(task, TEST_SECONDS)

            assert fake.index_of(await fake.next_message("draining")) < fake.index_of(ended)
            assert not worker.sessions.holds("s-1") and worker.exit_status == EXIT_DRAINED

    run_async(body())


def test_a_job_sent_during_the_drain_is_given_back_at_once(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline})
            async with running(worker) as task:
                await fake.next_message("hello")
                done = await fake.job(JOB_B)
                await fake.next_message("job_result", job_id=done)  # not acknowledged yet: the drain waits
                worker.terminate()
                await fake.next_message("draining")
                late = await fake.job(JOB_B)  # crossed our `draining` on the wire

                answer = await fake.next_message("job_preempted", job_id=late)
                await fake.ack(done)
                await fake.ack(late)
                await asyncio.wait_for(task, TEST_SECONDS)

            # It may have begun its first step meanwhile: given back at the first boundary, never run out.
            assert answer["step"] < answer["steps"] and "job_result" not in types_about(fake, late)
            assert worker.exit_status == EXIT_DRAINED

    run_async(body())


def test_a_drain_whose_answers_are_not_acknowledged_exits_1_at_its_deadline(tiny_pipeline: Any) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": tiny_pipeline}, drain_seconds=0.5)
            async with running(worker) as task:
                await fake.next_message("hello")
                job_id = await fake.job(JOB_B)
                await fake.next_message("job_result", job_id=job_id)  # never acknowledged

                worker.terminate()
                await asyncio.wait_for(task, TEST_SECONDS)

            assert worker.exit_status == EXIT_DRAIN_TIMED_OUT and worker.unacknowledged == [job_id]

    run_async(body())


def test_a_second_terminate_during_the_drain_stops_at_once_with_status_2(parking: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline}, drain_seconds=10 * TEST_SECONDS)
            async with running(worker) as task:
                await fake.next_message("hello")
                job_id = await fake.job(JOB_A)
                await fake.next_message("job_progress", job_id=job_id, step=1)
                worker.terminate()
                await fake.next_message("draining")

                worker.terminate()  # the drain would wait far longer for job_ack than this test runs
                pipeline.go_on(JOB_A["prompt"], 1)
                await asyncio.wait_for(task, TEST_SECONDS)

            assert worker.exit_status == EXIT_STOPPED_AT_ONCE

    run_async(body())


# --- as a command: real SIGTERMs to a real runworker_gpu process ---------------------------------

def test_runworker_gpu_drains_on_sigterm_and_exits_0_or_2_on_a_second_one(models_dir: Path) -> None:
    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            process = await manage(*worker_args(fake, models_dir, "secret"), "--no-realtime", "--drain-seconds", "600")
            try:
                await fake.next_message("hello", timeout=TEST_SECONDS)
                job_id = await fake.job({"prompt": "a red circle", "width": 64, "height": 64, "steps": 2})
                await fake.next_message("job_result", job_id=job_id)  # not acknowledged: the drain waits for it
                process.send_signal(signal.SIGTERM)
                await fake.next_message("draining")
                await fake.ack(job_id)
                _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)
            finally:
                if process.returncode is None:
                    process.kill()
            assert process.returncode == 0, stderr.decode()[-2000:]
            assert "drained: every job given back and acknowledged" in stderr.decode()

            process = await manage(*worker_args(fake, models_dir, "secret"), "--no-realtime", "--drain-seconds", "600")
            try:
                await fake.next_message("hello", timeout=TEST_SECONDS)
                job_id = await fake.job({"prompt": "a red circle", "width": 64, "height": 64, "steps": 2})
                await fake.next_message("job_result", job_id=job_id)  # never acknowledged
                process.send_signal(signal.SIGTERM)
                await fake.next_message("draining")
                process.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(process.communicate(), TEST_SECONDS)
            finally:
                if process.returncode is None:
                    process.kill()
            assert process.returncode == EXIT_STOPPED_AT_ONCE, stderr.decode()[-2000:]

    run_async(body())
