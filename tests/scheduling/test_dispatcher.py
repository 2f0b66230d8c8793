"""The Dispatcher as plain Python: connected workers' holds, cancels, reservations, moves and drain,
over MemoryQueues with a fake claim in place of the database's compare-and-set."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduling.dispatcher import Dispatcher
from scheduling.policy import Assignment, HeldJob, Move, QueuedJob
from scheduling.queues.memory import MemoryQueues

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def alice(n: int, *, priority: int = 0, model: str = "m") -> QueuedJob:
    return QueuedJob(f"alice-{n}", model, priority, n, "alice")


def bob(n: int, *, priority: int = 0, model: str = "m") -> QueuedJob:
    return QueuedJob(f"bob-{n}", model, priority, 100 + n, "bob")


class Claims:
    """The database's compare-and-set, faked: every claim succeeds but those of `refused` jobs."""

    def __init__(self, *refused: str) -> None:
        self.refused = set(refused)
        self.asked: list[str] = []

    def __call__(self, assignment: Assignment) -> bool:
        self.asked.append(assignment.job.job_id)
        return assignment.job.job_id not in self.refused


def dispatcher_with(*queued: QueuedJob, depth: int = 2) -> Dispatcher:
    current = Dispatcher(depth=depth, queues=MemoryQueues())
    for job in queued:
        current.push(job)
    return current


def dispatch(current: Dispatcher, claims: Claims | None = None) -> list[tuple[str, str]]:
    return [(a.job.job_id, a.worker_id) for a in current.plan(claims or Claims())]


def connect(current: Dispatcher, worker_id: str, *, channel: str | None = None, protocol: int = 2, **hello):
    hello.setdefault("models", ["m"])
    return current.connect(worker_id=worker_id, channel_name=channel or f"{worker_id}-1", protocol=protocol, **hello)


# --- connect, disconnect, reconnect ---------------------------------------------------------------

def test_it_gives_a_connected_worker_queued_jobs_up_to_its_depth():
    current = dispatcher_with(alice(1), alice(2), alice(3))
    connect(current, "w1")

    assert dispatch(current) == [("alice-1", "w1"), ("alice-2", "w1")]
    assert current.held() == {"w1": ["alice-1", "alice-2"]}
    assert current.position("alice-3") == 1


def test_it_gives_back_what_a_worker_held_when_it_disconnects():
    current = dispatcher_with(alice(1), bob(1))
    connect(current, "w1")
    dispatch(current)

    assert current.disconnect(worker_id="w1", channel_name="w1-1") == {"alice-1", "bob-1"}
    assert current.connected_ids() == set() and current.held() == {}


def test_it_ignores_the_disconnect_of_a_connection_a_newer_one_replaced():
    current = dispatcher_with(alice(1))
    connect(current, "w1", channel="old")
    dispatch(current)

    joined = connect(current, "w1", channel="new", protocol=1)

    assert joined.replaced == "old"
    assert current.disconnect(worker_id="w1", channel_name="old") is None
    assert current.held() == {"w1": ["alice-1"]}


def test_a_v1_worker_reconnecting_keeps_every_job_it_held():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1", protocol=1)
    dispatch(current)

    joined = connect(current, "w1", channel="w1-2", protocol=1)

    assert (joined.cancel, joined.lost) == (set(), set())
    assert current.held() == {"w1": ["alice-1", "alice-2"]}


def test_a_v2_worker_reconnecting_keeps_the_jobs_it_lists_and_loses_the_others():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1")
    dispatch(current)

    joined = connect(current, "w1", channel="w1-2", listed=["alice-1", "stray"])

    assert joined.lost == {"alice-2"}
    assert joined.cancel == {"stray"}  # a job the API does not give it: cancelled, counted until let go
    assert current.held() == {"w1": ["alice-1", "stray"]}
    assert current.let_go("stray", worker_id="w1")
    assert current.held() == {"w1": ["alice-1"]}


def test_a_worker_back_after_a_restart_keeps_what_the_database_gives_it_and_hears_of_cancels():
    current = dispatcher_with()
    current.load(queued=list, held={"w1": {"alice-1", "alice-2"}}, deadline=NOW + timedelta(seconds=40))
    assert current.knows("w1") and current.orphan_ids() == {"w1"}

    assert current.release("alice-1") == "w1"  # cancelled while it was away
    joined = connect(current, "w1", protocol=1)

    assert joined.cancel == {"alice-1"}
    assert current.held() == {"w1": ["alice-2"]} and current.orphan_ids() == set()


def test_it_hands_over_the_jobs_of_workers_that_did_not_come_back_in_time():
    current = dispatcher_with()
    current.load(queued=list, held={"w1": {"alice-1"}}, deadline=NOW)

    assert current.expired_orphans(now=NOW - timedelta(seconds=1)) == {}
    assert current.expired_orphans(now=NOW) == {"w1": {"alice-1"}}
    assert not current.knows("w1")


def test_it_reads_a_held_job_s_key_and_start_back_from_the_hello():
    current = dispatcher_with()
    connect(current, "w1", held=["alice-1"], listed=["alice-1"])

    current.describe("w1", [HeldJob(alice(1), started=True)])

    assert current.key_of("alice-1", worker_id="w1") == alice(1)
    assert current.key_of("alice-1", worker_id="w2") is None


def test_it_says_how_to_reach_a_connected_worker():
    current = dispatcher_with()
    connect(current, "w1", protocol=1)

    connection = current.connection("w1")

    assert connection is not None
    assert (connection.channel_name, connection.protocol, connection.draining) == ("w1-1", 1, False)
    assert current.channel_of("w1") == "w1-1" and current.connection("w2") is None


# --- claims and cancels ------------------------------------------------------------------------------

def test_it_drops_a_job_whose_claim_fails_and_gives_its_place_to_the_next():
    current = dispatcher_with(alice(1), alice(2), alice(3))
    connect(current, "w1")

    assert dispatch(current, Claims("alice-1")) == [("alice-2", "w1"), ("alice-3", "w1")]
    assert current.position("alice-1") is None


def test_a_cancelled_job_counts_against_a_v2_worker_s_depth_until_it_lets_it_go():
    current = dispatcher_with(alice(1), alice(2), alice(3))
    connect(current, "w1")
    dispatch(current)

    assert current.release("alice-1", until_let_go=True) == "w1"
    assert current.holder_of("alice-1") is None  # letting it go: no longer its holder
    assert dispatch(current) == []
    assert current.release("alice-1") is None  # only the worker's own answer frees it

    assert current.let_go("alice-1", worker_id="w1")
    assert dispatch(current) == [("alice-3", "w1")]


def test_a_cancelled_job_frees_a_v1_worker_s_place_at_once():
    current = dispatcher_with(alice(1), alice(2), alice(3))
    connect(current, "w1", protocol=1)
    dispatch(current)

    assert current.release("alice-1", until_let_go=True) == "w1"

    assert dispatch(current) == [("alice-3", "w1")]
    assert not current.let_go("alice-1", worker_id="w1")


def test_a_v1_worker_reconnecting_still_lets_go_of_what_it_was_told_to_cancel():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1")
    dispatch(current)
    current.release("alice-1", until_let_go=True)

    connect(current, "w1", channel="w1-2", protocol=1)

    assert current.held() == {"w1": ["alice-1", "alice-2"]}
    assert current.holder_of("alice-1") is None and current.let_go("alice-1", worker_id="w1")


# --- reservations and moves ------------------------------------------------------------------------

def test_a_reservation_is_served_first_once_its_worker_gives_a_job_back():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1")
    dispatch(current)
    current.push(bob(1))
    current.push(alice(3, priority=9))

    [preemption] = current.preemptions_for([alice(3, priority=9)])
    assert (preemption.worker_id, preemption.for_job_id) == ("w1", "alice-3")
    assert current.preempting(preemption) == "w1-1"
    assert current.preempting(preemption) is None  # asked already
    assert dispatch(current) == []  # not given back yet

    current.release(preemption.job_id, worker_id="w1")
    current.push(alice(2))
    assert dispatch(current) == [("alice-3", "w1")]  # ahead of bob-1, first in the queue's order


def test_a_reservation_ends_when_its_worker_drains():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1")
    dispatch(current)
    current.push(alice(3, priority=9))
    [preemption] = current.preemptions_for([alice(3, priority=9)])
    current.preempting(preemption)

    assert current.drain(worker_id="w1", channel_name="w1-1")
    current.release("alice-2", worker_id="w1")  # given back as job_preempted, queued again
    current.push(alice(2))
    connect(current, "w2")

    assert dispatch(current) == [("alice-3", "w2"), ("alice-2", "w2")]  # the queue's order


def test_a_job_waiting_behind_another_moves_to_an_idle_worker():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "busy")
    dispatch(current)
    current.started("alice-1", worker_id="busy")
    connect(current, "idle")

    assert current.moves() == [(Move("busy", "alice-2", "idle"), "busy-1")]
    assert current.is_moving("alice-2")
    current.push(bob(1))
    current.push(bob(2))
    assert dispatch(current) == [("bob-1", "idle")]  # the idle worker counts the moving job as held

    current.release("alice-2", worker_id="busy")
    current.push(alice(2))
    assert dispatch(current) == [("alice-2", "idle"), ("bob-2", "busy")]
    assert not current.is_moving("alice-2")


def test_a_move_ends_when_its_idle_worker_leaves():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "busy")
    dispatch(current)
    connect(current, "idle")
    current.moves()

    current.disconnect(worker_id="idle", channel_name="idle-1")

    assert not current.is_moving("alice-2")


# --- drain and models --------------------------------------------------------------------------------

def test_a_draining_worker_gets_no_new_job():
    current = dispatcher_with(alice(1), alice(2))
    connect(current, "w1")
    connect(current, "w2")

    assert current.drain(worker_id="w1", channel_name="w1-1")
    assert not current.drain(worker_id="w1", channel_name="stale")

    assert dispatch(current) == [("alice-1", "w2"), ("alice-2", "w2")]
    connection = current.connection("w1")
    assert connection is not None and connection.draining


def test_a_worker_serves_a_model_once_loaded_and_keeps_one_it_still_holds_a_job_of():
    current = dispatcher_with(alice(1, model="x"))
    connect(current, "w1")

    assert current.serve(worker_id="w1", channel_name="w1-1", model_id="x", rung="full")
    assert dispatch(current) == [("alice-1", "w1")]

    assert not current.withdraw(worker_id="w1", channel_name="w1-1", model_id="x")
    assert current.withdraw(worker_id="w1", channel_name="w1-1", model_id="m")
