"""What each worker connected to this API process holds, one Hold a job, as the Dispatcher keeps it
(plain data, no Django). The story: docs/protocol.md, "Dead workers, reconnects, restarts" and
"The job" (priority preemption, moving a waiting job)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from scheduling.policy import HeldJob, Holding, QueuedJob, WorkerCapacity


@dataclass
class Hold:
    """A job a connected worker holds: it counts against the worker's depth until it is let go."""

    key: QueuedJob | None = None  # its queue key: given here, or read back on the worker's hello
    started: bool = False  # its first step began
    letting_go: bool = False  # told to cancel it (v2): it counts until the worker answers for it
    preempting: bool = False  # asked to give it back (`preempt`): no more a candidate to preempt

    @property
    def leaving(self) -> bool:
        return self.letting_go or self.preempting


@dataclass(frozen=True)
class Connection:
    """A connected worker as the services see it: where to send it messages, and what it speaks."""

    worker_id: str
    channel_name: str
    protocol: int
    draining: bool


@dataclass(frozen=True)
class Joined:
    """What a worker's hello changed here: the channel of an older connection it replaced, the jobs
    to send `cancel` for, and (v2) the jobs the API gave it that its hello does not list (dead-worker
    rule at once)."""

    replaced: str | None
    cancel: set[str]
    lost: set[str]


@dataclass
class Orphans:
    """Jobs that a worker held when this API process started; it has until `deadline` to say hello."""

    held: set[str]
    deadline: datetime
    cancelled: set[str] = field(default_factory=set)  # to tell the worker when it comes back


@dataclass
class ConnectedWorker:
    """One connection of a worker, and its holds by job id. A hold whose key is known comes after
    those known before it (the order the priority preemption and the moves read it in)."""

    worker_id: str
    channel_name: str
    models: frozenset[str]
    joined: int  # connection order, for a stable tie-break
    protocol: int = 1  # its hello's: a v2 worker answers `cancel` with job_failed
    draining: bool = False  # it said `draining` on this connection: it gets no new job
    rungs: dict[str, str] = field(default_factory=dict)  # model_id -> its memory rung there (moves)
    holds: dict[str, Hold] = field(default_factory=dict)

    def connection(self) -> Connection:
        return Connection(self.worker_id, self.channel_name, self.protocol, self.draining)

    def keeps(self, job_id: str) -> bool:
        """It holds the job and was not told to cancel it."""
        hold = self.holds.get(job_id)
        return hold is not None and not hold.letting_go

    def know(self, job: QueuedJob, *, started: bool = False) -> None:
        """It holds `job` (given here, or read back on its hello), whose key is now known."""
        hold = self.holds.get(job.job_id)
        if hold is None or hold.key is None:  # its place among the known ones is from now
            hold = self.holds.pop(job.job_id, None) or Hold()
            self.holds[job.job_id] = hold
        hold.key, hold.started = job, hold.started or started

    def can_unload(self, model_id: str) -> bool:
        """No job it holds is of `model_id`, nor one it cannot name the model of (to be safe)."""
        return all(hold.key is not None and hold.key.model_id != model_id for hold in self.holds.values())

    def capacity(self) -> WorkerCapacity:
        """What the dispatch decision reads of it."""
        return WorkerCapacity(self.worker_id, self.models, len(self.holds), self.joined, self.rungs,
                              self.draining, frozenset(self.holds))

    def holding(self, incoming: int = 0) -> Holding:
        """What the preemptions read of it: a v2 worker's held jobs, less those leaving, in the
        order it got them; `incoming`: jobs moving to it, counted as held."""
        preemptible = tuple(HeldJob(hold.key, hold.started) for hold in self.holds.values()
                            if hold.key is not None and not hold.leaving) if self.protocol >= 2 else ()
        return Holding(self.worker_id, self.models, len(self.holds) + incoming, preemptible, self.joined,
                       dict(self.rungs))


def on_hello(previous: ConnectedWorker | None, orphans: Orphans | None, *, channel_name: str, held: Iterable[str],
             listed: Iterable[str] | None) -> tuple[Joined, dict[str, Hold]]:
    """A worker's hello against what it held here before (`previous`, `orphans`, and `held`: what the
    database says). It is given the jobs it held; one it was letting go of stays so (v1), or is
    given back only when the database still gives it. A v1 hello (`listed` None) keeps them all and
    is told of those cancelled while it was away; a v2 hello keeps those it lists, the others are
    `lost`, and a listed job the API does not give it gets `cancel` and counts until let go."""
    before: Mapping[str, Hold] = previous.holds if previous else {}
    given = set(held) | {job_id for job_id, hold in before.items() if not hold.letting_go}
    if orphans:
        given |= orphans.held
    replaced = previous.channel_name if previous and previous.channel_name != channel_name else None
    if listed is None:
        joined = Joined(replaced, orphans.cancelled if orphans else set(), set())
        letting_go = {job_id for job_id, hold in before.items() if hold.letting_go}
        kept = given | letting_go
    else:
        listed = set(listed)
        joined = Joined(replaced, listed - given, given - listed)
        letting_go, kept = joined.cancel, (given & listed) | joined.cancel
    # Keys and starts carry over; an ask to preempt does not (the worker is asked again if need be).
    holds = {job_id: Hold(hold.key, hold.started, job_id in letting_go) for job_id, hold in before.items()
             if job_id in kept and hold.key is not None}
    for job_id in sorted(kept - holds.keys()):
        hold = before.get(job_id)
        holds[job_id] = Hold(None, hold.started if hold else False, job_id in letting_go)
    return joined, holds
