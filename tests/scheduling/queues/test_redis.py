"""The job queue in Redis (RedisQueues): the same behaviour as MemoryQueues, checked by the same
tests and by random operations applied to both; then what only a shared queue has: losing Redis's
contents, rebuilds racing other processes, and several processes popping at once.

Against a real Redis: REDIS_URL, else redis://127.0.0.1:6379/15. Each test uses its own key prefix.
"""
from __future__ import annotations

import os
import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from scheduling.policy import QueuedJob, Turn
from scheduling.queues.memory import MemoryQueues
from scheduling.queues.redis import QueueLost, QueueRebuildTimedOut, RedisQueues, redis_client_from_url
from tests.scheduling.test_policy import FAIR_SHARE_CASES
from tests.scheduling.test_policy import ORDER_CASES as IN_PROCESS_ORDER_CASES

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"


def reachable(url: str) -> str | None:
    """None when Redis answers at `url`, else why not."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2) as client:
            client.ping()
    except (redis.RedisError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


_unreachable = reachable(REDIS_URL)
if _unreachable:
    pytest.skip(f"no Redis at {REDIS_URL} ({_unreachable}); start one or set REDIS_URL to run the RedisQueues "
                "tests", allow_module_level=True)


def job(job_id: str, *, model: str = "m", priority: int = 0, at: int = 0) -> QueuedJob:
    return QueuedJob(job_id=job_id, model_id=model, priority=priority, submitted_us=at)


def ids(jobs) -> list[str]:
    return [queued.job_id for queued in jobs]


def untimed(queued: QueuedJob | None) -> QueuedJob | None:
    """A popped job without the turn its dispatch took (to compare with what was pushed)."""
    return queued._replace(turn_us=None) if queued else None


def new_prefix() -> str:
    return f"test:potocolom:jobs:{uuid.uuid4().hex}"


def staged_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{prefix}:build:*"))


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    with redis_client_from_url(REDIS_URL) as made:
        yield made


@pytest.fixture
def prefix(client) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted at the end."""
    made = new_prefix()
    yield made
    RedisQueues(client, made).delete_all()
    assert list(client.scan_iter(match=f"{made}*")) == []


@pytest.fixture
def shared(client, prefix) -> Callable[..., RedisQueues]:
    """Another API process's view of this test's queue: its own client, the same prefix."""
    clients: list[redis.Redis] = []

    def make(**options) -> RedisQueues:
        clients.append(redis_client_from_url(REDIS_URL))
        return RedisQueues(clients[-1], prefix, **options)

    yield make
    for made in clients:
        made.close()


@pytest.fixture(params=["in_process", "redis"])
def queues(request, client, prefix):
    """An empty, built queue of each implementation: every behavioural test runs against both."""
    if request.param == "in_process":
        return MemoryQueues()
    made = RedisQueues(client, prefix)
    made.rebuild([])
    return made


def fill(queues, *jobs: QueuedJob):
    for queued in jobs:
        assert queues.push(queued) is True
    return queues


# --- the same behaviour as MemoryQueues ------------------------------------------------------

ORDER_CASES = [
    *IN_PROCESS_ORDER_CASES,  # the in-process queue's own table (tests/scheduling/test_jobs.py)
    pytest.param([job("late", at=2_000_000_000_000_000), job("early", at=999_999_999_999_999), job("zero", at=0)],
                 ["zero", "early", "late"], id="microseconds since the epoch, a digit apart"),
    pytest.param([job("ab", at=1), job("a", at=1), job("B", at=1), job("é", at=1), job("a-b", at=1)],
                 ["B", "a", "a-b", "ab", "é"], id="job ids compare as Python strings do"),
]


@pytest.mark.parametrize(("pushed", "expected"), ORDER_CASES)
def test_it_orders_jobs_by_priority_then_submission(queues, pushed, expected):
    fill(queues, *pushed)

    assert ids(queues.queued("m")) == expected
    assert [queues.position(job_id) for job_id in expected] == list(range(1, len(expected) + 1))
    assert ids(queues.pop_for(["m"]) for _ in expected) == expected
    assert len(queues) == 0 and queues.counts() == {}


def test_it_keeps_each_model_in_its_own_queue(queues):
    fill(queues, job("a1", model="a", at=1), job("b1", model="b", at=2), job("a2", model="a", at=3))

    assert ids(queues.queued("a")) == ["a1", "a2"]
    assert ids(queues.queued("b")) == ["b1"]
    assert queues.position("a2") == 2 and queues.position("b1") == 1
    assert queues.counts() == {"a": 2, "b": 1}
    assert queues.queued("nobody") == []
    assert len(queues) == 3 and "a2" in queues and "zz" not in queues


def test_it_pops_the_oldest_turn_across_the_models_a_worker_serves(queues):
    fill(queues, job("a1", model="a", at=1), job("b-urgent", model="b", priority=3, at=2), job("c1", model="c", at=0))

    assert queues.peek_for(["a", "b"]) == job("a1", model="a", at=1)
    assert queues.pop_for(["a", "b"], at_us=5) == job("a1", model="a", at=1)._replace(turn_us=5)
    urgent = job("b-urgent", model="b", priority=3, at=2)
    assert queues.pop_for(iter(["a", "b", "nobody"])) == urgent._replace(turn_us=3)
    assert queues.pop_for(["a", "b"]) is None
    assert queues.pop_for([]) is None and queues.peek_for([]) is None
    assert ids(queues.queued("c")) == ["c1"]
    assert queues.counts() == {"c": 1}


@pytest.mark.parametrize("case", FAIR_SHARE_CASES, ids=lambda case: case.__name__)
def test_fair_share(queues, case):
    case(queues)


def test_it_leaves_the_job_it_peeks_at_in_place(queues):
    fill(queues, job("a", at=1), job("b", at=2))

    assert queues.peek_for(["m"]) == job("a", at=1)
    assert queues.peek_for(["m"]) == job("a", at=1)
    assert len(queues) == 2 and queues.position("a") == 1


def test_it_refuses_to_queue_a_job_twice(queues):
    fill(queues, job("a", at=1))

    assert queues.push(job("a", at=1)) is False
    assert queues.push(job("a", priority=9, at=0)) is False
    assert queues.push(job("a", model="other", at=0)) is False
    assert ids(queues.queued("m")) == ["a"] and len(queues) == 1 and queues.counts() == {"m": 1}


def test_it_gives_a_job_sent_back_its_old_place(queues):
    fill(queues, job("first", at=1), job("second", at=2), job("third", at=3))
    taken = queues.pop_for(["m"])

    assert queues.position("second") == 1
    assert queues.push(taken) is True

    assert ids(queues.queued("m")) == ["first", "second", "third"]
    assert queues.position("first") == 1


def test_it_removes_a_job_from_the_middle_and_closes_the_gap(queues):
    fill(queues, job("a", at=1), job("b", priority=4, at=2), job("c", at=3))

    assert queues.remove("b") == job("b", priority=4, at=2)
    assert queues.remove("b") is None
    assert queues.remove("never-queued") is None
    assert "b" not in queues and "a" in queues
    assert queues.position("b") is None
    assert queues.position("c") == 2
    assert queues.counts() == {"m": 2}


def test_it_leaves_out_of_the_counts_a_model_whose_last_job_left(queues):
    fill(queues, job("a1", model="a"), job("b1", model="b"))

    queues.remove("a1")

    assert queues.counts() == {"b": 1}
    assert queues.pop_for(["b"]).job_id == "b1"
    assert queues.counts() == {}


def test_it_rebuilds_to_the_same_order_whatever_the_rows_order(queues):
    jobs = [job(f"j{n}", model="ab"[n % 2], priority=n % 3, at=n // 2) for n in range(20)]
    pushed = fill(MemoryQueues(), *jobs)
    shuffled = jobs[:]
    random.Random(7).shuffle(shuffled)
    queues.push(job("stale"))

    queues.rebuild(shuffled)

    assert "stale" not in queues and queues.counts() == {"a": 10, "b": 10}
    for model in "ab":
        assert ids(queues.queued(model)) == ids(pushed.queued(model))
    assert {j.job_id: queues.position(j.job_id) for j in jobs} == {j.job_id: pushed.position(j.job_id) for j in jobs}


def test_it_keeps_the_last_row_of_a_job_id_given_twice_to_a_rebuild(queues):
    queues.rebuild([job("a", priority=1), job("b", at=1), job("a", priority=7, model="n")])

    assert queues.counts() == {"m": 1, "n": 1}
    assert queues.queued("n") == [job("a", priority=7, model="n")]


# --- the same behaviour under random operations (Hypothesis) ------------------------------------

MODELS = ("a", "b", "c")
JOB_IDS = st.text(alphabet="aAbB-0é", min_size=1, max_size=4)
ACCOUNTS = st.sampled_from(["", "1", "12", "2", "é"])  # prefixes of each other, and not ASCII
INSTANTS = st.sampled_from([0, 1, 2, 1_700_000_000_000_000, 2**52 - 1])
_machine_client = redis_client_from_url(REDIS_URL)


class BothQueuesMachine(RuleBasedStateMachine):
    """Random pushes (new and again), removals, peeks, pops and rebuilds applied to an
    MemoryQueues and a RedisQueues: every answer and the whole contents must agree."""

    job_ids = Bundle("job_ids")

    def __init__(self) -> None:
        super().__init__()
        self.prefix = new_prefix()
        self.reference = MemoryQueues()
        self.redis = RedisQueues(_machine_client, self.prefix)
        self.redis.rebuild([])

    def teardown(self) -> None:
        self.redis.delete_all()

    @initialize(target=job_ids)
    def first_id(self) -> str:
        return "a"

    @rule(target=job_ids, job_id=JOB_IDS, model=st.sampled_from(MODELS), priority=st.integers(0, 9), at=INSTANTS,
          account=ACCOUNTS, steps=st.integers(0, 60))
    def push(self, job_id: str, model: str, priority: int, at: int, account: str, steps: int) -> str:
        pushed = QueuedJob(job_id, model, priority, at, account, steps=steps)
        assert self.redis.push(pushed) == self.reference.push(pushed)
        return job_id

    @rule(job_id=job_ids, model=st.sampled_from(MODELS), priority=st.integers(0, 9), at=INSTANTS, account=ACCOUNTS,
          steps=st.integers(0, 60))
    def push_a_known_id(self, job_id: str, model: str, priority: int, at: int, account: str, steps: int) -> None:
        pushed = QueuedJob(job_id, model, priority, at, account, steps=steps)
        assert self.redis.push(pushed) == self.reference.push(pushed)

    @rule(job_id=job_ids)
    def remove(self, job_id: str) -> None:
        assert self.redis.remove(job_id) == self.reference.remove(job_id)

    @rule(models=st.lists(st.sampled_from(MODELS), max_size=4))
    def peek(self, models: list[str]) -> None:
        assert self.redis.peek_for(models) == self.reference.peek_for(models)

    @rule(models=st.lists(st.sampled_from(MODELS), max_size=4), at=st.one_of(st.none(), INSTANTS))
    def pop(self, models: list[str], at: int | None) -> None:
        assert self.redis.pop_for(models, at_us=at) == self.reference.pop_for(models, at_us=at)

    @rule(data=st.data())
    def rebuild(self, data) -> None:
        rows = [queued for model in MODELS for queued in self.reference.queued(model)]
        rows = data.draw(st.permutations(rows))
        turns = data.draw(st.permutations(self.reference.turns()))
        self.redis.rebuild(rows, turns)
        self.reference.rebuild(rows, turns)

    @invariant()
    def they_agree(self) -> None:
        assert len(self.redis) == len(self.reference)
        assert self.redis.counts() == self.reference.counts()
        # each model's jobs and steps, as the scripts counted them, are what its queue holds
        held = {model: self.reference.queued(model) for model in MODELS}
        assert self.redis.demand() == self.reference.demand() == {
            model: (len(jobs), sum(j.steps for j in jobs)) for model, jobs in held.items() if jobs}
        assert self.redis.turns() == self.reference.turns()
        for model in MODELS:
            queued = self.reference.queued(model)
            assert self.redis.queued(model) == queued
            assert [self.redis.position(j.job_id) for j in queued] == list(range(1, len(queued) + 1))
            ids = [j.job_id for j in queued] + ["never-queued"]
            assert self.redis.positions(ids) == self.reference.positions(ids) == {
                j.job_id: n for n, j in enumerate(queued, start=1)}


BothQueuesMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBothQueuesAgree = BothQueuesMachine.TestCase


# --- what only RedisQueues checks -----------------------------------------------------------------

BAD_JOBS = [job("p", priority=10), job("p", priority=-1), job("t", at=-1), job("t", at=2**52), job("x" * 1001)]


@pytest.mark.parametrize("bad", BAD_JOBS, ids=["priority 10", "priority -1", "before 1970", "too late", "long id"])
def test_it_refuses_a_job_its_members_cannot_order(client, prefix, bad):
    queues = RedisQueues(client, prefix)
    queues.rebuild([job("a")])

    with pytest.raises(ValueError):
        queues.push(bad)
    assert queues.queued("m") == [job("a")]

    with pytest.raises(ValueError):  # a rebuild fails loudly, leaving the queue lost rather than partial
        queues.rebuild([job("a"), bad])
    assert queues.is_lost() and staged_keys(client, prefix) == []


def test_it_answers_the_same_through_a_client_that_decodes_responses(prefix):
    with redis.Redis.from_url(REDIS_URL, decode_responses=True) as decoding:
        queues = RedisQueues(decoding, prefix)
        queues.rebuild([job("b", at=2), job("a", model="n", priority=3)])
        queues.push(job("c", at=1))

        assert queues.queued("m") == [job("c", at=1), job("b", at=2)]
        assert queues.pop_for(["m", "n"], at_us=7) == job("a", model="n", priority=3)._replace(turn_us=7)  # n's t=0
        assert queues.counts() == {"m": 2} and queues.position("b") == 2
        assert queues.turns() == [Turn("n", "", 7)]


# --- lost data ------------------------------------------------------------------------------------

OPERATIONS = [
    pytest.param(lambda q: len(q), id="len"),
    pytest.param(lambda q: "a" in q, id="contains"),
    pytest.param(lambda q: q.push(job("new")), id="push"),
    pytest.param(lambda q: q.remove("a"), id="remove"),
    pytest.param(lambda q: q.peek_for(["m"]), id="peek_for"),
    pytest.param(lambda q: q.pop_for(["m"]), id="pop_for"),
    pytest.param(lambda q: q.position("a"), id="position"),
    pytest.param(lambda q: q.queued("m"), id="queued"),
    pytest.param(lambda q: q.counts(), id="counts"),
]


def lose_everything(client: redis.Redis, queues: RedisQueues) -> None:
    """What a Redis restart does to the queue (keys and loaded scripts gone), leaving other keys in
    the shared test database alone."""
    queues.delete_all()
    client.script_flush()


@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_operation_says_the_queue_is_lost_before_the_first_rebuild(client, prefix, operation):
    with pytest.raises(QueueLost):
        operation(RedisQueues(client, prefix))


@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_operation_says_the_queue_is_lost_after_redis_lost_it(client, prefix, operation):
    queues = RedisQueues(client, prefix)
    queues.rebuild([job("a")])
    lose_everything(client, queues)

    with pytest.raises(QueueLost, match="rebuild it from the database"):
        operation(queues)
    assert queues.is_lost()


def test_it_recovers_from_the_database_once_and_then_carries_on(client, prefix, shared):
    database = [job("a", at=1), job("b", at=2)]
    loads = Counter()

    def load(name: str):
        def read() -> list[QueuedJob]:
            loads[name] += 1
            return database
        return read

    queues, other = RedisQueues(client, prefix), shared()
    queues.rebuild(database)
    lose_everything(client, queues)

    assert queues.recover(load("first")) is True
    assert other.recover(load("other")) is False  # whole again: nothing to do
    assert loads == {"first": 1}
    assert untimed(other.pop_for(["m"])) == job("a", at=1)
    assert queues.queued("m") == [job("b", at=2)]


def test_a_push_racing_a_rebuild_is_not_lost(client, prefix, shared):
    """A push before the rebuild closed the queue is in the rows the rebuild reads (pushes follow
    the commit); a push after fails with QueueLost, and its retry after the rebuild lands."""
    queues, other = RedisQueues(client, prefix), shared()
    queues.rebuild([job("old", at=1)])
    database = [job("old", at=1), job("before", at=2)]
    assert other.push(job("before", at=2)) is True

    def load() -> list[QueuedJob]:
        rows = list(database)  # the database read ...
        database.append(job("during", at=3))  # ... then another process commits a job and pushes it
        with pytest.raises(QueueLost):
            other.push(job("during", at=3))
        with pytest.raises(QueueLost):
            other.pop_for(["m"])
        return rows

    assert queues.rebuild_from(load) is True
    assert ids(queues.queued("m")) == ["old", "before"]
    assert other.recover(lambda: pytest.fail("the queue is whole: no second rebuild")) is False
    assert other.push(job("during", at=3)) is True  # the owner's retry
    assert ids(queues.queued("m")) == ["old", "before", "during"]


def test_a_process_that_finds_a_rebuild_in_progress_waits_for_it(client, prefix, shared):
    started, finish = threading.Event(), threading.Event()

    def slow_load() -> list[QueuedJob]:
        started.set()
        assert finish.wait(timeout=30)
        return [job("a")]

    rebuilding = RedisQueues(client, prefix)
    thread = threading.Thread(target=rebuilding.rebuild_from, args=(slow_load,))
    thread.start()
    assert started.wait(timeout=30)

    def let_the_rebuild_end(_seconds: float) -> None:
        finish.set()
        thread.join(timeout=30)

    waiting = shared(sleep=let_the_rebuild_end)
    assert waiting.rebuild_from(lambda: pytest.fail("rebuilt a second time")) is False
    assert waiting.queued("m") == [job("a")]
    assert not thread.is_alive()


def test_it_takes_over_a_rebuild_whose_process_died(client, prefix, shared):
    client.set(f"{prefix}:lock", "a process that died mid-rebuild", px=60_000)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            client.delete(f"{prefix}:lock")  # the dead process's lock expires

    queues = shared(sleep=sleep)
    assert queues.recover(lambda: [job("a")]) is True
    assert len(sleeps) == 3 and queues.queued("m") == [job("a")]


def test_it_gives_up_waiting_for_a_rebuild_that_never_ends(client, prefix, shared):
    client.set(f"{prefix}:lock", "a rebuild stuck for good", px=60_000)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    queues = shared(clock=lambda: now[0], sleep=sleep, wait_seconds=1.0, poll_seconds=0.25)
    with pytest.raises(QueueRebuildTimedOut):
        queues.recover(lambda: pytest.fail("the lock is not ours"))
    assert now[0] == 1.0 and queues.is_lost()


def test_a_rebuild_that_lost_its_lock_installs_nothing(client, prefix, shared):
    """Its lock expired during a slow load and another process rebuilt meanwhile: its older read
    must not overwrite that one."""
    lock = f"{prefix}:lock"
    newer = shared()

    def stale_load() -> list[QueuedJob]:
        client.set(lock, "another process", px=60_000)  # ours expired; another process took it
        return [job("stale")]

    def the_other_rebuild_ends(_seconds: float) -> None:
        client.delete(lock)
        newer.rebuild([job("fresh")])

    slow = shared(sleep=the_other_rebuild_ends)
    assert slow.rebuild_from(stale_load) is False
    assert slow.queued("m") == [job("fresh")]
    assert staged_keys(client, prefix) == []


def test_a_failed_database_read_leaves_the_queue_lost_and_unlocked(client, prefix):
    queues = RedisQueues(client, prefix)
    queues.rebuild([job("a")])

    def broken_load() -> list[QueuedJob]:
        raise ConnectionError("database down")

    with pytest.raises(ConnectionError):
        queues.rebuild_from(broken_load)
    assert queues.is_lost()
    assert queues.recover(lambda: [job("b")]) is True
    assert queues.queued("m") == [job("b")]


def test_it_rebuilds_a_large_queue_in_chunks(client, prefix):
    jobs = [job(f"{n:06d}", model=f"m{n % 3}", priority=n % 10, at=n) for n in range(25_000)]
    queues = RedisQueues(client, prefix)
    queues.rebuild([job("stale")])
    reference = MemoryQueues()
    reference.rebuild(jobs)

    queues.rebuild(jobs)

    assert len(queues) == 25_000 and queues.counts() == reference.counts()
    for model in ("m0", "m1", "m2"):
        assert queues.queued(model) == reference.queued(model)
    assert staged_keys(client, prefix) == []
    assert client.ttl(f"{prefix}:q:m0") == -1 and client.ttl(f"{prefix}:jobs") == -1  # no staging expiry left


# --- several processes at once ------------------------------------------------------------------

def run_threads(count: int, target: Callable[[int], None]) -> None:
    """Start `count` threads together (a barrier) and wait for them; re-raise the first failure."""
    barrier = threading.Barrier(count)
    failures: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            target(index)
        except BaseException as error:  # noqa: B036 - carried to the test's thread
            failures.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    if failures:
        raise failures[0]


def test_processes_popping_at_once_get_every_job_exactly_once(client, prefix, shared):
    jobs = [job(str(uuid.uuid4()), model="ab"[n % 2], priority=n % 10, at=n) for n in range(2_000)]
    RedisQueues(client, prefix).rebuild(jobs)
    processes = [shared() for _ in range(8)]
    popped: list[list[QueuedJob]] = [[] for _ in processes]

    def pop_all(index: int) -> None:
        while (taken := processes[index].pop_for(["a", "b"])) is not None:
            popped[index].append(taken)

    run_threads(len(processes), pop_all)

    everything = [taken for taken_by_one in popped for taken in taken_by_one]
    assert len(everything) == len(jobs) and set(map(untimed, everything)) == set(jobs)
    for model in "ab":  # one account: each model's jobs left in its order, each with a later turn
        left = sorted((taken for taken in everything if taken.model_id == model), key=lambda queued: queued.turn_us)
        assert left == sorted(left, key=lambda queued: queued.key)
        assert len({taken.turn_us for taken in left}) == len(left)
    assert len(processes[0]) == 0 and processes[0].counts() == {}


def test_a_job_removed_and_popped_at_once_goes_to_exactly_one(client, prefix, shared):
    jobs = [job(str(uuid.uuid4()), at=n) for n in range(2_000)]
    RedisQueues(client, prefix).rebuild(jobs)
    processes = [shared() for _ in range(8)]
    taken: list[list[QueuedJob]] = [[] for _ in processes]

    def pop_or_remove(index: int) -> None:
        queues = processes[index]
        if index % 2:  # a canceller, going through every job in its own order
            order = [queued.job_id for queued in jobs]
            random.Random(index).shuffle(order)
            taken[index] += [removed for job_id in order if (removed := queues.remove(job_id)) is not None]
        else:
            while (popped := queues.pop_for(["m"])) is not None:
                taken[index].append(popped)

    run_threads(len(processes), pop_or_remove)

    everything = Counter(untimed(queued) for taken_by_one in taken for queued in taken_by_one)
    assert set(everything) == set(jobs) and set(everything.values()) == {1}
    assert len(processes[0]) == 0


def test_pushes_racing_rebuilds_are_never_lost(client, prefix, shared):
    """Each pusher commits its job to the 'database' and then pushes it, retrying after a rebuild
    on QueueLost, as an owner does; meanwhile another process rebuilds again and again."""
    database: dict[str, QueuedJob] = {}
    database_lock = threading.Lock()

    def load() -> list[QueuedJob]:
        with database_lock:
            return list(database.values())

    RedisQueues(client, prefix).rebuild([])
    pushers = [shared() for _ in range(4)]
    rebuilder = shared()
    lost = Counter()

    def work(index: int) -> None:
        if index == len(pushers):
            for _ in range(10):
                rebuilder.rebuild_from(load)
            return
        queues = pushers[index]
        for n in range(300):
            pushed = job(f"{index}-{n:03d}", model="ab"[n % 2], priority=n % 10, at=n)
            with database_lock:
                database[pushed.job_id] = pushed
            while True:
                try:
                    queues.push(pushed)
                    break
                except QueueLost:
                    lost[index] += 1
                    queues.recover(load)

    run_threads(len(pushers) + 1, work)

    reference = MemoryQueues()
    reference.rebuild(database.values())
    assert len(rebuilder) == 1_200 and rebuilder.counts() == reference.counts()
    for model in "ab":
        assert rebuilder.queued(model) == reference.queued(model)
    assert staged_keys(client, prefix) == []
