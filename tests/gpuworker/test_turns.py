"""The worker's priority rule (turns.py), pure: accounts take turns in the order their jobs were
received, an account's jobs fill its turns by priority, and a job leaving takes its turn with it."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuworker.turns import TurnBook

# (jobs received in this order as (job_id, account, priority), jobs that leave after, run order)
CASES = [
    ([], [], []),
    ([("a1", "alice", 0), ("a2", "alice", 0)], [], ["a1", "a2"]),
    ([("a1", "alice", 0), ("a2", "alice", 9)], [], ["a2", "a1"]),
    ([("a1", "alice", 0), ("b1", "bob", 9)], [], ["a1", "b1"]),  # another account's priority counts for nothing
    ([("a1", "alice", 0), ("b1", "bob", 0), ("a2", "alice", 9)], [], ["a2", "b1", "a1"]),  # never moves bob back
    ([("a1", "alice", 0), ("b1", "bob", 0), ("a2", "alice", 9)], ["a2"], ["b1", "a1"]),  # a2 used alice's turn
    ([("a1", "alice", 0), ("b1", "bob", 0), ("a2", "alice", 9)], ["a1"], ["a2", "b1"]),  # a1 held her second one
    ([("x1", None, 0), ("x2", None, 3)], [], ["x2", "x1"]),  # jobs without an account are one account
    ([("x1", None, 0), ("a1", "alice", 3)], [], ["x1", "a1"]),
    ([("a1", "alice", 5), ("a2", "alice", 5), ("a3", "alice", 7)], [], ["a3", "a1", "a2"]),
    ([("a1", "alice", 1), ("b1", "bob", 0), ("b2", "bob", 4), ("a2", "alice", 2)], ["b2"], ["a2", "b1", "a1"]),
]


@pytest.mark.parametrize(("received", "leaving", "order"), CASES)
def test_it_runs_accounts_in_the_order_received_and_each_accounts_jobs_by_priority(received, leaving, order):
    book = TurnBook()
    for job_id, account, priority in received:
        book.add(job_id, account=account, priority=priority)
    for job_id in leaving:
        assert book.remove(job_id)

    assert book.order() == order
    assert book.next() == (order[0] if order else None)
    assert len(book) == len(order)


def test_a_job_received_twice_or_removed_twice_is_refused_or_ignored():
    book = TurnBook()
    book.add("a1", account="alice", priority=0)

    with pytest.raises(ValueError):
        book.add("a1", account="alice", priority=1)
    assert book.remove("a1") and not book.remove("a1")
    assert book.next() is None


jobs = st.lists(st.tuples(st.sampled_from(["alice", "bob", None]), st.integers(0, 3)), max_size=8)


@given(jobs, st.data())
def test_no_job_runs_before_a_held_job_of_its_account_with_a_higher_priority(received, data):
    book = TurnBook()
    held = {}
    for n, (account, priority) in enumerate(received):
        book.add(f"j{n}", account=account, priority=priority)
        held[f"j{n}"] = (account, priority, n)
    for job_id in data.draw(st.lists(st.sampled_from(sorted(held) or ["none"]), unique=True)):
        if book.remove(job_id):
            del held[job_id]

    order = book.order()
    assert sorted(order) == sorted(held)
    for i, first in enumerate(order):
        for later in order[i + 1:]:
            (account, priority, n), (other_account, other_priority, m) = held[first], held[later]
            if account == other_account:
                assert (priority, -n) > (other_priority, -m)  # within an account: priority, then arrival


@given(jobs)
def test_priority_never_changes_which_account_has_each_turn(received):
    book = TurnBook()
    for n, (account, priority) in enumerate(received):
        book.add(f"j{n}", account=account, priority=priority)

    accounts = {f"j{n}": account for n, (account, _) in enumerate(received)}
    assert [accounts[job_id] for job_id in book.order()] == [account for account, _ in received]
