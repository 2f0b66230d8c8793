"""The one owner of an API process's long-lived objects (dispatcher, admission, relay, caches,
background runners): each app declares a Slot, `runtime` makes its object on first use, asgi.py
starts them, tests reset them with one call. docs/architecture.md, "Process state"."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Slot(Generic[T]):
    """A long-lived object's place: its name, how to make it, and what starting and stopping it
    mean (None: nothing to do). Declared once, at module level, by the app that owns the object."""

    name: str
    make: Callable[[], T]
    start: Callable[[T], object] | None = None
    stop: Callable[[T], object] | None = None


class Runtime:
    """This process's objects, one per slot, made on first use; `start` starts the slots apps
    registered as starting with the process, `reset` stops and forgets every object."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._objects: dict[Slot[Any], Any] = {}
        self._started: list[Slot[Any]] = []
        self._at_start: list[Slot[Any]] = []

    def get(self, slot: Slot[T]) -> T:
        """The slot's object, made now if it is the first use."""
        found = self._objects.get(slot)
        if found is not None:
            return cast(T, found)
        with self._lock:
            if slot not in self._objects:
                self._objects[slot] = slot.make()
            return cast(T, self._objects[slot])

    def made(self, slot: Slot[T]) -> T | None:
        """The slot's object if it was made, without making it."""
        return cast("T | None", self._objects.get(slot))

    def register(self, *slots: Slot[Any]) -> None:
        """Slots to start with the process (apps' ready()); registering one twice changes nothing."""
        with self._lock:
            self._at_start.extend(slot for slot in slots if slot not in self._at_start)

    def start(self, *slots: Slot[Any]) -> None:
        """Start the given slots' objects (every registered one when none is given), each once."""
        with self._lock:
            for slot in slots or tuple(self._at_start):
                if slot in self._started:
                    continue
                self._started.append(slot)
                if slot.start is not None:
                    slot.start(self.get(slot))

    def stop(self, *slots: Slot[Any]) -> None:
        """Stop the given slots' objects (every object made, when none is given), the latest made
        first; a stop that fails is logged, not raised. They may start again."""
        with self._lock:
            chosen = [slot for slot in reversed(list(self._objects)) if not slots or slot in slots]
            self._started = [slot for slot in self._started if slot not in chosen]
            for slot in chosen:
                if slot.stop is not None:
                    try:
                        slot.stop(self._objects[slot])
                    except Exception:
                        log.exception("could not stop %s", slot.name)

    def reset(self, *slots: Slot[Any]) -> None:
        """Stop and forget the given slots' objects (every one, when none is given), as a restarted
        process has none: the next use makes them anew (tests)."""
        with self._lock:
            self.stop(*slots)
            for slot in list(self._objects):
                if not slots or slot in slots:
                    del self._objects[slot]


runtime = Runtime()
