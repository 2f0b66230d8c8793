"""The worker's priority rule over the jobs it holds, as plain data (no threads, no clock): which job
runs next, and whether the running one must step aside (accounts take turns in arrival order, an
account's jobs fill its turns by priority); docs/protocol.md, "Priority at every step" under "API → worker"."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldTurn:
    """A held job as the rule sees it: its account's key (None: the jobs without one, which count
    as one account), its priority (higher first) and the order it was received in."""

    job_id: str
    account: str | None
    priority: int
    received: int


class TurnBook:
    """The held jobs and their accounts' turns.

    Each job received adds a turn for its account, at the place of its arrival; each job that
    leaves (ended, cancelled, preempted) takes away the turn it held. An account's jobs fill its
    turns highest priority first (then earliest received), and the jobs run in the order of the
    turns they fill. So a job never runs while its account holds one of higher priority, and
    priority never moves another account's job back: received alice a1, bob b1, then alice a2 at a
    higher priority, the order is a2 b1 a1 (a2 takes alice's first turn, a1 her second).
    """

    def __init__(self) -> None:
        self._jobs: dict[str, HeldTurn] = {}
        self._turns: dict[str | None, list[int]] = {}
        self._received = itertools.count()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def add(self, job_id: str, *, account: str | None, priority: int) -> HeldTurn:
        """A job received: it joins its account's line, and the account gains a turn here."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already held")
        held = HeldTurn(job_id, account, priority, next(self._received))
        self._jobs[job_id] = held
        self._turns.setdefault(account, []).append(held.received)
        return held

    def remove(self, job_id: str) -> bool:
        """A job left: its account loses the turn the job held. False when it was not held."""
        held = self._jobs.get(job_id)
        if held is None:
            return False
        turn = self._filled_turns()[job_id]
        del self._jobs[job_id]
        turns = self._turns[held.account]
        turns.remove(turn)
        if not turns:
            del self._turns[held.account]
        return True

    def order(self) -> list[str]:
        """The held jobs in the order they run, as the book stands."""
        filled = self._filled_turns()
        return sorted(filled, key=filled.__getitem__)

    def next(self) -> str | None:
        """The job to denoise now (the first of `order`), or None when none is held."""
        filled = self._filled_turns()
        return min(filled, key=filled.__getitem__) if filled else None

    def _filled_turns(self) -> dict[str, int]:
        """Each job's turn: an account's jobs, by priority then arrival, fill its turns in order."""
        lines: dict[str | None, list[HeldTurn]] = {}
        for held in self._jobs.values():
            lines.setdefault(held.account, []).append(held)
        filled: dict[str, int] = {}
        for account, line in lines.items():
            line.sort(key=lambda held: (-held.priority, held.received))
            for held, turn in zip(line, sorted(self._turns[account]), strict=True):
                filled[held.job_id] = turn
        return filled
