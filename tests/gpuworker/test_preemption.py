"""Step-boundary scheduling from the worker's side, against the in-process fake API and the real tiny
pipeline: `preempt` answered with job_preempted (a checkpoint mid-job, step 0 and null before the
start; kept until acknowledged), a resumed order giving the uninterrupted run's image bytes, a
checkpoint it cannot use restarting the job from step 0, priority overtaking within one account
at a step boundary (and never across accounts), and periodic job_checkpoint by the injected clock."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gpuworker.checkpoints import Checkpoint
from gpuworker.jobs import encode_png_b64
from gpuworker.step_hooks import PreemptedAtStep, StepHooks
from tests.gpuworker.fake_api import FakeApi
from tests.gpuworker.support import TEST_SECONDS, around_progress, run_async
from tests.gpuworker.test_worker import make_worker, running, types_about

JOB_A = {"prompt": "a blue square", "width": 64, "height": 64, "steps": 4, "seed": 5}
JOB_B = {"prompt": "a green triangle", "width": 64, "height": 64, "steps": 2, "seed": 8}


class ParkingPipeline:
    """The real pipeline, parked right after chosen step reports (prompt, step) until the test lets
    it go on: a test then sends messages while a given job sits at a given step boundary."""

    def __init__(self, inner: Any, *parks: tuple[str, int]):
        self.inner = inner
        self.rung = inner.rung
        self.parks = {park: threading.Event() for park in parks}

    def go_on(self, prompt: str, step: int) -> None:
        self.parks[(prompt, step)].set()

    def release_all(self) -> None:
        for park in self.parks.values():
            park.set()

    def generate(self, params: Any, *, hooks: StepHooks | None = None, resume: Any = None) -> Any:
        def park(step: int, steps: int) -> None:
            park = self.parks.get((params["prompt"], step))
            if park is not None and not park.wait(TEST_SECONDS):
                raise TimeoutError("the test never let the job go on")

        return self.inner.generate(params, hooks=around_progress(hooks, after=park), resume=resume)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SteppingClock:
    """The worker's clock: it moves only when a step of a job ends (by `seconds_per_step`)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class ClockedPipeline:
    """The real pipeline, each of whose steps takes `seconds_per_step` of the stepping clock."""

    def __init__(self, inner: Any, clock: SteppingClock, seconds_per_step: float):
        self.inner, self.rung, self.clock, self.seconds_per_step = inner, inner.rung, clock, seconds_per_step

    def generate(self, params: Any, *, hooks: StepHooks | None = None, resume: Any = None) -> Any:
        def tick(step: int, steps: int) -> None:
            self.clock.advance(self.seconds_per_step)

        return self.inner.generate(params, hooks=around_progress(hooks, before=tick), resume=resume)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def uninterrupted(tiny_pipeline: Any) -> Any:
    """The job_result images of a job run without interruption (the worker's own PNG encoding)."""
    cache: dict[str, list[str]] = {}

    def images(params: dict[str, Any]) -> list[str]:
        key = repr(sorted(params.items()))
        if key not in cache:
            cache[key] = encode_png_b64(tiny_pipeline.generate(params))
        return cache[key]

    return images


@pytest.fixture
def parking(tiny_pipeline: Any) -> Iterator[Any]:
    made: list[ParkingPipeline] = []

    def make(*parks: tuple[str, int]) -> ParkingPipeline:
        made.append(ParkingPipeline(tiny_pipeline, *parks))
        return made[-1]

    yield make
    for pipeline in made:
        pipeline.release_all()  # never leave a denoising thread parked


def steps_of(fake: FakeApi, job_id: str) -> list[int]:
    return [m["step"] for m in fake.about(job_id) if m["type"] == "job_progress"]


def resumed_elsewhere(tiny_pipeline: Any, job_id: str, params: dict[str, Any], resume: dict[str, Any]) -> Any:
    """Run the order `job` with `resume` on a fresh worker; (its job_result, the messages about it)."""
    async def body() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with FakeApi(protocol=2) as fake:
            async with running(make_worker(fake, {"tiny-sd": tiny_pipeline})):
                await fake.next_message("hello")
                await fake.job(params, job_id=job_id, priority=0, account="k1", resume=resume)
                result = await fake.next_message("job_result", job_id=job_id)
            return result, fake.about(job_id)

    return body()


# --- preempt ------------------------------------------------------------------------------------

def test_a_preempted_running_job_answers_with_its_checkpoint_and_resumes_elsewhere_to_the_same_image(
        parking: Any, tiny_pipeline: Any, uninterrupted: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 2))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(JOB_A, priority=0, account="k1")
                await fake.next_message("job_progress", job_id=job_id, step=2)
                await fake.send({"type": "preempt", "job_id": job_id})
                await fake.barrier()
                pipeline.go_on(JOB_A["prompt"], 2)
                answer = await fake.next_message("job_preempted", job_id=job_id)
                await fake.barrier()
                assert worker.unacknowledged == [] and job_id not in worker.hello_message()["jobs"]

            assert (answer["step"], answer["steps"]) == (2, 4)
            assert types_about(fake, job_id) == ["job_started", "job_progress", "job_progress", "job_preempted"]
            assert Checkpoint.from_base64(answer["checkpoint"]).step == 2
            assert worker.timings[0].outcome == "preempted"

            result, messages = await resumed_elsewhere(tiny_pipeline, job_id, JOB_A,
                                                       {"step": 2, "checkpoint": answer["checkpoint"]})
            assert result["images"] == uninterrupted(JOB_A)
            assert [m["type"] for m in messages] == ["job_started", "job_progress", "job_progress", "job_result"]
            assert [m["step"] for m in messages if m["type"] == "job_progress"] == [3, 4]  # on from k+1

    run_async(body())


def test_a_job_preempted_before_it_started_answers_step_0_without_a_checkpoint_at_once(parking: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker):
                await fake.next_message("hello")
                running_job = await fake.job(JOB_A)
                waiting_job = await fake.job(JOB_B)
                await fake.next_message("job_progress", job_id=running_job, step=1)
                await fake.send({"type": "preempt", "job_id": waiting_job})
                answer = await fake.next_message("job_preempted", job_id=waiting_job)  # the other still parked
                pipeline.go_on(JOB_A["prompt"], 1)
                await fake.next_message("job_result", job_id=running_job)
                await fake.barrier()

            assert answer == {"type": "job_preempted", "job_id": waiting_job, "step": 0, "steps": 2,
                              "checkpoint": None, "_connection": 1}
            assert types_about(fake, waiting_job) == ["job_preempted"]  # it never started
            assert worker.timings[1].denoise_start is None

    run_async(body())


def test_a_job_preempted_is_sent_again_after_a_reconnect_until_it_is_acknowledged(parking: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2, auto_ack=False) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker):
                await fake.next_message("hello")
                running_job = await fake.job(JOB_A)
                waiting_job = await fake.job(JOB_B)
                await fake.next_message("job_progress", job_id=running_job, step=1)
                await fake.send({"type": "preempt", "job_id": waiting_job})
                first = await fake.next_message("job_preempted", job_id=waiting_job)
                await fake.stop()
                await fake.start()
                hello = await fake.next_message("hello", _connection=2)
                again = await fake.next_message("job_preempted", job_id=waiting_job, _connection=2)
                await fake.ack(waiting_job)
                pipeline.go_on(JOB_A["prompt"], 1)
                await fake.next_message("job_result", job_id=running_job)
                await fake.ack(running_job)
                await fake.barrier()
                assert worker.unacknowledged == []

            assert waiting_job in hello["jobs"]
            assert {k: v for k, v in again.items() if k != "_connection"} == {
                k: v for k, v in first.items() if k != "_connection"}

    run_async(body())


# --- resume -------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint", ["garbage", "bad base64 !", "other-params"])
def test_a_resume_it_cannot_use_restarts_the_job_from_step_0_and_never_fails_it(
        tiny_pipeline: Any, uninterrupted: Any, checkpoint: str) -> None:
    if checkpoint == "other-params":  # a real checkpoint, of a job of another size
        done: list[int] = []
        hooks = StepHooks(progress=lambda step, steps, preview: done.append(step), preempted=lambda: len(done) == 1)
        with pytest.raises(PreemptedAtStep) as other:
            tiny_pipeline.generate({**JOB_A, "width": 128}, hooks=hooks)
        assert other.value.checkpoint is not None
        checkpoint = other.value.checkpoint.to_base64()

    result, messages = run_async(resumed_elsewhere(tiny_pipeline, "5b0f6c1e-3d7a-4c1b-9f0e-2a8d4e6b7c91", JOB_A,
                                                   {"step": 1, "checkpoint": checkpoint}))

    assert result["images"] == uninterrupted(JOB_A)
    assert [m["step"] for m in messages if m["type"] == "job_progress"] == [1, 2, 3, 4]


# --- priority at every step ---------------------------------------------------------------------

@pytest.mark.parametrize(("first", "then", "overtakes"), [
    ({"account": "k1", "priority": 0}, {"account": "k1", "priority": 5}, True),
    ({}, {"priority": 5}, True),  # jobs without an account count as one account
    ({"account": "k1", "priority": 0}, {"account": "k2", "priority": 9}, False),
    ({"account": "k1", "priority": 5}, {"account": "k1", "priority": 5}, False),
], ids=["same-account", "no-account", "other-account", "same-priority"])
def test_a_higher_priority_job_of_the_same_account_overtakes_the_running_one_at_a_step_boundary(
        parking: Any, uninterrupted: Any, first: dict[str, Any], then: dict[str, Any], overtakes: bool) -> None:
    pipeline = parking((JOB_A["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker):
                await fake.next_message("hello")
                a = await fake.job(JOB_A, **first)
                await fake.next_message("job_progress", job_id=a, step=1)
                b = await fake.job(JOB_B, **then)
                await fake.barrier()
                pipeline.go_on(JOB_A["prompt"], 1)
                a_result = await fake.next_message("job_result", job_id=a)
                b_result = await fake.next_message("job_result", job_id=b)

            assert a_result["images"] == uninterrupted(JOB_A)  # set aside or not, the same pixels
            assert b_result["images"] == uninterrupted(JOB_B)
            assert steps_of(fake, a) == [1, 2, 3, 4] and steps_of(fake, b) == [1, 2]
            assert types_about(fake, a).count("job_started") == 1
            b_started = fake.index_of(fake.about(b)[0])
            if overtakes:  # b ran between a's steps 1 and 2, and a went back after it
                a_step_2 = next(m for m in fake.about(a) if m.get("step") == 2)
                assert fake.index_of(fake.about(a)[1]) < b_started < fake.index_of(b_result) < fake.index_of(a_step_2)
            else:  # b began once a's denoising ended (a's image is encoded beside b's first steps)
                a_step_4 = next(m for m in fake.about(a) if m.get("step") == 4)
                assert fake.index_of(a_step_4) < b_started
            assert [t.outcome for t in worker.timings] == ["succeeded", "succeeded"]

    run_async(body())


def test_a_job_set_aside_for_another_answers_preempt_at_once_with_the_checkpoint_it_was_set_aside_with(
        parking: Any, tiny_pipeline: Any, uninterrupted: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 1), (JOB_B["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            async with running(make_worker(fake, {"tiny-sd": pipeline})):
                await fake.next_message("hello")
                a = await fake.job(JOB_A, account="k1", priority=0)
                await fake.next_message("job_progress", job_id=a, step=1)
                b = await fake.job(JOB_B, account="k1", priority=1)
                await fake.barrier()
                pipeline.go_on(JOB_A["prompt"], 1)
                await fake.next_message("job_progress", job_id=b, step=1)  # b runs, a is set aside
                await fake.send({"type": "preempt", "job_id": a})
                answer = await fake.next_message("job_preempted", job_id=a)  # b still parked
                pipeline.go_on(JOB_B["prompt"], 1)
                await fake.next_message("job_result", job_id=b)
                await fake.barrier()

            assert (answer["step"], answer["steps"]) == (1, 4)
            assert types_about(fake, a) == ["job_started", "job_progress", "job_preempted"]  # it never went back
            resume = {"step": 1, "checkpoint": answer["checkpoint"]}
            result, _ = await resumed_elsewhere(tiny_pipeline, a, JOB_A, resume)
            assert result["images"] == uninterrupted(JOB_A)

    run_async(body())


def test_a_job_set_aside_for_another_that_is_cancelled_is_answered_at_once(parking: Any) -> None:
    pipeline = parking((JOB_A["prompt"], 1), (JOB_B["prompt"], 1))

    async def body() -> None:
        async with FakeApi(protocol=2) as fake:
            worker = make_worker(fake, {"tiny-sd": pipeline})
            async with running(worker):
                await fake.next_message("hello")
                a = await fake.job(JOB_A, priority=0)
                await fake.next_message("job_progress", job_id=a, step=1)
                b = await fake.job(JOB_B, priority=1)
                await fake.barrier()
                pipeline.go_on(JOB_A["prompt"], 1)
                await fake.next_message("job_progress", job_id=b, step=1)
                await fake.send({"type": "cancel", "job_id": a})
                failed = await fake.next_message("job_failed", job_id=a)  # b still parked
                pipeline.go_on(JOB_B["prompt"], 1)
                await fake.next_message("job_result", job_id=b)
                await fake.barrier()

            assert failed["error"] == "cancelled"
            assert steps_of(fake, a) == [1]
            assert worker.unacknowledged == []

    run_async(body())


# --- periodic checkpoints -----------------------------------------------------------------------

def test_a_running_job_sends_its_checkpoint_at_the_first_step_boundary_after_each_checkpoint_seconds(
        tiny_pipeline: Any, uninterrupted: Any) -> None:
    clock = SteppingClock()
    params = {**JOB_A, "steps": 6}

    async def body() -> None:
        async with FakeApi(protocol=2, checkpoint_seconds=5) as fake:
            worker = make_worker(fake, {"tiny-sd": ClockedPipeline(tiny_pipeline, clock, 3.0)}, clock=clock)
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(params)
                await fake.next_message("job_result", job_id=job_id)

            checkpoints = [m for m in fake.about(job_id) if m["type"] == "job_checkpoint"]
            # steps end at 3, 6, 9, 12, 15, 18 s: due at 5 s, then 5 s after each one sent
            assert [(m["step"], m["steps"]) for m in checkpoints] == [(2, 6), (4, 6), (6, 6)]
            kinds = types_about(fake, job_id)
            assert kinds.index("job_checkpoint") == kinds.index("job_progress") + 2  # right after step 2
            for message in checkpoints[:2]:
                resumed = tiny_pipeline.generate(params, resume=Checkpoint.from_base64(message["checkpoint"]))
                assert encode_png_b64(resumed) == uninterrupted(params)

    run_async(body())


def test_the_running_time_before_a_job_was_set_aside_counts_towards_its_next_checkpoint(
        parking: Any, uninterrupted: Any) -> None:
    clock = SteppingClock()
    params = {**JOB_A, "steps": 6}
    pipeline = ClockedPipeline(parking((JOB_A["prompt"], 1)), clock, 3.0)

    async def body() -> None:
        async with FakeApi(protocol=2, checkpoint_seconds=5) as fake:
            async with running(make_worker(fake, {"tiny-sd": pipeline}, clock=clock)):
                await fake.next_message("hello")
                a = await fake.job(params, account="k1", priority=0)
                await fake.next_message("job_progress", job_id=a, step=1)
                b = await fake.job(JOB_B, account="k1", priority=1)
                await fake.barrier()
                pipeline.inner.go_on(JOB_A["prompt"], 1)
                await fake.next_message("job_result", job_id=b)
                result = await fake.next_message("job_result", job_id=a)

            assert result["images"] == uninterrupted(params)
            checkpoints = [(m["step"], m["steps"]) for m in fake.about(a) if m["type"] == "job_checkpoint"]
            # a: step 1 ends at 3 s (2 s of its 5 left), b runs 6 s, a goes on at 9 s: due at 11 s, at
            # its step 2 (12 s); counted afresh from 9 s it would be step 3 (15 s)
            assert checkpoints == [(2, 6), (4, 6), (6, 6)]

    run_async(body())


@pytest.mark.parametrize(("protocol", "seconds"), [(2, 0), (2, None), (None, 5)], ids=["zero", "absent", "v1-api"])
def test_no_job_checkpoint_is_sent_without_a_v2_checkpoint_period(tiny_pipeline: Any, protocol: int | None,
                                                                   seconds: float | None) -> None:
    clock = SteppingClock()

    async def body() -> None:
        async with FakeApi(protocol=protocol, checkpoint_seconds=seconds) as fake:
            worker = make_worker(fake, {"tiny-sd": ClockedPipeline(tiny_pipeline, clock, 60.0)}, clock=clock)
            async with running(worker):
                await fake.next_message("hello")
                job_id = await fake.job(JOB_A)
                await fake.next_message("job_result", job_id=job_id)

            assert "job_checkpoint" not in types_about(fake, job_id)

    run_async(body())
