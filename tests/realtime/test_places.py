"""A process's own queued sessions' positions, moved by numbered notices (realtime/admission/places.py):
what each place remembers of the notices it applied stays bounded however long it waits."""
from __future__ import annotations

from potocolom.protocol.events import SessionsMoved
from realtime.admission.places import RECENT_MOVES, Place, QueuePlaces


def test_moves_applied_in_order_fold_into_the_base():
    place = Place((1, "s"), position=5, base=10)
    for seq in range(11, 5_011):
        place.apply(seq)
    assert place.base == 5_010 and place.applied == set()
    assert place.includes(4_000) and not place.includes(5_011)


def test_moves_out_of_order_are_remembered_until_the_gap_fills():
    place = Place((1, "s"), position=5, base=10)
    place.apply(12)
    place.apply(13)
    assert place.includes(12) and not place.includes(11)
    place.apply(11)
    assert place.base == 13 and place.applied == set()


def test_a_gap_that_never_fills_does_not_grow_the_memory_without_bound():
    place = Place((1, "s"), position=5, base=10)  # notice 11 never comes (its admission rolled back)
    for seq in range(12, 12 + 3 * RECENT_MOVES):
        place.apply(seq)
    assert len(place.applied) <= RECENT_MOVES


def test_a_session_waiting_through_thousands_of_moves_keeps_its_position_and_little_else():
    places = QueuePlaces(lambda session_id: "browser" if session_id == "mine" else None)  # others: elsewhere
    places.places["mine"] = Place((1_000, "mine"), position=3, base=0)
    told = []
    for seq in range(1, 2_001):  # each move: someone of another process joins behind it
        told += places.moved(SessionsMoved(seq, left=(), joined=(((5_000 + seq, f"other-{seq}"), 4),)))
    assert places.places["mine"].position == 3 and told == []
    assert places.places["mine"].applied == set() and places.places["mine"].base == 2_000
