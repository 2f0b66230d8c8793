"""The job queue and the dispatch decision: pure functions over plain data (no database)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from scheduling.policy import QueuedJob, WorkerCapacity, plan_dispatch, retry_decision
from scheduling.queues.memory import MemoryQueues


def job(job_id: str, *, model: str = "m", priority: int = 0, at: int = 0) -> QueuedJob:
    return QueuedJob(job_id=job_id, model_id=model, priority=priority, submitted_us=at)


def queues_of(*jobs: QueuedJob) -> MemoryQueues:
    queues = MemoryQueues()
    for queued in jobs:
        queues.push(queued)
    return queues


def ids(jobs) -> list[str]:
    return [queued.job_id for queued in jobs]


# --- MemoryQueues: order ---------------------------------------------------------------------

ORDER_CASES = [
    # (pushed in this order, expected dispatch order)
    pytest.param([job("a", at=1), job("b", at=2), job("c", at=3)], ["a", "b", "c"], id="equal priority: FIFO"),
    pytest.param([job("c", at=3), job("a", at=1), job("b", at=2)], ["a", "b", "c"], id="FIFO by submission, not push"),
    pytest.param([job("low", priority=0, at=1), job("high", priority=9, at=2)], ["high", "low"],
                 id="higher priority first"),
    pytest.param([job("p1", priority=1, at=1), job("p5a", priority=5, at=2), job("p5b", priority=5, at=3),
                  job("p0", priority=0, at=0)], ["p5a", "p5b", "p1", "p0"], id="priority then FIFO"),
    pytest.param([job("y", at=5), job("x", at=5)], ["x", "y"], id="same instant: job_id breaks the tie"),
]


@pytest.mark.parametrize(("pushed", "expected"), ORDER_CASES)
def test_it_orders_jobs_by_priority_then_submission(pushed, expected):
    queues = queues_of(*pushed)

    assert ids(queues.queued("m")) == expected
    assert [queues.position(job_id) for job_id in expected] == list(range(1, len(expected) + 1))
    assert ids(queues.pop_for(["m"]) for _ in expected) == expected
    assert len(queues) == 0


def test_it_keeps_each_model_in_its_own_queue():
    queues = queues_of(job("a1", model="a", at=1), job("b1", model="b", at=2), job("a2", model="a", at=3))

    assert ids(queues.queued("a")) == ["a1", "a2"]
    assert ids(queues.queued("b")) == ["b1"]
    assert queues.position("a2") == 2 and queues.position("b1") == 1
    assert queues.counts() == {"a": 2, "b": 1}
    assert queues.queued("nobody") == []


def test_it_pops_the_best_job_across_the_models_a_worker_serves():
    queues = queues_of(job("a1", model="a", at=1), job("b-urgent", model="b", priority=3, at=2),
                       job("c1", model="c", at=0))

    assert queues.pop_for(["a", "b"]).job_id == "b-urgent"
    assert queues.pop_for(["a", "b"]).job_id == "a1"
    assert queues.pop_for(["a", "b"]) is None
    assert queues.pop_for([]) is None
    assert ids(queues.queued("c")) == ["c1"]


def test_it_refuses_to_queue_a_job_twice():
    queues = queues_of(job("a", at=1))

    assert queues.push(job("a", at=1)) is False
    assert queues.push(job("a", priority=9, at=0)) is False
    assert ids(queues.queued("m")) == ["a"] and len(queues) == 1


def test_it_gives_a_job_sent_back_its_old_place():
    first, second, third = job("first", at=1), job("second", at=2), job("third", at=3)
    queues = queues_of(first, second, third)
    taken = queues.pop_for(["m"])

    assert queues.position("second") == 1
    queues.push(taken)

    assert ids(queues.queued("m")) == ["first", "second", "third"]
    assert queues.position("first") == 1


def test_it_removes_a_job_from_the_middle_and_closes_the_gap():
    queues = queues_of(job("a", at=1), job("b", at=2), job("c", at=3))

    assert queues.remove("b").job_id == "b"
    assert queues.remove("b") is None
    assert queues.remove("never-queued") is None
    assert "b" not in queues and "a" in queues
    assert queues.position("b") is None
    assert queues.position("c") == 2


def test_it_rebuilds_to_the_same_order_whatever_the_rows_order():
    jobs = [job(f"j{n}", model="ab"[n % 2], priority=n % 3, at=n // 2) for n in range(20)]
    pushed = queues_of(*jobs)
    shuffled = jobs[:]
    random.Random(7).shuffle(shuffled)

    rebuilt = MemoryQueues()
    rebuilt.push(job("stale"))
    rebuilt.rebuild(shuffled)

    assert "stale" not in rebuilt
    for model in "ab":
        assert ids(rebuilt.queued(model)) == ids(pushed.queued(model))
    assert {j.job_id: rebuilt.position(j.job_id) for j in jobs} == {j.job_id: pushed.position(j.job_id) for j in jobs}


# --- MemoryQueues: any interleaving keeps the order (Hypothesis) -------------------------------

MODELS = ("a", "b", "c")


class QueueMachine(RuleBasedStateMachine):
    """Pushes, re-pushes, removals and pops in any order; the queue must always equal the model:
    per model, priority first then submission order, positions 1..n, and a rebuild agrees."""

    queued_jobs = Bundle("queued_jobs")
    taken_jobs = Bundle("taken_jobs")

    def __init__(self) -> None:
        super().__init__()
        self.queues = MemoryQueues()
        self.expected: dict[str, QueuedJob] = {}
        self.submitted = 0

    @staticmethod
    def order(jobs) -> list[str]:
        return [j.job_id for j in sorted(jobs, key=lambda j: (-j.priority, j.submitted_us))]

    @rule(target=queued_jobs, model=st.sampled_from(MODELS), priority=st.integers(0, 9))
    def submit(self, model: str, priority: int) -> QueuedJob:
        self.submitted += 1  # submission order is strictly increasing
        new = QueuedJob(job_id=f"job-{self.submitted:04d}", model_id=model, priority=priority,
                        submitted_us=1_000 * self.submitted)
        assert self.queues.push(new) is True
        self.expected[new.job_id] = new
        return new

    @rule(target=taken_jobs, queued=consumes(queued_jobs))
    def remove(self, queued: QueuedJob) -> QueuedJob:
        removed = self.queues.remove(queued.job_id)
        if queued.job_id in self.expected:
            assert removed == queued
            del self.expected[queued.job_id]
        else:  # popped meanwhile
            assert removed is None
        return queued

    @rule(target=taken_jobs, models=st.sets(st.sampled_from(MODELS)))
    def pop(self, models: set[str]):
        candidates = [j for j in self.expected.values() if j.model_id in models]
        popped = self.queues.pop_for(sorted(models))
        if not candidates:
            assert popped is None
            return popped
        assert popped is not None
        assert popped.job_id == self.order(candidates)[0]
        del self.expected[popped.job_id]
        return popped

    @rule(taken=consumes(taken_jobs))
    def send_back(self, taken: QueuedJob | None) -> None:
        if taken is None or taken.job_id in self.expected:
            return
        assert self.queues.push(taken) is True
        self.expected[taken.job_id] = taken

    @rule(queued=queued_jobs)
    def push_again(self, queued: QueuedJob) -> None:
        pushed = self.queues.push(queued)
        assert pushed is (queued.job_id not in self.expected)
        self.expected[queued.job_id] = queued

    @precondition(lambda self: len(self.expected) > 0)
    @rule(data=st.data())
    def rebuild(self, data) -> None:
        rows = data.draw(st.permutations(list(self.expected.values())))
        self.queues.rebuild(rows)

    @invariant()
    def it_keeps_priority_then_fifo_order_and_positions(self) -> None:
        assert len(self.queues) == len(self.expected)
        for model in MODELS:
            expected = self.order(j for j in self.expected.values() if j.model_id == model)
            assert ids(self.queues.queued(model)) == expected
            assert [self.queues.position(job_id) for job_id in expected] == list(range(1, len(expected) + 1))

    @invariant()
    def it_rebuilds_to_the_same_order(self) -> None:
        rebuilt = MemoryQueues()
        rebuilt.rebuild(reversed(list(self.expected.values())))
        for model in MODELS:
            assert ids(rebuilt.queued(model)) == ids(self.queues.queued(model))


QueueMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestQueueInterleavings = QueueMachine.TestCase


# --- plan_dispatch -------------------------------------------------------------------------------

def worker(worker_id: str, models: str | set[str] = "m", *, held: int = 0, joined: int = 0) -> WorkerCapacity:
    return WorkerCapacity(worker_id=worker_id, models=frozenset({models} if isinstance(models, str) else models),
                          held=held, joined=joined)


def plan(queued: list[QueuedJob], workers: list[WorkerCapacity], **options) -> list[tuple[str, str]]:
    options.setdefault("depth", 2)  # JOB_DISPATCH_DEPTH's default
    return [(a.job.job_id, a.worker_id) for a in plan_dispatch(queues_of(*queued), workers, **options)]


def five_jobs(model: str = "m") -> list[QueuedJob]:
    return [job(f"j{n}", model=model, at=n) for n in range(1, 6)]


PLAN_CASES = [
    pytest.param(five_jobs(), [worker("w")], {}, [("j1", "w"), ("j2", "w")],
                 id="one worker gets at most JOB_DISPATCH_DEPTH"),
    pytest.param(five_jobs(), [worker("w")], {"depth": 3}, [("j1", "w"), ("j2", "w"), ("j3", "w")],
                 id="the depth is a parameter"),
    pytest.param(five_jobs(), [worker("w", held=2)], {}, [], id="a full worker gets nothing"),
    pytest.param(five_jobs(), [worker("w", held=1)], {}, [("j1", "w")], id="a worker holding one gets one more"),
    pytest.param(five_jobs(), [worker("busy", held=1, joined=0), worker("idle", joined=1)], {},
                 [("j1", "idle"), ("j2", "busy"), ("j3", "idle")], id="the least-loaded worker first"),
    pytest.param(five_jobs(), [worker("late", joined=5), worker("early", joined=1)], {},
                 [("j1", "early"), ("j2", "late"), ("j3", "early"), ("j4", "late")],
                 id="earliest joined breaks a tie"),
    pytest.param([job("a1", model="a", at=1), job("b1", model="b", at=2)],
                 [worker("wa", "a", joined=0), worker("wb", "b", joined=1)], {},
                 [("a1", "wa"), ("b1", "wb")], id="each worker only gets its models"),
    pytest.param([job("b1", model="b", at=1), job("b2", model="b", at=2)], [worker("wa", "a")], {}, [],
                 id="no worker serves the model"),
    pytest.param([job("a1", model="a", at=1), job("b-urgent", model="b", priority=9, at=2)],
                 [worker("wab", {"a", "b"})], {}, [("b-urgent", "wab"), ("a1", "wab")],
                 id="across models: priority first"),
    pytest.param([], [worker("w")], {}, [], id="nothing queued"),
    pytest.param(five_jobs(), [], {}, [], id="no worker"),
]


@pytest.mark.parametrize(("queued", "workers", "options", "expected"), PLAN_CASES)
def test_it_plans_dispatches(queued, workers, options, expected):
    assert plan(queued, workers, **options) == expected


def test_it_takes_planned_jobs_off_the_queue_and_leaves_the_rest():
    queues = queues_of(*five_jobs())

    planned = plan_dispatch(queues, [worker("w")], depth=2)

    assert ids(a.job for a in planned) == ["j1", "j2"]
    assert ids(queues.queued("m")) == ["j3", "j4", "j5"]
    assert plan_dispatch(queues, [worker("w", held=2)], depth=2) == []


def test_the_default_depth_is_the_contracts(settings):
    assert settings.JOB_DISPATCH_DEPTH == 2


@st.composite
def dispatch_situations(draw):
    models = ["a", "b", "c"]
    jobs = draw(st.lists(st.tuples(st.sampled_from(models), st.integers(0, 3)), max_size=30))
    queued = [job(f"j{n}", model=m, priority=p, at=n) for n, (m, p) in enumerate(jobs)]
    depth = draw(st.integers(1, 4))
    workers = [worker(f"w{n}", set(draw(st.sets(st.sampled_from(models), max_size=3))),
                      held=draw(st.integers(0, depth)), joined=n) for n in range(draw(st.integers(0, 5)))]
    return queued, workers, depth


@given(dispatch_situations())
@settings(max_examples=200, deadline=None)
def test_it_never_overfills_a_worker_nor_sends_a_job_twice_nor_leaves_a_fitting_worker_idle(situation):
    queued, workers, depth = situation
    queues = queues_of(*queued)
    by_id = {w.worker_id: w for w in workers}

    planned = plan_dispatch(queues, workers, depth=depth)

    sent = [a.job.job_id for a in planned]
    assert len(sent) == len(set(sent)), "a job planned twice"
    held = {w.worker_id: w.held for w in workers}
    for assignment in planned:
        assert assignment.job.model_id in by_id[assignment.worker_id].models
        held[assignment.worker_id] += 1
    for w in workers:
        assert held[w.worker_id] <= max(depth, w.held)
        if held[w.worker_id] < depth:  # room left: nothing of its models may still be queued
            assert all(not queues.queued(model) for model in w.models)
    # What each worker got comes in queue order (priority, then submission).
    for w in workers:
        got = [a.job for a in planned if a.worker_id == w.worker_id]
        assert got == sorted(got, key=lambda j: j.key)


# --- retry_decision -----------------------------------------------------------------------------

@pytest.mark.parametrize(("attempts", "decision"), [(1, "requeue"), (2, "fail"), (3, "fail")])
def test_it_retries_a_job_once_after_its_worker_dies(attempts, decision):
    assert retry_decision(attempts=attempts) == decision
