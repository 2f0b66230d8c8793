"""First-fit admission, slot counting and the idle rule: pure functions, tables and Hypothesis."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.policy import (
    GoneSession,
    Placement,
    QueuedSession,
    first_fit,
    free_slots,
    idle_at,
    is_idle,
    model_slots,
    place_to_resume,
    placement_event_applies,
    positions,
    queue_order,
)


def s(session_id: str, model_id: str, joined_us: int, refused_by: tuple[str, ...] = ()) -> QueuedSession:
    return QueuedSession(session_id, model_id, joined_us, frozenset(refused_by))


@pytest.mark.parametrize("queued, free, expected", [
    ([], {("w1", "a"): 1}, []),
    ([s("x", "a", 1)], {}, []),
    ([s("x", "a", 1)], {("w1", "a"): 0}, []),
    ([s("x", "a", 1)], {("w1", "a"): 1}, [("x", "w1")]),
    # first joined first, whatever the input order
    ([s("late", "a", 2), s("early", "a", 1)], {("w1", "a"): 1}, [("early", "w1")]),
    # a model without room does not hold up one with room
    ([s("x", "a", 1), s("y", "b", 2)], {("w1", "b"): 1}, [("y", "w1")]),
    # first worker by worker_id
    ([s("x", "a", 1)], {("w2", "a"): 3, ("w1", "a"): 1}, [("x", "w1")]),
    # spill to the next worker once the first is full
    ([s("x", "a", 1), s("y", "a", 2)], {("w2", "a"): 3, ("w1", "a"): 1}, [("x", "w1"), ("y", "w2")]),
    # a worker that refused the session is not tried again
    ([s("x", "a", 1, ("w1",))], {("w1", "a"): 1, ("w2", "a"): 1}, [("x", "w2")]),
    ([s("x", "a", 1, ("w1",)), s("y", "a", 2)], {("w1", "a"): 1}, [("y", "w1")]),
    # slots of another model on the same worker are not this model's
    ([s("x", "a", 1)], {("w1", "b"): 4}, []),
    # the id breaks an exact tie of join times
    ([s("b", "a", 5), s("a", "a", 5)], {("w1", "a"): 1}, [("a", "w1")]),
])
def test_it_places_by_first_fit_in_join_order(queued, free, expected):
    assert [(p.session_id, p.worker_id) for p in first_fit(queued, free)] == expected


@pytest.mark.parametrize("entry, budget, slots", [
    ({"realtime": True, "frame_ms_p95": 40.0, "realtime_slots": 4}, 500.0, 4),
    ({"realtime": True, "frame_ms_p95": 500.0, "realtime_slots": 2}, 500.0, 2),  # at the budget: within
    ({"realtime": True, "frame_ms_p95": 501.0, "realtime_slots": 2}, 500.0, 0),  # over the API's budget
    ({"realtime": True, "frame_ms_p95": 300.0, "realtime_slots": 2}, 250.0, 0),
    ({"realtime": True, "frame_ms_p95": None, "realtime_slots": 2}, 500.0, 0),  # unknown frame time
    ({"realtime": False, "frame_ms_p95": 40.0, "realtime_slots": 3}, 500.0, 0),  # no realtime on this rung
    ({"realtime": True, "frame_ms_p95": 40.0, "realtime_slots": 0}, 500.0, 0),
])
def test_it_counts_a_models_slots_only_with_realtime_within_the_budget(entry, budget, slots):
    assert model_slots(frame_budget_ms=budget, **entry) == slots


def test_it_subtracts_sessions_placing_or_live_from_the_slots():
    capacity = {("w1", "a"): 2, ("w1", "b"): 1, ("w2", "a"): 1}
    held = [("w1", "a"), ("w1", "b"), ("w1", "b"), ("w9", "a")]

    assert free_slots(capacity, held) == {("w1", "a"): 1, ("w1", "b"): 0, ("w2", "a"): 1}


@pytest.mark.parametrize("last_input, now, idle_seconds, idle", [
    (100.0, 100.0, 60.0, False),
    (100.0, 159.9, 60.0, False),
    (100.0, 160.0, 60.0, True),
    (100.0, 500.0, 60.0, True),
    (100.0, 100.5, 0.5, True),
])
def test_it_calls_a_session_idle_after_idle_seconds_without_input(last_input, now, idle_seconds, idle):
    last_input, now = NOW + timedelta(seconds=last_input), NOW + timedelta(seconds=now)
    assert is_idle(last_input, now, idle_seconds) is idle
    assert (now >= idle_at(last_input, idle_seconds)) is idle


def test_it_numbers_positions_among_all_queued_sessions_in_join_order():
    queued = [s("c", "b", 30), s("a", "a", 10), s("b", "a", 20)]

    assert positions(queued) == {"a": 1, "b": 2, "c": 3}


# --- a place given back to a browser whose API process died -------------------------------------

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
WINDOW = timedelta(seconds=40)
ALICE, BOB = 1, 2
SIZE = {"width": 256, "height": 256, "steps": 2}


def gone(session_id: str, *, account: int = ALICE, model: str = "a", params: dict | None = None,
         joined_s: float = 0.0, gone_s: float = -5.0, resumed: bool = False) -> GoneSession:
    """A session that joined `joined_s` and was found gone `gone_s` seconds from NOW."""
    return GoneSession(session_id, account, model, SIZE if params is None else params,
                       NOW + timedelta(seconds=joined_s - 600), NOW + timedelta(seconds=gone_s), resumed)


def resumes(candidates: list[GoneSession], *, account: int = ALICE, model: str = "a",
            params: dict | None = None) -> str | None:
    chosen = place_to_resume(candidates, account_id=account, model_id=model,
                             params=SIZE if params is None else params, now=NOW, window=WINDOW)
    return chosen.session_id if chosen is not None else None


@pytest.mark.parametrize("candidates, expected", [
    ([], None),
    ([gone("x")], "x"),
    # only the same account's
    ([gone("x", account=BOB)], None),
    ([gone("x", account=BOB, joined_s=1), gone("y", joined_s=2)], "y"),
    # only the same model's, with the same params
    ([gone("x", model="b")], None),
    ([gone("x", params={"width": 512, "height": 256, "steps": 2})], None),
    ([gone("x", params={})], None),
    ([gone("x", params={"width": 256, "height": 256})], None),
    # the one that joined first first; the id breaks an exact tie
    ([gone("late", joined_s=20), gone("early", joined_s=10)], "early"),
    ([gone("b", joined_s=10), gone("a", joined_s=10)], "a"),
    # only within the window from when its process was found gone (its bound included)
    ([gone("x", gone_s=-40)], "x"),
    ([gone("x", gone_s=-40.001)], None),
    ([gone("old", joined_s=1, gone_s=-41), gone("new", joined_s=2, gone_s=-1)], "new"),
    # a clock of another process a little ahead is no reason to refuse
    ([gone("x", gone_s=0.5)], "x"),
    # a place is taken once
    ([gone("x", resumed=True)], None),
    ([gone("x", joined_s=1, resumed=True), gone("y", joined_s=2)], "y"),
])
def test_a_reconnect_takes_the_place_of_its_accounts_oldest_gone_session_of_the_same_model_and_params(
        candidates, expected):
    assert resumes(candidates) == expected


def test_it_matches_params_whatever_their_order_and_an_empty_query_only_with_an_empty_query():
    assert resumes([gone("x", params={"steps": 2, "height": 256, "width": 256})]) == "x"
    assert resumes([gone("x", params={})], params={}) == "x"


def test_two_reconnects_of_an_account_with_two_gone_sessions_take_both_places_oldest_first():
    candidates = [gone("second", joined_s=20), gone("first", joined_s=10), gone("bobs", account=BOB, joined_s=5)]
    taken = []
    while (chosen := resumes(candidates)) is not None:
        taken.append(chosen)
        candidates = [replace(g, resumed=True) if g.session_id == chosen else g for g in candidates]

    assert taken == ["first", "second"], "each place once, oldest first; never another account's"
    assert resumes(candidates, account=BOB) == "bobs"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(
    gone, st.sampled_from("uvwxyz"), account=st.sampled_from((ALICE, BOB)), model=st.sampled_from("ab"),
    params=st.sampled_from((SIZE, {})), joined_s=st.integers(0, 5), gone_s=st.integers(-60, 2),
    resumed=st.booleans()), max_size=8))
def test_the_place_taken_is_a_fitting_one_and_no_fitting_one_joined_before_it(candidates):
    def fits(g: GoneSession) -> bool:
        return (g.account_id, g.model_id, dict(g.params), g.resumed) == (ALICE, "a", SIZE, False) \
            and NOW - g.gone_at <= WINDOW

    chosen = place_to_resume(candidates, account_id=ALICE, model_id="a", params=SIZE, now=NOW, window=WINDOW)
    fitting = [g for g in candidates if fits(g)]
    assert (chosen is None) == (not fitting)
    if chosen is not None:
        assert fits(chosen)
        assert all((chosen.joined_at, chosen.session_id) <= (g.joined_at, g.session_id) for g in fitting)


# --- properties ------------------------------------------------------------------------------------

WORKERS = ("w1", "w2", "w3")
MODELS = ("a", "b", "c")


@st.composite
def situations(draw):
    count = draw(st.integers(0, 25))
    joined = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count))
    queued = [s(f"s{n}", draw(st.sampled_from(MODELS)), joined[n],
                tuple(draw(st.sets(st.sampled_from(WORKERS), max_size=2)))) for n in range(count)]
    free = draw(st.dictionaries(st.tuples(st.sampled_from(WORKERS), st.sampled_from(MODELS)),
                                st.integers(0, 4), max_size=9))
    return queued, free


@settings(max_examples=100, deadline=None)
@given(situations())
def test_no_slot_is_ever_given_twice_and_only_fitting_sessions_are_placed(situation):
    queued, free = situation
    placements = first_fit(queued, free)
    by_id = {q.session_id: q for q in queued}

    given_out = Counter((p.worker_id, p.model_id) for p in placements)
    assert all(count <= free.get(key, 0) for key, count in given_out.items())
    assert len({p.session_id for p in placements}) == len(placements)
    for p in placements:
        assert p.model_id == by_id[p.session_id].model_id
        assert p.worker_id not in by_id[p.session_id].refused_by


@settings(max_examples=100, deadline=None)
@given(situations())
def test_a_session_is_skipped_only_when_no_slot_of_its_model_was_left_for_it(situation):
    queued, free = situation
    placed = {p.session_id for p in first_fit(queued, free)}
    remaining = dict(free)
    for p in first_fit(queued, free):
        remaining[(p.worker_id, p.model_id)] -= 1
    for session in queued:
        if session.session_id not in placed:
            assert all(remaining.get((w, session.model_id), 0) <= 0 or w in session.refused_by for w in WORKERS)


@settings(max_examples=100, deadline=None)
@given(situations(), st.data())
def test_the_queue_order_never_changes_except_by_leaving(situation, data):
    queued, free = situation
    before = [q.session_id for q in queue_order(queued)]
    placed = {p.session_id for p in first_fit(queued, free)}
    leaving = data.draw(st.sets(st.sampled_from(before))) if before else set()
    stay = [q for q in queued if q.session_id not in placed | leaving]

    after = [q.session_id for q in queue_order(stay)]

    assert after == [i for i in before if i in {q.session_id for q in stay}]
    assert list(positions(stay).values()) == list(range(1, len(stay) + 1))
    # placements follow the queue: a placed session never jumps one of its model that was left waiting
    order = {i: n for n, i in enumerate(before)}
    for p in first_fit(queued, free):
        waiting = [q for q in stay if q.model_id == p.model_id and not q.refused_by and order[q.session_id]
                   < order[p.session_id]]
        assert not waiting, (p, waiting)


def test_placements_are_plain_values():
    assert Placement("x", "w1", "a") == Placement("x", "w1", "a")


# --- several API processes: news of placements reaching the browser's process -----------------------

@pytest.mark.parametrize("kind, known, placement, applies", [
    ("live", 0, 1, True),    # the first placement goes live
    ("live", 1, 2, True),    # placed again after going back: a newer placement
    ("live", 2, 2, False),   # a late live of a placement already ended (back came first)
    ("live", 3, 2, False),   # a live of an earlier placement, overtaken by a newer one
    ("back", 1, 1, True),    # the live placement ended
    ("back", 1, 2, True),    # back from a placement not yet heard live of: the session waits again
    ("back", 2, 1, False),   # a late back of an earlier placement must not end a newer live one
])
def test_it_applies_news_of_a_placement_only_when_it_is_not_stale(kind, known, placement, applies):
    assert placement_event_applies(kind, known=known, placement=placement) is applies


def test_it_rejects_an_unknown_kind_of_placement_news():
    with pytest.raises(ValueError):
        placement_event_applies("idle", known=0, placement=1)


# --- positions moved by an admission's news -------------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from realtime.policy import moved_position  # noqa: E402


@given(st.sets(st.integers(0, 50), min_size=1, max_size=30), st.data())
def test_moved_positions_are_the_positions_of_the_queue_after_the_moves(before, data):
    keys = sorted((n, f"s{n}") for n in before)
    mine = data.draw(st.sampled_from(keys))
    left = [k for k in keys if k != mine and data.draw(st.booleans())]
    joined = [(n, f"s{n}") for n in data.draw(st.sets(st.integers(51, 99) | st.integers(-20, -1)))]
    after = sorted([k for k in keys if k not in left] + joined)

    assert moved_position(keys.index(mine) + 1, mine, left=left, joined=joined) == after.index(mine) + 1
