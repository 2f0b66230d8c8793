"""The job queue and the dispatch decision: pure functions over plain data (no database)."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from potocolom.protocol.rungs import RUNGS
from scheduling.policy import (
    HeldJob,
    Holding,
    Move,
    Preemption,
    QueuedJob,
    Turn,
    WorkerCapacity,
    plan_dispatch,
    plan_moves,
    plan_preemptions,
    retry_decision,
)
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


def test_it_pops_the_oldest_turn_across_the_models_a_worker_serves():
    queues = queues_of(job("a1", model="a", at=1), job("b-urgent", model="b", priority=3, at=2),
                       job("c1", model="c", at=0))

    # each model's queue has its own turns: a's (its oldest job, t=1) comes before b's (t=2);
    # priority orders an account's jobs within one model's queue
    assert queues.pop_for(["a", "b"]).job_id == "a1"
    assert queues.pop_for(["a", "b"]).job_id == "b-urgent"
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


# --- MemoryQueues: fair share between accounts (the contract's example) -----------------------
# Each case fills the queue it is given: tests/scheduling/queues/test_redis.py runs them on Redis too.

def contract_example(queues):
    """alice submits a1..a6, then bob b1, b2, all priority 0, one model, no worker."""
    for n in range(1, 7):
        queues.push(QueuedJob(f"a{n}", "m", 0, n, "alice"))
    for n in range(1, 3):
        queues.push(QueuedJob(f"b{n}", "m", 0, 6 + n, "bob"))
    return queues


def accounts_take_turns_whatever_came_first(queues):
    contract_example(queues)
    expected = ["a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6"]

    assert [queues.position(job_id) for job_id in expected] == list(range(1, 9))
    assert ids(queues.queued("m")) == expected
    assert ids(queues.pop_for(["m"], at_us=100 + n) for n in range(8)) == expected


def a_high_priority_job_takes_its_own_accounts_turn_and_never_moves_another_back(queues):
    contract_example(queues)
    queues.push(QueuedJob("a7", "m", 9, 9, "alice"))

    assert ids(queues.queued("m"))[:5] == ["a7", "b1", "a1", "b2", "a2"]
    assert queues.position("b1") == 2 and queues.position("b2") == 4


def an_account_arriving_later_joins_the_round_after_those_served_before_it(queues):
    contract_example(queues)
    assert ids([queues.pop_for(["m"], at_us=100), queues.pop_for(["m"], at_us=101)]) == ["a1", "b1"]
    queues.push(QueuedJob("c1", "m", 0, 102, "carol"))

    assert queues.position("c1") == 3
    assert ids(queues.pop_for(["m"], at_us=200 + n) for n in range(7)) == ["a2", "b2", "c1", "a3", "a4", "a5", "a6"]


def a_job_sent_back_keeps_its_place_in_its_line_and_the_account_its_turn(queues):
    contract_example(queues)
    a1 = queues.pop_for(["m"], at_us=100)
    assert a1.turn_us == 100
    queues.push(a1)  # its worker died

    assert ids(queues.queued("m"))[:4] == ["b1", "a1", "b2", "a2"]  # alice's turn stayed at 100
    assert queues.turns() == [Turn("m", "alice", 100)]


def a_paused_job_leaves_the_queue_and_its_resume_puts_it_back_at_its_old_place(queues):
    contract_example(queues)
    paused = queues.remove("a2")  # pausing a queued job takes it out; its row keeps its key
    assert queues.position("a2") is None
    assert ids(queues.queued("m")) == ["a1", "b1", "a3", "b2", "a4", "a5", "a6"]
    assert ids([queues.pop_for(["m"], at_us=100), queues.pop_for(["m"], at_us=101)]) == ["a1", "b1"]

    queues.push(paused)  # resumed: alice's turn (100) comes before bob's (101), and a2 heads her line

    assert ids(queues.queued("m")) == ["a2", "b2", "a3", "a4", "a5", "a6"]
    assert queues.position("a2") == 1
    assert queues.turns() == [Turn("m", "alice", 100), Turn("m", "bob", 101)]


def the_turns_survive_a_rebuild_from_the_database_rows(queues):
    contract_example(queues)
    queues.pop_for(["m"], at_us=100)
    rows, turns = queues.queued("m"), queues.turns()

    queues.rebuild(reversed(rows), turns)

    assert ids(queues.queued("m")) == ["b1", "a2", "b2", "a3", "a4", "a5", "a6"]
    assert queues.turns() == [Turn("m", "alice", 100)]


def across_a_workers_models_the_oldest_turn_goes_first(queues):
    for queued in [QueuedJob("alice-x", "x", 9, 1, "alice"), QueuedJob("alice-x2", "x", 9, 2, "alice"),
                   QueuedJob("bob-y", "y", 0, 3, "bob"), QueuedJob("alice-y", "y", 0, 0, "alice")]:
        queues.push(queued)

    # alice's turn on y is the oldest (her job of t=0); a turn on y takes a job of y
    assert queues.pop_for(["x", "y"], at_us=10).job_id == "alice-y"
    assert queues.pop_for(["x", "y"], at_us=11).job_id == "alice-x"  # her turn on x: t=1
    assert queues.pop_for(["x", "y"], at_us=12).job_id == "bob-y"  # t=3 beats alice's 11 on x
    assert queues.pop_for(["x", "y"], at_us=13).job_id == "alice-x2"


def a_dispatch_without_a_time_still_sends_the_account_to_the_back(queues):
    contract_example(queues)

    assert ids(queues.pop_for(["m"]) for _ in range(4)) == ["a1", "b1", "a2", "b2"]
    # each turn one after the newest key in the rotation: 8 (after bob's 7), 9, 10, 11
    assert [(t.account, t.turn_us) for t in queues.turns()] == [("alice", 10), ("bob", 11)]


FAIR_SHARE_CASES = [accounts_take_turns_whatever_came_first,
                    a_high_priority_job_takes_its_own_accounts_turn_and_never_moves_another_back,
                    an_account_arriving_later_joins_the_round_after_those_served_before_it,
                    a_job_sent_back_keeps_its_place_in_its_line_and_the_account_its_turn,
                    a_paused_job_leaves_the_queue_and_its_resume_puts_it_back_at_its_old_place,
                    the_turns_survive_a_rebuild_from_the_database_rows,
                    across_a_workers_models_the_oldest_turn_goes_first,
                    a_dispatch_without_a_time_still_sends_the_account_to_the_back]


@pytest.mark.parametrize("case", FAIR_SHARE_CASES, ids=lambda case: case.__name__)
def test_fair_share(case):
    case(MemoryQueues())


# --- MemoryQueues: any interleaving keeps the order (Hypothesis) -------------------------------

MODELS = ("a", "b", "c")


ACCOUNTS = ("alice", "bob", "carol")


class FairShareReference:
    """The contract's turn rule, computed from scratch at every question (slow and obviously right):
    the next job is the best (priority, then submission) of the account that has gone longest
    without a dispatch from the queue, counting from its oldest queued job's submission if never.
    Across a worker's models, the oldest of those turns."""

    def __init__(self) -> None:
        self.jobs: dict[str, QueuedJob] = {}
        self.last: dict[tuple[str, str], int] = {}

    def key(self, model: str, account: str) -> int:
        mine = [j.submitted_us for j in self.jobs.values() if j.model_id == model and j.account == account]
        return self.last.get((model, account), min(mine))

    def order(self, model: str) -> list[str]:
        """Dispatch order as the queue stands: simulate the pops without touching the real state."""
        saved_jobs, saved_last = dict(self.jobs), dict(self.last)
        order, now = [], 10**15
        while any(j.model_id == model for j in self.jobs.values()):
            now += 1
            order.append(self.pop([model], now=now).job_id)
        self.jobs, self.last = saved_jobs, saved_last
        return order

    def pop(self, models, *, now: int) -> QueuedJob | None:
        heads = []
        for model in models:
            accounts = {j.account for j in self.jobs.values() if j.model_id == model}
            if accounts:
                account = min(accounts, key=lambda a: (self.key(model, a), a))
                best = min((j for j in self.jobs.values() if j.model_id == model and j.account == account),
                           key=lambda j: j.key)
                heads.append((self.key(model, account), account, best))
        if not heads:
            return None
        _, account, job = min(heads, key=lambda h: (h[0], h[1], h[2].key))  # each model has its own turns
        self.last[(job.model_id, account)] = now
        return self.jobs.pop(job.job_id)


class QueueMachine(RuleBasedStateMachine):
    """Pushes, re-pushes, removals and pops by several accounts in any order; the queue must always
    agree with the reference: per model, the turns' order, positions 1..n, and a rebuild (with the
    turns) agrees."""

    queued_jobs = Bundle("queued_jobs")
    taken_jobs = Bundle("taken_jobs")

    def __init__(self) -> None:
        super().__init__()
        self.queues = MemoryQueues()
        self.reference = FairShareReference()
        self.now = 0

    def tick(self) -> int:
        self.now += 1_000  # every step happens later than the one before
        return self.now

    @rule(target=queued_jobs, model=st.sampled_from(MODELS), account=st.sampled_from(ACCOUNTS),
          priority=st.integers(0, 9))
    def submit(self, model: str, account: str, priority: int) -> QueuedJob:
        at = self.tick()
        new = QueuedJob(job_id=f"job-{at:08d}", model_id=model, priority=priority, submitted_us=at, account=account)
        assert self.queues.push(new) is True
        self.reference.jobs[new.job_id] = new
        return new

    @rule(target=taken_jobs, queued=consumes(queued_jobs))
    def remove(self, queued: QueuedJob) -> QueuedJob:
        removed = self.queues.remove(queued.job_id)
        if queued.job_id in self.reference.jobs:
            assert removed == queued._replace(turn_us=None)
            del self.reference.jobs[queued.job_id]
        else:  # popped meanwhile
            assert removed is None
        return queued

    @rule(target=taken_jobs, models=st.sets(st.sampled_from(MODELS)))
    def pop(self, models: set[str]):
        at = self.tick()
        expected = self.reference.pop(sorted(models), now=at)
        popped = self.queues.pop_for(sorted(models), at_us=at)
        assert (popped.job_id if popped else None) == (expected.job_id if expected else None)
        if popped is not None:
            assert popped.turn_us == at
        return popped

    @rule(taken=consumes(taken_jobs))
    def send_back(self, taken: QueuedJob | None) -> None:
        if taken is None or taken.job_id in self.reference.jobs:
            return
        assert self.queues.push(taken) is True
        self.reference.jobs[taken.job_id] = taken._replace(turn_us=None)

    @rule(queued=queued_jobs)
    def push_again(self, queued: QueuedJob) -> None:
        pushed = self.queues.push(queued)
        assert pushed is (queued.job_id not in self.reference.jobs)
        self.reference.jobs[queued.job_id] = queued

    @precondition(lambda self: len(self.reference.jobs) > 0)
    @rule(data=st.data())
    def rebuild(self, data) -> None:
        rows = data.draw(st.permutations(list(self.reference.jobs.values())))
        turns = [Turn(model, account, turn) for (model, account), turn in self.reference.last.items()]
        self.queues.rebuild(rows, data.draw(st.permutations(turns)))

    @invariant()
    def it_keeps_the_turns_order_and_positions(self) -> None:
        assert len(self.queues) == len(self.reference.jobs)
        for model in MODELS:
            expected = self.reference.order(model)
            assert ids(self.queues.queued(model)) == expected
            assert [self.queues.position(job_id) for job_id in expected] == list(range(1, len(expected) + 1))

    @invariant()
    def it_rebuilds_to_the_same_order(self) -> None:
        rebuilt = MemoryQueues()
        rebuilt.rebuild(reversed(list(self.reference.jobs.values())), self.queues.turns())
        for model in MODELS:
            assert ids(rebuilt.queued(model)) == ids(self.queues.queued(model))


QueueMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestQueueInterleavings = QueueMachine.TestCase


# --- plan_dispatch -------------------------------------------------------------------------------

def worker(worker_id: str, models: str | set[str] = "m", *, held: int = 0, joined: int = 0,
           rungs: dict[str, str] | None = None, draining: bool = False, holds: tuple[str, ...] = ()) -> WorkerCapacity:
    """A worker for the dispatch; `holds`: the ids of jobs it holds (each counted in `held` too)."""
    return WorkerCapacity(worker_id=worker_id, models=frozenset({models} if isinstance(models, str) else models),
                          held=held + len(holds), joined=joined, rungs=rungs or {}, draining=draining,
                          job_ids=frozenset(holds))


def plan(queued: list[QueuedJob], workers: list[WorkerCapacity], **options) -> list[tuple[str, str]]:
    options.setdefault("depth", 2)  # JOB_DISPATCH_DEPTH's default
    options.setdefault("reservations", {})
    options.setdefault("moves", [])
    return [(a.job.job_id, a.worker_id) for a in plan_dispatch(queues_of(*queued), workers, **options).assignments]


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
    pytest.param(five_jobs(), [worker("offload", joined=0, rungs={"m": "model_offload"}),
                               worker("fast", joined=1, rungs={"m": "full"})], {},
                 [("j1", "fast"), ("j2", "offload"), ("j3", "fast"), ("j4", "offload")],
                 id="on a tie the copy on the faster rung first, before the earlier connection"),
    pytest.param(five_jobs(), [worker("slow", joined=0, rungs={"m": "group_offload"}),
                               worker("fast", joined=1, rungs={"m": "full"})], {},
                 [("j1", "fast"), ("j2", "fast"), ("j3", "slow"), ("j4", "slow")],
                 id="a copy on group offload takes jobs only once every faster copy is full"),
    pytest.param(five_jobs(), [worker("slow", joined=0, rungs={"m": "group_offload"}),
                               worker("slower", joined=1, rungs={"m": "group_offload"})], {},
                 [("j1", "slow"), ("j2", "slower"), ("j3", "slow"), ("j4", "slower")],
                 id="copies all on group offload serve as any copies do"),
    pytest.param(five_jobs(), [worker("offload", joined=0, rungs={"m": "model_offload"}),
                               worker("unknown", joined=1)], {},
                 [("j1", "unknown"), ("j2", "offload"), ("j3", "unknown"), ("j4", "offload")],
                 id="a rung not known counts as full"),
    pytest.param(five_jobs(), [worker("fast", held=1, joined=0, rungs={"m": "full"}),
                               worker("offload", joined=1, rungs={"m": "model_offload"})], {},
                 [("j1", "offload"), ("j2", "fast"), ("j3", "offload")],
                 id="a faster copy does not go before a less loaded worker"),
    pytest.param(five_jobs(), [worker("fast", held=1, joined=0, rungs={"m": "full"}),
                               worker("slow", joined=1, rungs={"m": "group_offload"})], {},
                 [("j1", "fast"), ("j2", "slow"), ("j3", "slow")],
                 id="a less loaded copy on group offload waits for the faster copy to fill"),
    pytest.param([job("a1", model="a", at=1), job("b1", model="b", at=2)],
                 [worker("wab", {"a", "b"}, joined=0, rungs={"a": "full", "b": "group_offload"}),
                  worker("wb", "b", joined=1)], {"depth": 1},
                 [("a1", "wab"), ("b1", "wb")], id="the rung of the job's own model counts"),
    pytest.param([job("b1", model="b", at=1)],
                 [worker("wab", {"a", "b"}, joined=0, rungs={"a": "full", "b": "group_offload"}),
                  worker("wa", "a", joined=1)], {},
                 [("b1", "wab")], id="a copy on group offload serves when no faster copy of its model exists"),
    pytest.param([job("a1", model="a", at=1), job("b1", model="b", at=2)],
                 [worker("wa", "a", joined=0), worker("wb", "b", joined=1)], {},
                 [("a1", "wa"), ("b1", "wb")], id="each worker only gets its models"),
    pytest.param([job("b1", model="b", at=1), job("b2", model="b", at=2)], [worker("wa", "a")], {}, [],
                 id="no worker serves the model"),
    pytest.param([job("a1", model="a", at=1), job("b-urgent", model="b", priority=9, at=2)],
                 [worker("wab", {"a", "b"})], {}, [("a1", "wab"), ("b-urgent", "wab")],
                 id="across models: the oldest turn first, each model's queue its own"),
    pytest.param([QueuedJob(f"a{n}", "m", 9, n, "alice") for n in range(1, 4)] + [QueuedJob("b1", "m", 0, 9, "bob")],
                 [worker("w")], {"depth": 3}, [("a1", "w"), ("b1", "w"), ("a2", "w")],
                 id="priority 9 does not jump another account's turn"),
    pytest.param([], [worker("w")], {}, [], id="nothing queued"),
    pytest.param(five_jobs(), [], {}, [], id="no worker"),
]


@pytest.mark.parametrize(("queued", "workers", "options", "expected"), PLAN_CASES)
def test_it_plans_dispatches(queued, workers, options, expected):
    assert plan(queued, workers, **options) == expected


def test_it_takes_planned_jobs_off_the_queue_and_leaves_the_rest():
    queues = queues_of(*five_jobs())

    planned = plan_dispatch(queues, [worker("w")], depth=2, reservations={}, moves=[]).assignments

    assert ids(a.job for a in planned) == ["j1", "j2"]
    assert ids(queues.queued("m")) == ["j3", "j4", "j5"]
    assert plan_dispatch(queues, [worker("w", held=2)], depth=2, reservations={}, moves=[]).assignments == []


def test_the_default_depth_is_the_contracts(settings):
    assert settings.JOB_DISPATCH_DEPTH == 2


@st.composite
def dispatch_situations(draw):
    models = ["a", "b", "c"]
    jobs = draw(st.lists(st.tuples(st.sampled_from(models), st.integers(0, 3), st.sampled_from(ACCOUNTS)),
                         max_size=30))
    queued = [QueuedJob(f"j{n}", m, p, n, account) for n, (m, p, account) in enumerate(jobs)]
    depth = draw(st.integers(1, 4))
    workers = [worker(f"w{n}", served := set(draw(st.sets(st.sampled_from(models), max_size=3))),
                      held=draw(st.integers(0, depth)), joined=n,
                      rungs={m: draw(st.sampled_from(RUNGS)) for m in served})
               for n in range(draw(st.integers(0, 5)))]
    return queued, workers, depth


@given(dispatch_situations())
@settings(max_examples=200, deadline=None)
def test_it_never_overfills_a_worker_nor_sends_a_job_twice_nor_leaves_a_fitting_worker_idle(situation):
    queued, workers, depth = situation
    queues = queues_of(*queued)
    by_id = {w.worker_id: w for w in workers}
    order_before = {model: ids(queues.queued(model)) for model in ["a", "b", "c"]}

    planned = plan_dispatch(queues, workers, depth=depth, reservations={}, moves=[]).assignments

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
    # What left each model's queue left it in the order its positions said.
    for model in ["a", "b", "c"]:
        taken = [a.job.job_id for a in planned if a.job.model_id == model]
        assert taken == order_before[model][:len(taken)]


# --- plan_dispatch: reservations and moves ---------------------------------------------------------

def step(queued: list[QueuedJob], workers: list[WorkerCapacity], *, reservations: dict[str, str] | None = None,
         moves: list[Move] | None = None) -> tuple[list[tuple[str, str]], dict[str, str], list[Move], bool]:
    """One step of a dispatch at depth 2: what it assigns, the reservations and moves it leaves open,
    and whether it took its jobs in the queue's order."""
    planned = plan_dispatch(queues_of(*queued), workers, depth=2, reservations=reservations or {}, moves=moves or [])
    return ([(a.job.job_id, a.worker_id) for a in planned.assignments], planned.reservations, planned.moves,
            planned.in_turn)


ALICE_JOBS = [QueuedJob("a1", "m", 0, 1, "alice"), QueuedJob("a2", "m", 0, 9, "alice")]
BOB_JOBS = [QueuedJob("b1", "m", 0, 2, "bob")]

RESERVATION_CASES = [
    pytest.param(ALICE_JOBS + BOB_JOBS, [worker("w", held=1)], {"a2": "w"},
                 ([("a2", "w")], {}, [], False), id="a reservation goes first, out of the queue's order"),
    pytest.param(ALICE_JOBS + BOB_JOBS, [worker("w", held=2)], {"a2": "w"},
                 ([], {"a2": "w"}, [], True), id="it waits while its worker has not given a job back"),
    pytest.param(ALICE_JOBS + BOB_JOBS, [worker("full", held=2), worker("w", held=1, joined=1)],
                 {"a2": "full", "b1": "w"},
                 ([("b1", "w")], {"a2": "full"}, [], False), id="in order, the first whose worker has room"),
    pytest.param(ALICE_JOBS, [worker("w", held=1)], {"a2": "gone"},
                 ([("a1", "w")], {}, [], True), id="it ends when its worker left: the queue decides"),
    pytest.param(ALICE_JOBS, [worker("w", held=1, draining=True), worker("w2", held=1, joined=1)], {"a2": "w"},
                 ([("a1", "w2")], {}, [], True), id="it ends when its worker drains"),
    pytest.param(ALICE_JOBS, [worker("w", held=1)], {"cancelled": "w"},
                 ([("a1", "w")], {}, [], True), id="it ends when its job is no longer queued"),
    pytest.param([QueuedJob("x1", "other", 9, 1, "alice")] + ALICE_JOBS, [worker("w", held=1)], {"x1": "w"},
                 ([("a1", "w")], {}, [], True),
                 id="it ends when its worker no longer serves the job's model: the job stays queued"),
]


@pytest.mark.parametrize(("queued", "workers", "reservations", "expected"), RESERVATION_CASES)
def test_it_serves_a_reservation_before_the_queue(queued, workers, reservations, expected):
    assert step(queued, workers, reservations=reservations) == expected


MOVE_DISPATCH_CASES = [
    pytest.param(ALICE_JOBS + BOB_JOBS, [worker("busy", holds=("a0",)), worker("idle", joined=1)],
                 [Move("busy", "a2", "idle")], ([("a2", "idle")], {}, [], False),
                 id="a job given back goes to its idle worker, out of the queue's order"),
    pytest.param(ALICE_JOBS, [worker("busy", holds=("a0", "a5")), worker("idle", joined=1)],
                 [Move("busy", "a5", "idle")], ([("a1", "idle")], {}, [Move("busy", "a5", "idle")], True),
                 id="it waits while its job is on the worker it leaves, the idle one counting it as held"),
    pytest.param(ALICE_JOBS, [worker("idle", held=2)], [Move("busy", "a2", "idle")],
                 ([], {}, [], True), id="it ends when its idle worker got full meanwhile"),
    pytest.param(ALICE_JOBS, [worker("other")], [Move("busy", "a2", "idle")],
                 ([("a1", "other"), ("a2", "other")], {}, [], True), id="it ends when its idle worker left"),
    pytest.param(ALICE_JOBS, [worker("idle", draining=True), worker("other", joined=1)],
                 [Move("busy", "a2", "idle")],
                 ([("a1", "other"), ("a2", "other")], {}, [], True), id="it ends when its idle worker drains"),
    pytest.param(ALICE_JOBS, [worker("idle")], [Move("busy", "ended", "idle")],
                 ([("a1", "idle"), ("a2", "idle")], {}, [], True), id="it ends when its job is no longer queued"),
    pytest.param([QueuedJob("x1", "other", 0, 1, "alice")], [worker("idle")], [Move("busy", "x1", "idle")],
                 ([], {}, [], True), id="it ends when its idle worker no longer serves the job's model"),
]


@pytest.mark.parametrize(("queued", "workers", "moves", "expected"), MOVE_DISPATCH_CASES)
def test_it_serves_a_move_before_the_queue(queued, workers, moves, expected):
    assert step(queued, workers, moves=moves) == expected


def test_it_serves_reservations_before_moves_one_job_a_step():
    workers = [worker("w", held=1), worker("idle", joined=1)]

    assert step(ALICE_JOBS + BOB_JOBS, workers, reservations={"b1": "w"}, moves=[Move("busy", "a2", "idle")]) == (
        [("b1", "w")], {}, [Move("busy", "a2", "idle")], False)


def test_a_claim_that_failed_leaves_its_worker_room_for_the_next_reservation():
    queues = queues_of(*ALICE_JOBS, *BOB_JOBS)
    reservations = {"a2": "w", "b1": "w"}

    first = plan_dispatch(queues, [worker("w", held=1)], depth=2, reservations=reservations, moves=[])
    claimed = plan_dispatch(queues, [worker("w", held=2)], depth=2, reservations=first.reservations, moves=[])
    refused = plan_dispatch(queues_of(*ALICE_JOBS, *BOB_JOBS), [worker("w", held=1)], depth=2,
                            reservations=first.reservations, moves=[])

    assert [a.job.job_id for a in first.assignments] == ["a2"] and first.reservations == {"b1": "w"}
    assert claimed.assignments == [] and claimed.reservations == {"b1": "w"}
    assert [a.job.job_id for a in refused.assignments] == ["b1"] and refused.reservations == {}


@st.composite
def dispatch_situations_with_reservations_and_moves(draw):
    queued, workers, depth = draw(dispatch_situations())
    workers = [replace(w, job_ids=frozenset(f"h.{w.worker_id}.{k}" for k in range(w.held)),
                       draining=draw(st.booleans()) and draw(st.booleans())) for w in workers]
    worker_ids = [w.worker_id for w in workers] + ["gone"]
    queued_ids = [job.job_id for job in queued] + ["ended"]
    held_ids = [job_id for w in workers for job_id in sorted(w.job_ids)]
    reservations = draw(st.dictionaries(st.sampled_from(queued_ids), st.sampled_from(worker_ids), max_size=4))
    moving = draw(st.lists(st.tuples(st.sampled_from(worker_ids), st.sampled_from(queued_ids + held_ids),
                                     st.sampled_from(worker_ids)), max_size=4, unique_by=lambda move: move[1]))
    return queued, workers, depth, reservations, [Move(*move) for move in moving]


@given(dispatch_situations_with_reservations_and_moves())
@settings(max_examples=200, deadline=None)
def test_a_dispatch_run_to_its_end_overfills_no_worker_and_sends_reserved_or_moved_jobs_only_to_their_worker(
        situation):
    queued, workers, depth, reservations, moves = situation
    queues = queues_of(*queued)
    by_id = {w.worker_id: w for w in workers}
    promised = {(move.job_id, move.to_worker_id) for move in moves} | set(reservations.items())
    sent: list[str] = []

    for _ in range(len(queued) + len(reservations) + len(moves) + 2):  # each step ends one or serves one
        planned = plan_dispatch(queues, list(by_id.values()), depth=depth, reservations=reservations, moves=moves)
        reservations, moves = planned.reservations, planned.moves
        if not planned.assignments:
            break
        for assignment in planned.assignments:  # every claim succeeds
            w = by_id[assignment.worker_id]
            assert assignment.job.model_id in w.models and not w.draining
            assert planned.in_turn or (assignment.job.job_id, w.worker_id) in promised
            sent.append(assignment.job.job_id)
            by_id[w.worker_id] = replace(w, held=w.held + 1, job_ids=w.job_ids | {assignment.job.job_id})
    else:
        pytest.fail("the dispatch did not end")

    assert len(sent) == len(set(sent)), "a job sent twice"
    assert all(by_id[w.worker_id].held <= max(depth, w.held) for w in workers), "a worker overfilled"
    for worker_id in reservations.values():  # those left wait for their worker to give a job back
        assert worker_id in by_id and not by_id[worker_id].draining and by_id[worker_id].held >= depth
    for move in moves:  # those left wait for their job to be given back
        assert move.job_id in by_id[move.worker_id].job_ids


# --- plan_preemptions ---------------------------------------------------------------------------

def held(job_id: str, *, account: str = "alice", priority: int = 0, at: int = 0, started: bool = True,
         model: str = "m") -> HeldJob:
    return HeldJob(QueuedJob(job_id, model, priority, at, account), started)


def holding(worker_id: str, *jobs: HeldJob, models: str | set[str] = "m", held_count: int | None = None,
            joined: int = 0, rungs: dict[str, str] | None = None) -> Holding:
    return Holding(worker_id, frozenset({models} if isinstance(models, str) else models),
                   len(jobs) if held_count is None else held_count, jobs, joined, rungs or {})


def urgent(job_id: str = "urgent", *, account: str = "alice", priority: int = 9, at: int = 100,
           model: str = "m") -> QueuedJob:
    return QueuedJob(job_id, model, priority, at, account)


PREEMPTION_CASES = [
    pytest.param([urgent()], [holding("w", held("a1", at=1), held("a2", at=2, started=False))],
                 [Preemption("w", "a2", "urgent")], id="one not yet started before one running"),
    pytest.param([urgent()], [holding("w", held("a1", at=1), held("a2", at=2))],
                 [Preemption("w", "a2", "urgent")], id="both running: the one furthest back in the line"),
    pytest.param([urgent()], [holding("w", held("a1", priority=1, at=1, started=False), held("a2", priority=0, at=2))],
                 [Preemption("w", "a2", "urgent")], id="the lowest priority first, started or not"),
    pytest.param([urgent()], [holding("w", held("b1", account="bob"), held("b2", account="bob"))], [],
                 id="fair share: another account's job is never taken"),
    pytest.param([urgent()], [holding("w", held("b1", account="bob"), held("a1", priority=3))],
                 [Preemption("w", "a1", "urgent")], id="only its own account's job, beside another's"),
    pytest.param([urgent(priority=3)], [holding("w", held("a1", priority=3), held("a2", priority=5))], [],
                 id="an equal or higher priority is never taken"),
    pytest.param([urgent()], [holding("full", held("a1"), held("a2")), holding("room", held("b1", account="bob"),
                                                                                   joined=1)], [],
                 id="a worker serving the model has room: no preemption (the dispatch places it)"),
    pytest.param([urgent()], [holding("w", held("a1"), held("a2"), models="other")], [],
                 id="no worker serves its model"),
    pytest.param([urgent()], [holding("w1", held("a1", priority=2), held("b1", account="bob"), joined=0),
                              holding("w2", held("a2", priority=1), held("b2", account="bob"), joined=1)],
                 [Preemption("w2", "a2", "urgent")], id="across workers: the lowest priority of them all"),
    pytest.param([urgent()], [holding("w1", held("a1", at=5), held("b1", account="bob"), joined=1),
                              holding("w2", held("a2", at=5), held("b2", account="bob"), joined=0)],
                 [Preemption("w2", "a2", "urgent")], id="a tie: the worker joined first"),
    pytest.param([urgent("u1", priority=5, at=100), urgent("u2", priority=9, at=101)],
                 [holding("w", held("a1", priority=0), held("a2", priority=4))],
                 [Preemption("w", "a1", "u2"), Preemption("w", "a2", "u1")],
                 id="the highest priority waiting job first, each held job given back once"),
    pytest.param([urgent("u1", at=100), urgent("u2", at=101)], [holding("w", held("a1"), held("b1", account="bob"))],
                 [Preemption("w", "a1", "u1")], id="one held job makes room for one waiting job"),
    pytest.param([urgent()], [holding("w", held("b1", account="bob"), held_count=2)], [],
                 id="a job being let go or preempted already is not offered (only counted)"),
    pytest.param([urgent()], [holding("w", held("a1", model="other", at=1), held("a2", model="other", at=2),
                                      models={"m", "other"})],
                 [Preemption("w", "a2", "urgent")], id="a held job of another model of the same worker"),
    pytest.param([], [holding("w", held("a1"), held("a2"))], [], id="nothing waits"),
]


@pytest.mark.parametrize(("waiting", "workers", "expected"), PREEMPTION_CASES)
def test_it_plans_the_priority_preemptions(waiting, workers, expected):
    assert plan_preemptions(waiting, workers, depth=2) == expected


@st.composite
def preemption_situations(draw):
    depth = draw(st.integers(1, 3))
    workers = []
    for n in range(draw(st.integers(0, 4))):
        jobs = tuple(HeldJob(QueuedJob(f"h{n}.{k}", draw(st.sampled_from(["a", "b"])), draw(st.integers(0, 3)),
                                       draw(st.integers(0, 9)), draw(st.sampled_from(ACCOUNTS))), draw(st.booleans()))
                     for k in range(draw(st.integers(0, depth))))
        workers.append(Holding(f"w{n}", frozenset(draw(st.sets(st.sampled_from(["a", "b"]), min_size=1))),
                               len(jobs) + draw(st.integers(0, 1)), jobs, n))
    waiting = [QueuedJob(f"q{n}", m, p, 10 + n, account) for n, (m, p, account) in enumerate(
        draw(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4), st.sampled_from(ACCOUNTS)),
                      max_size=6)))]
    return waiting, workers, depth


@given(preemption_situations())
@settings(max_examples=300, deadline=None)
def test_a_preemption_only_ever_gives_an_account_s_place_to_its_own_more_urgent_job(situation):
    waiting, workers, depth = situation
    by_job = {h.job.job_id: (w, h) for w in workers for h in w.preemptible}
    wanted = {job.job_id: job for job in waiting}

    planned = plan_preemptions(waiting, workers, depth=depth)

    assert len({p.job_id for p in planned}) == len(planned), "a held job given back twice"
    assert len({p.for_job_id for p in planned}) == len(planned), "two places for one waiting job"
    for preemption in planned:
        worker, given_back = by_job[preemption.job_id]
        job = wanted[preemption.for_job_id]
        assert worker.worker_id == preemption.worker_id and job.model_id in worker.models
        assert given_back.job.account == job.account, "fair share undone"
        assert given_back.job.priority < job.priority
        serving = [w for w in workers if job.model_id in w.models]
        assert all(w.held >= depth for w in serving), "preempted while a worker had room"


# --- plan_moves ----------------------------------------------------------------------------------

MOVE_CASES = [
    pytest.param([holding("busy", held("a1"), held("a2", at=2, started=False)), holding("idle", joined=1)],
                 [Move("busy", "a2", "idle")], id="a job waiting behind another moves to an idle worker"),
    pytest.param([holding("busy", held("a1"), held("a2", at=2, started=False)), holding("idle", models="other",
                                                                                        joined=1)],
                 [], id="not to an idle worker that does not serve its model"),
    pytest.param([holding("busy", held("a1"), held("a2", at=2, started=False)),
                  holding("other", held("b1", account="bob"), joined=1)],
                 [], id="no worker is idle: nothing moves"),
    pytest.param([holding("busy", held("a1"), held("a2", at=2)), holding("idle", joined=1)],
                 [], id="a job that has begun stays (its steps are done there)"),
    pytest.param([holding("w", held("a1", started=False)), holding("idle", joined=1)],
                 [], id="a worker's only job stays: it runs it now"),
    pytest.param([holding("w", held("a1", at=1, started=False), held("a2", at=2, started=False)),
                  holding("idle", joined=1)],
                 [Move("w", "a2", "idle")], id="neither begun: the one it got first stays, it runs that next"),
    pytest.param([holding("w", held("a2", at=2, started=False), held("a1", at=1, started=False)),
                  holding("idle", joined=1)],
                 [Move("w", "a1", "idle")], id="the one it got first stays, whatever their order in line"),
    pytest.param([holding("w", held("a2", at=2, started=False), held_count=2), holding("idle", joined=1)],
                 [Move("w", "a2", "idle")], id="the job it runs is leaving (cancelled): the other still waits"),
    pytest.param([holding("w1", held("a1"), held("late", at=9, started=False), joined=0),
                  holding("w2", held("b1", account="bob"), held("early", at=3, started=False, account="bob"),
                          joined=1),
                  holding("idle", joined=2)],
                 [Move("w2", "early", "idle")], id="of several, the first in line order"),
    pytest.param([holding("w1", held("a1"), held("low", at=1, started=False), joined=0),
                  holding("w2", held("b1"), held("high", priority=5, at=9, started=False), joined=1),
                  holding("idle", joined=2)],
                 [Move("w2", "high", "idle")], id="a higher priority first"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False), held("a3", at=3, started=False)),
                  holding("idle1", joined=1), holding("idle2", joined=2)],
                 [Move("w", "a2", "idle1"), Move("w", "a3", "idle2")],
                 id="two idle workers take one each, in the order they joined"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False)),
                  holding("idle1", joined=1), holding("idle2", joined=2)],
                 [Move("w", "a2", "idle1")], id="one waiting job moves once"),
    pytest.param([holding("w", held("a1", model="x"), held("a2", model="y", at=2, started=False), models={"x", "y"}),
                  holding("idle-x", models="x", joined=1), holding("idle-y", models="y", joined=2)],
                 [Move("w", "a2", "idle-y")], id="an idle worker takes only what it serves"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False)), holding("coming", held_count=1,
                                                                                     joined=1)],
                 [], id="a worker with a job on its way to it is not idle"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False)),
                  holding("slow", joined=1, rungs={"m": "group_offload"})],
                 [], id="not to a copy on a slower rung than the one it waits on"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False), rungs={"m": "model_offload"}),
                  holding("same", joined=1, rungs={"m": "model_offload"})],
                 [Move("w", "a2", "same")], id="to a copy on the same rung"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False), rungs={"m": "group_offload"}),
                  holding("fast", joined=1, rungs={"m": "full"})],
                 [Move("w", "a2", "fast")], id="to a faster copy"),
    pytest.param([holding("w", held("a1"), held("a2", at=2, started=False)),
                  holding("slow", joined=1, rungs={"m": "model_offload"}), holding("full", joined=2)],
                 [Move("w", "a2", "full")], id="a slower idle copy leaves it to a full one"),
]


@pytest.mark.parametrize(("workers", "expected"), MOVE_CASES)
def test_it_moves_a_job_waiting_behind_another_to_an_idle_worker(workers, expected):
    assert plan_moves(workers) == expected


@given(preemption_situations(), st.data())
@settings(max_examples=300, deadline=None)
def test_a_move_only_ever_takes_a_waiting_job_to_an_idle_worker_that_serves_it(situation, data):
    _, drawn, _ = situation
    workers = [Holding(w.worker_id, w.models, w.held, w.preemptible, w.joined,
                       data.draw(st.dictionaries(st.sampled_from(["a", "b"]),
                                                 st.sampled_from(["full", "model_offload", "group_offload"]))))
               for w in drawn]
    by_job = {h.job.job_id: (w, h) for w in workers for h in w.preemptible}
    by_worker = {w.worker_id: w for w in workers}

    moves = plan_moves(workers)

    assert len({m.job_id for m in moves}) == len(moves), "a job moved twice"
    assert len({m.to_worker_id for m in moves}) == len(moves), "an idle worker given two jobs"
    given_back: dict[str, int] = {}
    for move in moves:
        worker, job = by_job[move.job_id]
        thief = by_worker[move.to_worker_id]
        assert worker.worker_id == move.worker_id != move.to_worker_id
        assert thief.held == 0 and job.job.model_id in thief.models
        assert not job.started, "a job that has begun was moved"
        assert thief.rank(job.job.model_id) <= worker.rank(job.job.model_id), "moved to a slower copy"
        given_back[worker.worker_id] = given_back.get(worker.worker_id, 0) + 1
    for worker_id, count in given_back.items():
        assert by_worker[worker_id].held - count >= 1, "a worker gave back every job it held"


# --- retry_decision -----------------------------------------------------------------------------

@pytest.mark.parametrize(("attempts", "decision"), [(1, "requeue"), (2, "fail"), (3, "fail")])
def test_it_retries_a_job_once_after_its_worker_dies(attempts, decision):
    assert retry_decision(attempts=attempts) == decision
