"""The in-process owner of the job queue and of what each connected worker holds: plain data behind
one lock, told by the services after their writes commit, applying the pure `plan_dispatch`. One
lives in each API process (`dispatcher()`), rebuilt from the database on first use."""
from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Max
from django.utils import timezone

from potocolom.runtime import Slot, runtime
from scheduling.models import HELD_STATES, Job, JobState
from scheduling.policy import (
    Assignment,
    HeldJob,
    Holding,
    Move,
    Preemption,
    QueuedJob,
    Turn,
    WorkerCapacity,
    plan_dispatch,
    plan_moves,
    plan_preemptions,
)
from scheduling.queues import JobQueues
from scheduling.queues.memory import MemoryQueues
from scheduling.queues.redis import RecoveringQueues, RedisQueues, redis_client_from_url

log = logging.getLogger(__name__)


@dataclass
class ConnectedWorker:
    worker_id: str
    channel_name: str
    models: frozenset[str]
    joined: int
    held: set[str] = field(default_factory=set)  # every job counted against its depth
    protocol: int = 1  # its hello's: a v2 worker answers `cancel` with job_failed
    # Of `held`, the jobs it was told to cancel (v2): they count until the worker lets them go.
    letting_go: set[str] = field(default_factory=set)
    draining: bool = False  # it said `draining` on this connection: it gets no new job
    # What the priority preemption knows of its held jobs: their keys (those it was given here, or
    # read back on its hello), which have begun, and which it was asked to give back (`preempt`).
    keys: dict[str, QueuedJob] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    preempting: set[str] = field(default_factory=set)
    rungs: dict[str, str] = field(default_factory=dict)  # model_id -> its memory rung there (moves)

    def forget(self, job_id: str) -> None:
        """It no longer holds the job."""
        self.held.discard(job_id)
        self.letting_go.discard(job_id)
        self.keys.pop(job_id, None)
        self.started.discard(job_id)
        self.preempting.discard(job_id)

    def holding(self, incoming: int = 0) -> Holding:
        """What the preemptions read of it: a v2 worker's held jobs, less those leaving, in the
        order it got them; `incoming`: jobs moving to it, counted as held."""
        leaving = self.letting_go | self.preempting
        preemptible = tuple(HeldJob(key, job_id in self.started) for job_id, key in self.keys.items()
                            if job_id in self.held and job_id not in leaving) if self.protocol >= 2 else ()
        return Holding(self.worker_id, self.models, len(self.held) + incoming, preemptible, self.joined,
                       dict(self.rungs))


@dataclass(frozen=True)
class Joined:
    """What a worker's hello changed here: the channel of an older connection it replaced, the jobs
    to send `cancel` for, and (v2) the jobs the API gave it that its hello does not list (dead-worker
    rule at once)."""

    replaced: str | None
    cancel: set[str]
    lost: set[str]


@dataclass(frozen=True)
class Holder:
    """A connected worker of this process that holds a job (and was not told to cancel it)."""

    worker_id: str
    channel_name: str
    protocol: int


@dataclass
class Orphans:
    """Jobs that a worker held when this API process started; it has until `deadline` to say hello."""

    held: set[str]
    deadline: datetime
    cancelled: set[str] = field(default_factory=set)  # to tell the worker when it comes back


class Dispatcher:
    def __init__(self, *, depth: int, queues: JobQueues | None = None) -> None:
        self.depth = depth
        self.lock = threading.RLock()
        self.queues: JobQueues = queues if queues is not None else MemoryQueues()
        self.workers: dict[str, ConnectedWorker] = {}
        self.orphans: dict[str, Orphans] = {}
        self.loaded = False
        self._joined = itertools.count()
        self._turn_clock_us = 0  # the latest turn this process gave
        # A waiting job -> the worker asked to give back one of its account's jobs to make it room:
        # the next dispatch sends it there first (while it is still queued).
        self.reserved: dict[str, str] = {}
        # A job asked back from the worker it waited on (policy.plan_moves) -> (that worker, the idle
        # worker it goes to once back in the queue, which counts it as held meanwhile).
        self.moving: dict[str, tuple[str, str]] = {}

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
            self.orphans = {worker_id: Orphans(set(jobs), deadline) for worker_id, jobs in held.items() if jobs}
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
            previous = self.workers.pop(worker_id, None)
            given = set(held) | ((previous.held - previous.letting_go) if previous else set())
            orphans = self.orphans.pop(worker_id, None)
            if orphans:
                given |= orphans.held
            replaced = previous.channel_name if previous and previous.channel_name != channel_name else None
            if listed is None:
                joined = Joined(replaced, orphans.cancelled if orphans else set(), set())
                letting_go = previous.letting_go if previous else set()
                kept = given | letting_go
            else:
                listed = set(listed)
                joined = Joined(replaced, listed - given, given - listed)
                letting_go, kept = joined.cancel, (given & listed) | joined.cancel
            worker = ConnectedWorker(worker_id, channel_name, frozenset(models), next(self._joined), kept, protocol,
                                     set(letting_go))
            worker.rungs = dict(rungs or {})
            if previous is not None:  # what it knew of the jobs it still holds
                worker.keys = {job_id: key for job_id, key in previous.keys.items() if job_id in kept}
                worker.started = previous.started & kept
            self.workers[worker_id] = worker
            return joined

    def disconnect(self, *, worker_id: str, channel_name: str) -> set[str] | None:
        """Forget a connection; the jobs it held (to send back), or None when a newer connection of
        the same worker has taken over."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return None
            del self.workers[worker_id]
            self.reserved = {job: at for job, at in self.reserved.items() if at != worker_id}
            self.moving = {job: ends for job, ends in self.moving.items() if worker_id not in ends}
            return worker.held

    def drain(self, *, worker_id: str, channel_name: str) -> bool:
        """The worker said `draining` on this connection: no new job goes to it (it gives back what
        it holds as job_preempted). False when that connection is no longer the worker's."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return False
            worker.draining = True
            return True

    def serve(self, *, worker_id: str, channel_name: str, model_id: str, rung: str | None = None) -> bool:
        """The worker loaded `model_id` (placement), on `rung` when said: its jobs may go there from
        now on. False when that connection is no longer the worker's."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return False
            worker.models = worker.models | {model_id}
            if rung:
                worker.rungs[model_id] = rung
            return True

    def rung_changed(self, *, worker_id: str, channel_name: str, model_id: str, rung: str) -> None:
        """The worker moved `model_id` to another memory rung (an out-of-memory demotion)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is not None and worker.channel_name == channel_name:
                worker.rungs[model_id] = rung

    def withdraw(self, *, worker_id: str, channel_name: str, model_id: str) -> bool:
        """Before an unload: the worker takes no new job of `model_id`. False (and nothing changes)
        when it holds a job of it, or that connection is no longer the worker's."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or worker.channel_name != channel_name:
                return False
            if any(key.model_id == model_id for job_id, key in worker.keys.items() if job_id in worker.held):
                return False
            if len(worker.keys.keys() & worker.held) < len(worker.held):
                return False  # a held job it cannot name the model of: keep the model, to be safe
            worker.models = worker.models - {model_id}
            return True

    def expired_orphans(self, *, now: datetime) -> dict[str, set[str]]:
        """Take the held jobs of workers that did not come back in time."""
        with self.lock:
            gone = {w: o.held for w, o in self.orphans.items() if o.deadline <= now}
            for worker_id in gone:
                del self.orphans[worker_id]
            return gone

    def orphan_ids(self) -> set[str]:
        with self.lock:
            return set(self.orphans)

    def knows(self, worker_id: str) -> bool:
        """Whether the worker is connected here, or is one this process waits for since it started."""
        with self.lock:
            return worker_id in self.workers or worker_id in self.orphans

    def connected_ids(self) -> set[str]:
        with self.lock:
            return set(self.workers)

    def channel_of(self, worker_id: str | None) -> str | None:
        with self.lock:
            worker = self.workers.get(worker_id or "")
            return worker.channel_name if worker else None

    def holder_of(self, job_id: str) -> Holder | None:
        """Who among this process's connected workers holds the job, with the protocol it speaks
        (a pause preempts on a v2 worker, cancels on a v1 one); None when none does, or the one
        holding it is letting it go."""
        with self.lock:
            for worker in self.workers.values():
                if job_id in worker.held and job_id not in worker.letting_go:
                    return Holder(worker.worker_id, worker.channel_name, worker.protocol)
            return None

    def held(self) -> dict[str, list[str]]:
        """The jobs each connected worker holds (operators)."""
        with self.lock:
            return {w.worker_id: sorted(w.held) for w in self.workers.values()}

    # jobs

    def push(self, job: QueuedJob) -> None:
        with self.lock:
            self.queues.push(job)

    def remove(self, job_id: str) -> bool:
        with self.lock:
            return self.queues.remove(job_id) is not None

    def release(self, job_id: str, *, worker_id: str | None = None, until_let_go: bool = False) -> str | None:
        """A held job ended or left its worker (only `worker_id`, when given); the worker that held
        it, or None. With `until_let_go` (a cancel), a v2 worker keeps it counted against its depth
        until its job_failed or job_result for it comes (a release naming that worker); a v1
        worker's place frees at once. A job taken from a worker that has not reconnected since this
        process started is remembered, so that worker is told to cancel it when it comes back."""
        with self.lock:
            for worker in self.workers.values():
                if job_id in worker.held and worker_id in (None, worker.worker_id):
                    if job_id in worker.letting_go and worker_id is None:
                        continue  # cancelled already: only that worker's answer frees it
                    if until_let_go and worker.protocol >= 2:
                        worker.letting_go.add(job_id)
                    else:
                        worker.forget(job_id)
                    return worker.worker_id
            for orphan_id, orphans in self.orphans.items():
                if job_id in orphans.held and worker_id in (None, orphan_id):
                    orphans.held.discard(job_id)
                    orphans.cancelled.add(job_id)
                    return orphan_id
            return None

    def let_go(self, job_id: str, *, worker_id: str) -> bool:
        """A v2 worker answered for a job it was told to cancel: its place frees. True when it was
        letting go of it (its answer is about that cancelled run, not for the database)."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or job_id not in worker.letting_go:
                return False
            worker.forget(job_id)
            return True

    def plan(self, claim: Callable[[Assignment], bool], *, at_us: int | None = None) -> list[Assignment]:
        """Decide dispatches and apply those that `claim` confirms (the database compare-and-set).
        `at_us`: the time of the dispatch, which becomes the turn of each account served (each
        dispatch of this process a microsecond after the one before, whatever the clock says).

        A job whose claim fails (cancelled meanwhile) is dropped from the plan and planning goes on.
        """
        with self.lock:
            done = self._serve_reserved(claim) + self._serve_moved(claim)
            while True:
                incoming = self._incoming()
                capacities = [WorkerCapacity(w.worker_id, w.models, len(w.held) + incoming[w.worker_id], w.joined,
                                             w.rungs)
                              for w in self.workers.values() if not w.draining]
                start = None if at_us is None else max(at_us, self._turn_clock_us + 1)
                planned = plan_dispatch(self.queues, capacities, depth=self.depth, at_us=start)
                if start is not None:
                    self._turn_clock_us = start + len(planned)
                if not planned:
                    return done
                for assignment in planned:
                    if claim(assignment):
                        self._hold(assignment)
                        done.append(assignment)

    def _hold(self, assignment: Assignment) -> None:
        worker = self.workers[assignment.worker_id]
        worker.held.add(assignment.job.job_id)
        worker.keys[assignment.job.job_id] = assignment.job

    def _serve_reserved(self, claim: Callable[[Assignment], bool]) -> list[Assignment]:
        """Under the lock: each waiting job for which a worker was asked to give a job back goes to
        that worker once it has room, ahead of the queue's order (its account's turn stays where it
        was: the account swapped one of its own jobs for another). A reservation ends when it is
        served, or its job is no longer queued, or its worker left or drains."""
        done: list[Assignment] = []
        for job_id, worker_id in list(self.reserved.items()):
            worker = self.workers.get(worker_id)
            if worker is not None and not worker.draining and len(worker.held) >= self.depth:
                continue  # not yet given back
            del self.reserved[job_id]
            if worker is None or worker.draining:
                continue
            job = self.queues.remove(job_id)
            if job is None:
                continue  # dispatched elsewhere, cancelled or paused meanwhile
            if job.model_id not in worker.models:  # it came back serving other models: the queue decides
                self.queues.push(job)
                continue
            assignment = Assignment(job, worker_id)
            if claim(assignment):
                self._hold(assignment)
                done.append(assignment)
        return done

    def _incoming(self) -> dict[str, int]:
        """Under the lock: per connected worker, the jobs moving to it."""
        counts = dict.fromkeys(self.workers, 0)
        for _, to_worker in self.moving.values():
            if to_worker in counts:
                counts[to_worker] += 1
        return counts

    def _serve_moved(self, claim: Callable[[Assignment], bool]) -> list[Assignment]:
        """Under the lock: each moving job back in the queue goes to the idle worker it was asked
        back for, if that worker still serves its model and has room (else the queue decides); a
        move ends when served, or when its job is neither queued nor still on the worker it left
        (it ended there, or was cancelled or paused)."""
        done: list[Assignment] = []
        for job_id, (from_worker, to_worker) in list(self.moving.items()):
            source = self.workers.get(from_worker)
            if source is not None and job_id in source.held:
                continue  # not given back yet
            del self.moving[job_id]
            worker = self.workers.get(to_worker)
            if worker is None or worker.draining or len(worker.held) >= self.depth:
                continue
            job = self.queues.remove(job_id)
            if job is None:
                continue
            if job.model_id not in worker.models:  # it no longer serves the model: the queue decides
                self.queues.push(job)
                continue
            assignment = Assignment(job, to_worker)
            if claim(assignment):  # a failed claim: no longer queued (cancelled meanwhile), dropped as plan() does
                self._hold(assignment)
                done.append(assignment)
        return done

    def moves(self) -> list[tuple[Move, str]]:
        """The rebalance (policy.plan_moves) on this process's workers, recorded: each job to take
        back leaves the candidates, and its idle worker counts it as held until it is dispatched
        there. Each move with the channel to send `preempt` to."""
        with self.lock:
            incoming = self._incoming()
            if not any(len(w.held) + incoming[w.worker_id] == 0 for w in self.workers.values() if not w.draining):
                return []  # the common case on the submit path: no worker is idle
            workers = [w.holding(incoming[w.worker_id]) for w in self.workers.values() if not w.draining]
            out = []
            for move in plan_moves(workers):
                source = self.workers[move.worker_id]
                source.preempting.add(move.job_id)
                self.moving[move.job_id] = (move.worker_id, move.to_worker_id)
                out.append((move, source.channel_name))
            return out

    def is_moving(self, job_id: str) -> bool:
        """Whether the job was asked back to move to an idle worker (the preemption's reason)."""
        with self.lock:
            return job_id in self.moving

    def preemptions_for(self, waiting: Iterable[QueuedJob]) -> list[Preemption]:
        """The priority preemptions (policy.plan_preemptions) that would make room for these
        waiting jobs on this process's workers; nothing is changed until `preempting` records them."""
        with self.lock:
            waiting = [job for job in waiting if job.job_id not in self.reserved]
            if not waiting:
                return []
            workers = [w.holding() for w in self.workers.values() if not w.draining]
            return plan_preemptions(waiting, workers, depth=self.depth)

    def preempting(self, preemption: Preemption) -> str | None:
        """Record a priority preemption about to be sent: the job leaves no more candidates, and its
        worker's room goes to `for_job_id`. The worker's channel, or None when it changed meanwhile
        (it no longer holds the job, or was asked already)."""
        with self.lock:
            worker = self.workers.get(preemption.worker_id)
            if (worker is None or preemption.job_id not in worker.held or preemption.job_id in worker.letting_go
                    or preemption.job_id in worker.preempting or preemption.for_job_id in self.reserved):
                return None
            worker.preempting.add(preemption.job_id)
            self.reserved[preemption.for_job_id] = preemption.worker_id
            return worker.channel_name

    def asked_to_preempt(self, job_id: str) -> None:
        """A pause sent `preempt` for a held job: it is no candidate for the priority preemption."""
        with self.lock:
            for worker in self.workers.values():
                if job_id in worker.held:
                    worker.preempting.add(job_id)

    def describe(self, worker_id: str, jobs: Iterable[HeldJob]) -> None:
        """What the database says of the jobs a worker holds (its hello): their keys, and which
        have begun, for the priority preemption."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None:
                return
            for held in jobs:
                if held.job.job_id in worker.held:
                    worker.keys[held.job.job_id] = held.job
                    if held.started:
                        worker.started.add(held.job.job_id)

    def started(self, job_id: str, *, worker_id: str) -> None:
        """The worker began the job's first step."""
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is not None and job_id in worker.held:
                worker.started.add(job_id)

    def position(self, job_id: str) -> int | None:
        with self.lock:
            return self.queues.position(job_id)


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


def queued_rows() -> list[QueuedJob]:
    """Every queued job's queue key, read in one query (the start-up cost of an API process)."""
    if connection.vendor == "postgresql":  # skip building UUID objects only to turn them back into text
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id::text, model_id, priority, submitted_us, account_id::text "
                           f"FROM {Job._meta.db_table} WHERE state = %s", [JobState.QUEUED.value])
            return [QueuedJob(*row) for row in cursor.fetchall()]
    rows = Job.objects.filter(state=JobState.QUEUED).values_list("id", "model_id", "priority", "submitted_us",
                                                                 "account_id")
    return [QueuedJob(str(job_id), model_id, priority, us, str(account)) for job_id, model_id, priority, us, account
            in rows]


def turn_rows() -> list[Turn]:
    """Each account's last turn per model (the latest `turn_us` of its jobs there): one grouped
    query over the index on (account, model_id, turn_us)."""
    rows = (Job.objects.filter(turn_us__isnull=False).values("model_id", "account_id")
            .annotate(last=Max("turn_us")).values_list("model_id", "account_id", "last").order_by())
    return [Turn(model_id, str(account), last) for model_id, account, last in rows]


def queues_from_settings() -> JobQueues:
    """The backend JOB_QUEUE names: this process's own (memory), or Redis (the default with
    REDIS_URL), one queue for every API process on the same database. Its keys are named after the
    database, so two deployments (or test databases) on one Redis never share a queue."""
    if settings.JOB_QUEUE != "redis":
        return MemoryQueues()
    database = f"{connection.vendor}:{connection.settings_dict.get('HOST') or ''}:{connection.settings_dict['NAME']}"
    prefix = f"potocolom:{hashlib.sha1(database.encode()).hexdigest()[:12]}:jobs"
    client = redis_client_from_url(settings.REDIS_URL or "", socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT,
                                   socket_timeout=settings.REDIS_READ_TIMEOUT)  # DATABASE_TIMEOUT_SECONDS
    return RecoveringQueues(RedisQueues(client, prefix), queued_rows, turn_rows)
