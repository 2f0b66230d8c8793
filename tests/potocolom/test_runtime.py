"""The process's runtime (potocolom/runtime.py): one object per slot, made on first use and shared by
every caller and thread; the slots apps register start once with the process; a reset stops and
forgets them, as a restarted process has none. Each test uses a Runtime of its own."""
from __future__ import annotations

import threading

from potocolom.runtime import Runtime, Slot


class Thing:
    def __init__(self) -> None:
        self.events: list[str] = []


def test_an_object_is_made_on_first_use_and_shared_after():
    made = []
    slot = Slot("thing", make=lambda: made.append(Thing()) or made[-1])
    runtime = Runtime()

    assert runtime.made(slot) is None
    first = runtime.get(slot)

    assert runtime.get(slot) is first and runtime.made(slot) is first and len(made) == 1


def test_threads_asking_at_once_get_one_object():
    made = []
    gate = threading.Barrier(8)

    def make() -> Thing:
        made.append(Thing())
        return made[-1]

    slot = Slot("thing", make=make)
    runtime = Runtime()
    seen: list[Thing] = []

    def ask() -> None:
        gate.wait()
        seen.append(runtime.get(slot))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(made) == 1 and all(found is made[0] for found in seen)


def test_the_registered_slots_start_once_whatever_the_number_of_starts():
    log: list[str] = []
    dispatcher = Slot("dispatcher", make=Thing, start=lambda thing: log.append("dispatcher"))
    sweep = Slot("sweep", make=Thing, start=lambda thing: log.append("sweep"))
    cache = Slot("cache", make=Thing)  # nothing to start: made on first use only
    runtime = Runtime()
    runtime.register(dispatcher, sweep)
    runtime.register(dispatcher)

    runtime.start()
    runtime.start()

    assert log == ["dispatcher", "sweep"] and runtime.made(cache) is None


def test_a_reset_stops_what_was_made_latest_first_and_the_next_use_makes_anew():
    log: list[str] = []
    first = Slot("first", make=Thing, stop=lambda thing: log.append("first"))
    second = Slot("second", make=Thing, stop=lambda thing: log.append("second"))
    runtime = Runtime()
    before = runtime.get(first)
    runtime.get(second)

    runtime.reset()

    assert log == ["second", "first"]
    assert runtime.made(first) is None and runtime.get(first) is not before


def test_a_reset_of_one_slot_leaves_the_others():
    dispatcher = Slot("dispatcher", make=Thing)
    relay = Slot("relay", make=Thing)
    runtime = Runtime()
    old_dispatcher, kept_relay = runtime.get(dispatcher), runtime.get(relay)

    runtime.reset(dispatcher)  # an API process's dispatcher restarted, its sockets still open

    assert runtime.get(dispatcher) is not old_dispatcher and runtime.get(relay) is kept_relay


def test_a_stop_that_fails_is_logged_and_the_others_still_stop(caplog):
    log: list[str] = []

    def fail(thing: Thing) -> None:
        raise RuntimeError("the database is away")

    kept = Slot("kept", make=Thing, stop=lambda thing: log.append("kept"))
    failing = Slot("failing", make=Thing, stop=fail)
    runtime = Runtime()
    runtime.get(kept)
    runtime.get(failing)

    runtime.reset()

    assert log == ["kept"] and "could not stop failing" in caplog.text
    assert runtime.made(kept) is None and runtime.made(failing) is None


def test_a_slot_started_again_after_a_reset_starts_again():
    log: list[str] = []
    sweep = Slot("sweep", make=Thing, start=lambda thing: log.append("start"), stop=lambda thing: log.append("stop"))
    runtime = Runtime()
    runtime.register(sweep)
    runtime.start()

    runtime.reset()
    runtime.start()

    assert log == ["start", "stop", "start"]
