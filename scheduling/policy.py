"""The job path's decisions, pure (no Django, no I/O, time passed in): queue order by fair share,
which worker gets which job (reservations and moves first), preemptions, moves and retries.
docs/protocol.md, "Fair share" under "The job"."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, TypeVar

from potocolom.protocol.rungs import RUNG_GROUP_OFFLOAD, RUNGS

T = TypeVar("T")
STEPS_UNSAID = 30  # what a job whose params name no steps counts for (the params schemas' default)
STEPS_MAX = 999_999  # what one job counts for at most in the queue's sums (its entry holds 6 digits)


class QueuedJob(NamedTuple):
    """A queued job as the queue sees it (a tuple: 100,000 of them load in milliseconds).
    `turn_us` is set only on a job just popped: the turn key its dispatch gave its account.
    `steps`: its denoising steps, which the queue sums per model (the ETA's and placement's demand)."""

    job_id: str
    model_id: str
    priority: int
    submitted_us: int
    account: str = ""
    turn_us: int | None = None
    steps: int = STEPS_UNSAID

    @property
    def key(self) -> tuple[int, int, str]:
        """Its place in its account's line."""
        return (-self.priority, self.submitted_us, self.job_id)


class Turn(NamedTuple):
    """When an account last had a job dispatched from a model's queue (kept by the database)."""

    model_id: str
    account: str
    turn_us: int


def turn_key(last_turn_us: int | None, oldest_submitted_us: int) -> int:
    """An account's key in a model's rotation: its last dispatch from that queue, else the
    submission of its oldest queued job."""
    return oldest_submitted_us if last_turn_us is None else last_turn_us


def next_turn_us(at_us: int | None, *, clock_us: int, highest_key: int | None) -> int:
    """The key a dispatch gives its account: the dispatch time, kept strictly after every earlier
    dispatch from the queue and every key in the rotation (so the account goes to the back even
    when clocks of two processes disagree by a little, or no time was given)."""
    floor = max(clock_us, highest_key if highest_key is not None else clock_us) + 1
    return floor if at_us is None else max(at_us, floor)


def place_in_turns(rank: int, account: str, lines: Iterable[tuple[str, int]]) -> int:
    """The 1-based place of the `rank`-th (0-based) job of `account`'s line, given every line of
    the queue as (account, length) in rotation order: the jobs of the turns before it (`rank` full
    rounds) plus, in its own round, those of the accounts ahead of it that still have one."""
    place, ahead = 1, True
    for other, length in lines:
        if other == account:
            ahead = False
        place += min(length, rank + 1 if ahead else rank)
    return place


def merge_turns(lines: Iterable[Sequence[T]]) -> list[T]:
    """Lines in rotation order, merged into dispatch order: one from each line per round."""
    iterators: list[Iterator[T]] = [iter(line) for line in lines]
    merged: list[T] = []
    while iterators:
        alive = []
        for iterator in iterators:
            item = next(iterator, None)
            if item is not None:
                merged.append(item)
                alive.append(iterator)
        iterators = alive
    return merged


class Candidate(NamedTuple):
    """The head of one model's rotation, as pop_for compares them across a worker's models."""

    turn: int
    account: str
    job_key: tuple[int, int, str]
    model_id: str


def best_candidate(candidates: Iterable[Candidate]) -> Candidate | None:
    """Across a worker's models, the head whose account's turn is oldest goes first (ties: account
    id, then the job's own order). Each model's rotation is its own, so no account can use an old
    turn on one model to take jobs of another."""
    return min(candidates, key=lambda c: (c.turn, c.account, c.job_key), default=None)


class Heads(Protocol):
    """What the dispatch decision reads of the queues (any JobQueues): the next job for some models,
    and (to serve a reservation or a move) one job by its id, put back when it cannot go there."""

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None: ...

    def remove(self, job_id: str) -> QueuedJob | None: ...

    def push(self, job: QueuedJob) -> bool: ...


# A copy on this rung or a slower one runs a job at several times full's step (group offload: 3.7x,
# docs/design/memory-ladder.md), so a job sent there misses a budget of a few runs by itself: such a
# copy takes a model's jobs only as overflow, while no faster copy of the model has room.
OVERFLOW_RANK = RUNGS.index(RUNG_GROUP_OFFLOAD)


def rung_rank(rungs: Mapping[str, str], model_id: str) -> int:
    """How slow a worker's copy of `model_id` is, from its rungs by model: 0 for rung full (or not
    known), then down the ladder."""
    rung = rungs.get(model_id)
    return RUNGS.index(rung) if rung in RUNGS else 0


@dataclass(frozen=True)
class WorkerCapacity:
    """What the dispatch decision needs to know of one connected worker: `held`, the jobs counted
    against its depth; `job_ids`, those it holds (a move waits while its job is on the worker it
    leaves); `draining`, it takes no new job."""

    worker_id: str
    models: frozenset[str]
    held: int
    joined: int  # connection order, for a stable tie-break
    # model_id -> the memory rung it runs on there, where known (a tie goes to the faster copy)
    rungs: Mapping[str, str] = field(default_factory=dict, hash=False)
    draining: bool = False
    job_ids: frozenset[str] = frozenset()

    def rank(self, model_id: str) -> int:
        return rung_rank(self.rungs, model_id)


@dataclass(frozen=True)
class Assignment:
    job: QueuedJob
    worker_id: str


@dataclass(frozen=True)
class DispatchPlan:
    """One step of a dispatch: the assignments to claim, in order; the reservations and moves still
    open after it; and `in_turn`: whether its jobs were taken in the queue's order (each dispatch a
    turn of its account, from `at_us` on), not served to a reservation or a move (no turn taken)."""

    assignments: list[Assignment]
    reservations: dict[str, str]
    moves: list[Move]
    in_turn: bool


def plan_dispatch(queues: Heads, workers: Sequence[WorkerCapacity], *, depth: int, reservations: Mapping[str, str],
                  moves: Sequence[Move], at_us: int | None = None) -> DispatchPlan:
    """The next step of a dispatch. Its assignments are claimed before the next call (a claim that
    fails frees its worker's place for the next step); the dispatch ends at a step with none.

    A step serves the first reservation (a waiting job -> the worker asked to give back a job of
    its account for it, plan_preemptions) whose worker has room; else the first move (plan_moves)
    whose job its worker gave back, to the idle worker; else jobs in the queue's order
    (_plan_from_queue), each worker counting the jobs moving to it as held. A reserved or moved job
    goes ahead of the queue's order, one a step, so that each decision sees the claims before it.
    A reservation or a move ends when served, when its job is no longer queued, or when its worker
    left, drains or does not serve the job's model (the queue places the job then)."""
    by_id = {w.worker_id: w for w in workers}
    served, reservations_left = _serve_reservation(queues, by_id, reservations, depth=depth)
    if served is not None:
        return DispatchPlan([served], reservations_left, list(moves), in_turn=False)
    served, moves_left = _serve_move(queues, by_id, moves, depth=depth)
    if served is not None:
        return DispatchPlan([served], reservations_left, moves_left, in_turn=False)
    incoming = Counter(move.to_worker_id for move in moves_left)
    takers = [replace(w, held=w.held + incoming[w.worker_id]) if incoming[w.worker_id] else w
              for w in workers if not w.draining]
    return DispatchPlan(_plan_from_queue(queues, takers, depth=depth, at_us=at_us), reservations_left, moves_left,
                        in_turn=True)


def _serve_reservation(queues: Heads, by_id: Mapping[str, WorkerCapacity], reservations: Mapping[str, str], *,
                       depth: int) -> tuple[Assignment | None, dict[str, str]]:
    """The first reservation whose worker has room, served (its account's turn stays where it was:
    the account swapped one of its own jobs for another), and the reservations still open."""
    left = dict(reservations)
    for job_id, worker_id in reservations.items():
        worker = by_id.get(worker_id)
        if worker is not None and not worker.draining and worker.held >= depth:
            continue  # not given back yet
        del left[job_id]
        if worker is not None and not worker.draining:
            served = _take(queues, job_id, worker)
            if served is not None:
                return served, left
    return None, left


def _serve_move(queues: Heads, by_id: Mapping[str, WorkerCapacity], moves: Sequence[Move], *,
                depth: int) -> tuple[Assignment | None, list[Move]]:
    """The first move whose job its worker gave back, served to the idle worker if that one has room,
    and the moves still open (those whose job is still on the worker it leaves)."""
    kept: list[Move] = []
    for n, move in enumerate(moves):
        source = by_id.get(move.worker_id)
        if source is not None and move.job_id in source.job_ids:
            kept.append(move)  # not given back yet
            continue
        worker = by_id.get(move.to_worker_id)
        if worker is not None and not worker.draining and worker.held < depth:
            served = _take(queues, move.job_id, worker)
            if served is not None:
                return served, kept + list(moves[n + 1:])
    return None, kept


def _take(queues: Heads, job_id: str, worker: WorkerCapacity) -> Assignment | None:
    """The queued job for `worker` out of its queue, or None when it is gone (dispatched elsewhere,
    cancelled or paused meanwhile) or back in it (the worker no longer serves its model)."""
    job = queues.remove(job_id)
    if job is None:
        return None
    if job.model_id not in worker.models:
        queues.push(job)
        return None
    return Assignment(job, worker.worker_id)


def _plan_from_queue(queues: Heads, workers: Sequence[WorkerCapacity], *, depth: int,
                     at_us: int | None) -> list[Assignment]:
    """Take jobs off the queues for workers with room, and say which worker gets each.

    A worker never holds more than `depth` unfinished jobs. Each job goes to the least-loaded
    worker that serves its model; on a tie, to the one whose copy of the model is on the fastest
    memory rung (a job on group offload runs several times as long), then the earliest joined.
    A copy on group offload is overflow: it serves its model only while no faster copy of that
    model (among `workers`) has room. Among the jobs a worker can take it gets the next in
    fair-share order. `at_us`: the dispatch time, each later pop one microsecond on.
    """
    held = {w.worker_id: w.held for w in workers}
    fastest: dict[str, int] = {}
    for w in workers:
        for model_id in w.models:
            fastest[model_id] = min(fastest.get(model_id, len(RUNGS)), w.rank(model_id))

    def overflow(w: WorkerCapacity, model_id: str) -> bool:
        """`w`'s copy of the model is on group offload (or slower) while another is faster."""
        return w.rank(model_id) >= OVERFLOW_RANK and w.rank(model_id) > fastest[model_id]

    assignments: list[Assignment] = []
    while True:
        candidates = sorted((w for w in workers if held[w.worker_id] < depth),
                            key=lambda w: (held[w.worker_id], w.joined))
        roomy = {m for w in candidates for m in w.models if not overflow(w, m)}  # a fast copy has room
        serves = {w.worker_id: frozenset(m for m in w.models if m not in roomy or not overflow(w, m))
                  for w in candidates}
        for worker in candidates:
            job = queues.pop_for(serves[worker.worker_id], at_us=None if at_us is None else at_us + len(assignments))
            if job is not None:
                tied = [w for w in candidates
                        if held[w.worker_id] == held[worker.worker_id] and job.model_id in serves[w.worker_id]]
                chosen = min(tied, key=lambda w: (w.rank(job.model_id), w.joined))
                held[chosen.worker_id] += 1
                assignments.append(Assignment(job, chosen.worker_id))
                break
        else:
            return assignments


class HeldJob(NamedTuple):
    """A job a worker holds, as the priority preemption sees it: its queue key and whether its
    first step has begun."""

    job: QueuedJob
    started: bool


@dataclass(frozen=True)
class Holding:
    """A connected worker that takes new jobs, for the priority preemption: how many jobs count
    against its depth, and those it could be asked to give back (`preemptible`: held by a v2
    worker, not being cancelled or preempted already)."""

    worker_id: str
    models: frozenset[str]
    held: int
    preemptible: tuple[HeldJob, ...]
    joined: int  # connection order, for a stable tie-break
    # model_id -> the memory rung it runs on there, where known (a move never goes to a slower one)
    rungs: Mapping[str, str] = field(default_factory=dict, hash=False)

    def rank(self, model_id: str) -> int:
        return rung_rank(self.rungs, model_id)


class Preemption(NamedTuple):
    """Take `job_id` off `worker_id` to make room there for the waiting `for_job_id`."""

    worker_id: str
    job_id: str
    for_job_id: str


def plan_preemptions(waiting: Iterable[QueuedJob], workers: Sequence[Holding], *, depth: int) -> list[Preemption]:
    """The API's priority preemption (docs/protocol.md, "Priority preemption" under "The job"). A waiting job
    that can go nowhere, because every worker serving its model holds `depth` jobs, takes the place
    of a held job of its own account with a lower priority: the lowest priority first, one not yet
    started before one running, then the one furthest back in the account's line, then the worker
    joined first. Another account's job is never taken: priority orders an account's own jobs and
    never undoes fair share. Waiting jobs are served highest priority first (the account's line
    order), each held job given back for one of them at most."""
    taken: set[str] = set()
    preemptions: list[Preemption] = []
    for job in sorted(waiting, key=lambda waiting_job: waiting_job.key):
        serving = [worker for worker in workers if job.model_id in worker.models]
        if not serving or any(worker.held < depth for worker in serving):
            continue  # nowhere to go, or a worker has room: the dispatch places it
        choices = [(held.job.priority, held.started, -held.job.submitted_us, worker.joined, held.job.job_id,
                    worker.worker_id)
                   for worker in serving for held in worker.preemptible
                   if held.job.account == job.account and held.job.priority < job.priority
                   and held.job.job_id not in taken]
        if choices:
            *_, job_id, worker_id = min(choices)
            taken.add(job_id)
            preemptions.append(Preemption(worker_id, job_id, job.job_id))
    return preemptions


class Move(NamedTuple):
    """Take `job_id` back from `worker_id`, where it waits behind another job, so that it goes to
    `to_worker_id`, which holds nothing and serves its model."""

    worker_id: str
    job_id: str
    to_worker_id: str


def plan_moves(workers: Sequence[Holding]) -> list[Move]:
    """The API's rebalance (docs/protocol.md, "Moving a waiting job" under "The job"): a worker that holds no job
    takes back, for itself, a job that waits on another worker behind that worker's own work: held
    there, not started, while that worker holds another job (one it runs, or, when none has started
    yet, the one it got first, which it runs next). A job dispatched ahead of time (the dispatch
    depth) then never waits for a busy worker while a copy of its model stands idle, whether the
    idle one finished early, connected, or just loaded the model.

    Idle workers take in the order they joined, each one job: the first in line order (highest
    priority, then submitted first) of those it could run on a rung no slower than where it waits
    (a job on group offload runs 3.7x as long: it may do better waiting behind a full copy's job).
    Each job moves once, and a worker gives back jobs only while it keeps one. `workers`: those
    taking new work, each `preemptible` in the order the worker got them."""
    idle = sorted((w for w in workers if w.held == 0), key=lambda w: w.joined)
    if not idle:
        return []
    waiting: dict[str, list[HeldJob]] = {}
    left = {w.worker_id: w.held for w in workers}
    by_id = {w.worker_id: w for w in workers}
    for worker in workers:
        if worker.held < 2:
            continue
        first = worker.preemptible[:1] if worker.held == len(worker.preemptible) and not any(
            h.started for h in worker.preemptible) else ()
        waiting[worker.worker_id] = [h for h in worker.preemptible if not h.started and h not in first]
    moves: list[Move] = []
    for thief in idle:
        choices = [(h.job.key, worker_id, h) for worker_id, jobs in waiting.items() for h in jobs
                   if h.job.model_id in thief.models and left[worker_id] >= 2
                   and thief.rank(h.job.model_id) <= by_id[worker_id].rank(h.job.model_id)]
        if not choices:
            continue
        _, worker_id, taken = min(choices)
        waiting[worker_id].remove(taken)
        left[worker_id] -= 1
        moves.append(Move(worker_id, taken.job.job_id, thief.worker_id))
    return moves


def retry_decision(*, attempts: int) -> str:
    """What happens to a job whose worker died: 'requeue' on its first attempt, else 'fail'."""
    return "requeue" if attempts < 2 else "fail"
