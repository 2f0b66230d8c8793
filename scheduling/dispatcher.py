"""The in-process owner of the job queue and of what each connected worker holds (held_jobs.py):
plain data behind one lock, told by the services after their writes commit, applying the pure
policy (plan_dispatch, plan_moves, plan_preemptions). The story: docs/protocol.md, "The job"."""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from potocolom.runtime import Slot, runtime
from scheduling.held_jobs import ConnectedWorker, Connection, Joined, Orphans, on_hello
from scheduling.models import HELD_STATES, Job
from scheduling.policy import (
    Assignment,
    HeldJob,
    Move,
    Preemption,
    QueuedJob,
    Turn,
    plan_dispatch,
    plan_moves,
    plan_preemptions,
)
from scheduling.queue_rows import queued_rows, queues_from_settings, turn_rows
from scheduling.queues import JobQueues
from scheduling.queues.memory import MemoryQueues

log = logging.getLogger(__name__)


class Dispatcher:
    """A lock, the queue, the connected workers' holds and the open reservations and moves; each
    method reads them under the lock, asks the policy, and records the outcome."""

    def __init__(self, *, depth: int, queues: JobQueues | None = None) -> None:
        self.depth = depth
        self.lock = threading.RLock()
        self.queues: JobQueues = queues if queues is not None else MemoryQueues()
        self.loaded = False
        self._workers: dict[str, ConnectedWorker] = {}
        self._orphans: dict[str, Orphans] = {}
        self._joined = itertools.count()
        self._turn_clock_us = 0  # the latest turn this process gave
        # A waiting job -> the worker asked to give back one of its account's jobs to make it room:
        # the next dispatch sends it there first (while it is still queued).
        self._reserved: dict[str, str] = {}
        # A job asked back from the worker it waited on (policy.plan_moves) -> its move to an idle
        # worker, which counts it as held until it is dispatched there.
        self._moving: dict[str, Move] = {}
        # Moves on whenever a worker of this process connects, leaves, drains, or gains or loses a
        # model: what the ETA keeps of the fleet is read again after any of these.
        self.fleet_version = 0

    @property
    def shared(self) -> bool:
        """Whether other API processes take jobs from the same queue."""
        return self.queues.shared

    def load(self, *, queued: Callable[[], Iterable[QueuedJob]], held: dict[str, set[str]],
             deadline: datetime, turns: Callable[[], Iterable[Turn]] | None = None) -> None:
        """Rebuild from the database: queued jobs (`queued()` reads them) and the accounts' turns
        (`turns()`), and jobs held by workers not yet reconnected, who have until `deadline` to
        come back."""
        with self.lock:
            self.queues.rebuild_from(queued, turns)
            self._orphans = {worker_id: Orphans(set(jobs), deadline) for worker_id, jobs in held.items() if jobs}
            self.loaded = True

    # workers

    def connect(self, *, worker_id: str, channel_name: str, models: Iterable[str],
                held: Iterable[str] = (), protocol: int = 1, listed: Iterable[str] | None = None,
                rungs: Mapping[str, str] | None = None) -> Joined:
        """Register a worker's connection. The API gives it the jobs it held before (a reconnect,
        this process's restart, or `held`: what the database says it holds, e.g. after the API
        process it was connected to died). A v1 hello (`listed` None) keeps them all, and is told
        of the jobs cancelled while it was away. A v2 hello keeps those it lists; the others are
        `lost`, and a listed job the API does not give it gets `cancel` (it counts against the
        worker's depth until the worker lets it go)."""
        with self.lock:
            self.fleet_version += 1
            joined, holds = on_hello(self._workers.pop(worker_id, None), self._orphans.pop(worker_id, None),
                                     channel_name=channel_name, held=held, listed=listed)
            self._workers[worker_id] = ConnectedWorker(worker_id, channel_name, frozenset(models), next(self._joined),
                                                       protocol, rungs=dict(rungs or {}), holds=holds)
            return joined

    def describe(self, worker_id: str, jobs: Iterable[HeldJob]) -> None:
        """What the database says of the jobs a worker holds (its hello): their keys, and which
        have begun, for the priority preemption."""
        with self.lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return
            for held in jobs:
                if held.job.job_id in worker.holds:
                    worker.know(held.job, started=held.started)

    def disconnect(self, *, worker_id: str, channel_name: str) -> set[str] | None:
        """Forget a connection; the jobs it held (to send back), or None when a newer connection of
        the same worker has taken over."""
        with self.lock:
            self.fleet_version += 1
            worker = self._connected(worker_id, channel_name)
            if worker is None:
                return None
            del self._workers[worker_id]
            self._reserved = {job: at for job, at in self._reserved.items() if at != worker_id}
            self._moving = {job: move for job, move in self._moving.items()
                            if worker_id not in (move.worker_id, move.to_worker_id)}
            return set(worker.holds)

    def drain(self, *, worker_id: str, channel_name: str) -> bool:
        """The worker said `draining` on this connection: no new job goes to it (it gives back what
        it holds as job_preempted). False when that connection is no longer the worker's."""
        with self.lock:
            self.fleet_version += 1
            worker = self._connected(worker_id, channel_name)
            if worker is not None:
                worker.draining = True
            return worker is not None

    def serve(self, *, worker_id: str, channel_name: str, model_id: str, rung: str | None = None) -> bool:
        """The worker loaded `model_id` (placement), on `rung` when said: its jobs may go there from
        now on. False when that connection is no longer the worker's."""
        with self.lock:
            self.fleet_version += 1
            worker = self._connected(worker_id, channel_name)
            if worker is None:
                return False
            worker.models = worker.models | {model_id}
            if rung:
                worker.rungs[model_id] = rung
            return True

    def rung_changed(self, *, worker_id: str, channel_name: str, model_id: str, rung: str) -> None:
        """The worker moved `model_id` to another memory rung (an out-of-memory demotion)."""
        with self.lock:
            worker = self._connected(worker_id, channel_name)
            if worker is not None:
                worker.rungs[model_id] = rung

    def withdraw(self, *, worker_id: str, channel_name: str, model_id: str) -> bool:
        """Before an unload: the worker takes no new job of `model_id`. False (and nothing changes)
        when it holds a job of it, or that connection is no longer the worker's."""
        with self.lock:
            self.fleet_version += 1
            worker = self._connected(worker_id, channel_name)
            if worker is None or not worker.can_unload(model_id):
                return False
            worker.models = worker.models - {model_id}
            return True

    def _connected(self, worker_id: str, channel_name: str) -> ConnectedWorker | None:
        """Under the lock: the worker, when this connection is still its own."""
        worker = self._workers.get(worker_id)
        return worker if worker is not None and worker.channel_name == channel_name else None

    def expired_orphans(self, *, now: datetime) -> dict[str, set[str]]:
        """Take the held jobs of workers that did not come back in time."""
        with self.lock:
            gone = {w: o.held for w, o in self._orphans.items() if o.deadline <= now}
            for worker_id in gone:
                del self._orphans[worker_id]
            return gone

    def orphan_ids(self) -> set[str]:
        with self.lock:
            return set(self._orphans)

    def knows(self, worker_id: str) -> bool:
        """Whether the worker is connected here, or is one this process waits for since it started."""
        with self.lock:
            return worker_id in self._workers or worker_id in self._orphans

    def connected_ids(self) -> set[str]:
        with self.lock:
            return set(self._workers)

    def connection(self, worker_id: str) -> Connection | None:
        """The worker's connection here (its channel, protocol and whether it drains), if any."""
        with self.lock:
            worker = self._workers.get(worker_id)
            return worker.connection() if worker else None

    def channel_of(self, worker_id: str | None) -> str | None:
        with self.lock:
            worker = self._workers.get(worker_id or "")
            return worker.channel_name if worker else None

    def holder_of(self, job_id: str) -> Connection | None:
        """Who among this process's connected workers holds the job, with the protocol it speaks
        (a pause preempts on a v2 worker, cancels on a v1 one); None when none does, or the one
        holding it is letting it go."""
        with self.lock:
            return next((w.connection() for w in self._workers.values() if w.keeps(job_id)), None)

    def key_of(self, job_id: str, *, worker_id: str) -> QueuedJob | None:
        """The queue key of a job the worker holds, when known here (no database read per step)."""
        with self.lock:
            worker = self._workers.get(worker_id)
            hold = worker.holds.get(job_id) if worker is not None else None
            return hold.key if hold is not None else None

    def held(self) -> dict[str, list[str]]:
        """The jobs each connected worker holds (operators)."""
        with self.lock:
            return {w.worker_id: sorted(w.holds) for w in self._workers.values()}

    # jobs

    def _queue_lock(self) -> Any:
        """The lock around a single queue operation: this process's, for its own in-memory queue;
        none for a shared one, whose every operation is atomic in Redis (other processes change it
        meanwhile anyway), so that a position or a push does not wait on a dispatch's claims."""
        return contextlib.nullcontext() if self.queues.shared else self.lock

    def push(self, job: QueuedJob) -> None:
        with self._queue_lock():
            self.queues.push(job)

    def remove(self, job_id: str) -> bool:
        with self._queue_lock():
            return self.queues.remove(job_id) is not None

    def release(self, job_id: str, *, worker_id: str | None = None, until_let_go: bool = False) -> str | None:
        """A held job ended or left its worker (only `worker_id`, when given); the worker that held
        it, or None. With `until_let_go` (a cancel), a v2 worker keeps it counted against its depth
        until its job_failed or job_result for it comes (a release naming that worker); a v1
        worker's place frees at once. A job taken from a worker that has not reconnected since this
        process started is remembered, so that worker is told to cancel it when it comes back."""
        with self.lock:
            for worker in self._workers.values():
                hold = worker.holds.get(job_id)
                if hold is None or worker_id not in (None, worker.worker_id):
                    continue
                if hold.letting_go and worker_id is None:
                    continue  # cancelled already: only that worker's answer frees it
                if until_let_go and worker.protocol >= 2:
                    hold.letting_go = True
                else:
                    del worker.holds[job_id]
                return worker.worker_id
            for orphan_id, orphans in self._orphans.items():
                if job_id in orphans.held and worker_id in (None, orphan_id):
                    orphans.held.discard(job_id)
                    orphans.cancelled.add(job_id)
                    return orphan_id
            return None

    def let_go(self, job_id: str, *, worker_id: str) -> bool:
        """A v2 worker answered for a job it was told to cancel: its place frees. True when it was
        letting go of it (its answer is about that cancelled run, not for the database)."""
        with self.lock:
            worker = self._workers.get(worker_id)
            hold = worker.holds.get(job_id) if worker is not None else None
            if worker is None or hold is None or not hold.letting_go:
                return False
            del worker.holds[job_id]
            return True

    def started(self, job_id: str, *, worker_id: str) -> None:
        """The worker began the job's first step."""
        with self.lock:
            worker = self._workers.get(worker_id)
            hold = worker.holds.get(job_id) if worker is not None else None
            if hold is not None:
                hold.started = True

    def plan(self, claim: Callable[[Assignment], bool], *, at_us: int | None = None) -> list[Assignment]:
        """Dispatch (policy.plan_dispatch, step by step) and hold each assignment that `claim`
        confirms (the database compare-and-set; one that fails was cancelled meanwhile: dropped).
        `at_us`: the time of the dispatch, which becomes the turn of each account served (each
        dispatch of this process a microsecond after the one before, whatever the clock says)."""
        with self.lock:
            done: list[Assignment] = []
            while True:
                start = None if at_us is None else max(at_us, self._turn_clock_us + 1)
                step = plan_dispatch(self.queues, [w.capacity() for w in self._workers.values()], depth=self.depth,
                                     reservations=self._reserved, moves=list(self._moving.values()), at_us=start)
                self._reserved = step.reservations
                self._moving = {move.job_id: move for move in step.moves}
                if step.in_turn and start is not None:
                    self._turn_clock_us = start + len(step.assignments)
                if not step.assignments:
                    return done
                for assignment in step.assignments:
                    if claim(assignment):
                        self._workers[assignment.worker_id].know(assignment.job)
                        done.append(assignment)

    def moves(self) -> list[tuple[Move, str]]:
        """The rebalance (policy.plan_moves) on this process's workers, recorded: each job to take
        back leaves the candidates, and its idle worker counts it as held until it is dispatched
        there. Each move with the channel to send `preempt` to."""
        with self.lock:
            incoming = Counter(move.to_worker_id for move in self._moving.values())
            taking = [w for w in self._workers.values() if not w.draining]
            if not any(len(w.holds) + incoming[w.worker_id] == 0 for w in taking):
                return []  # the common case on the submit path: no worker is idle
            out = []
            for move in plan_moves([w.holding(incoming[w.worker_id]) for w in taking]):
                source = self._workers[move.worker_id]
                source.holds[move.job_id].preempting = True
                self._moving[move.job_id] = move
                out.append((move, source.channel_name))
            return out

    def is_moving(self, job_id: str) -> bool:
        """Whether the job was asked back to move to an idle worker (the preemption's reason)."""
        with self.lock:
            return job_id in self._moving

    def preemptions_for(self, waiting: Iterable[QueuedJob]) -> list[Preemption]:
        """The priority preemptions (policy.plan_preemptions) that would make room for these
        waiting jobs on this process's workers; nothing is changed until `preempting` records them."""
        with self.lock:
            waiting = [job for job in waiting if job.job_id not in self._reserved]
            if not waiting:
                return []
            workers = [w.holding() for w in self._workers.values() if not w.draining]
            return plan_preemptions(waiting, workers, depth=self.depth)

    def preempting(self, preemption: Preemption) -> str | None:
        """Record a priority preemption about to be sent: the job leaves no more candidates, and its
        worker's room goes to `for_job_id`. The worker's channel, or None when it changed meanwhile
        (it no longer holds the job, or was asked already)."""
        with self.lock:
            worker = self._workers.get(preemption.worker_id)
            hold = worker.holds.get(preemption.job_id) if worker is not None else None
            if worker is None or hold is None or hold.leaving or preemption.for_job_id in self._reserved:
                return None
            hold.preempting = True
            self._reserved[preemption.for_job_id] = preemption.worker_id
            return worker.channel_name

    def asked_to_preempt(self, job_id: str) -> None:
        """A pause sent `preempt` for a held job: it is no candidate for the priority preemption."""
        with self.lock:
            for worker in self._workers.values():
                if job_id in worker.holds:
                    worker.holds[job_id].preempting = True

    def position(self, job_id: str) -> int | None:
        with self._queue_lock():
            return self.queues.position(job_id)

    def positions(self, job_ids: Iterable[str]) -> dict[str, int]:
        """The positions of the queued ones among these jobs, read at once."""
        ids = list(job_ids)
        if not ids:
            return {}
        with self._queue_lock():
            return self.queues.positions(ids)

    def demand(self) -> dict[str, tuple[int, int]]:
        """Queued jobs per model and their steps summed, as the queue counts them."""
        with self._queue_lock():
            return self.queues.demand()


# --- this process's dispatcher -------------------------------------------------------------------


def _make_dispatcher() -> Dispatcher:
    return Dispatcher(depth=settings.JOB_DISPATCH_DEPTH, queues=queues_from_settings())


def _rebuild_in_background(current: Dispatcher) -> None:
    """At the process's start (QUEUE_REBUILD_AT_START): load the queue while Daphne starts listening."""
    if settings.QUEUE_REBUILD_AT_START:
        threading.Thread(target=_rebuild_at_start, name="queue-rebuild", daemon=True).start()


def _rebuild_at_start() -> None:
    try:
        dispatcher()
    except Exception:  # the first request retries the load and reports the error there
        log.exception("could not rebuild the job queue at start")
    finally:
        connection.close()


DISPATCHER = Slot("scheduling.dispatcher", make=_make_dispatcher, start=_rebuild_in_background)


def dispatcher() -> Dispatcher:
    """This process's dispatcher, rebuilt from the database the first time it is needed."""
    current = runtime.get(DISPATCHER)
    if not current.loaded:
        with current.lock:
            if not current.loaded:
                _load(current, now=timezone.now())
    return current


def _load(current: Dispatcher, *, now: datetime) -> None:
    started = time.perf_counter()
    held: dict[str, set[str]] = {}
    for job_id, worker_id in Job.objects.filter(state__in=HELD_STATES).values_list("id", "worker_id"):
        held.setdefault(worker_id or "", set()).add(str(job_id))
    # A worker that held jobs gets the contract's dead-worker window to reconnect.
    current.load(queued=queued_rows, turns=turn_rows, held=held,
                 deadline=now + timedelta(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS))
    log.info("rebuilt the job queue from the database: %d queued, %d held, in %.0f ms", len(current.queues),
             sum(len(jobs) for jobs in held.values()), (time.perf_counter() - started) * 1000)
