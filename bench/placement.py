"""Placement across machines, replayed: a bursty trace of jobs and sessions on a fleet of GPU workers
(a discrete-event model: loads, unloads, job steps, session slots), placed by the real planner
(fleet/placement/planner.py) and by three baselines in the same run, on the same traces:

- static: v1, each worker preloads what fits (its own rotation of the model list, each model on
  the highest rung that fits) and never changes;
- lru: load-on-miss with LRU eviction, one copy a model: a job or session for a model no worker
  holds loads it on the least loaded worker that has it installed, evicting that worker's least
  recently used models (never one running a job or session) until it fits;
- modelmesh: the issue's "ModelMesh-style" baseline, as ModelMesh itself does it: lru's load on a
  miss and LRU eviction, plus its copy scaling (class ModelMesh: a second copy for a model in
  regular use, more copies past 90 % busy, scale-down of copies past the second after 10 quiet
  minutes; the constants are kserve/modelmesh's own). One copy a model is not what ModelMesh
  does, and where every model starts loaded somewhere it hardly ever loads (22 loads in four
  4-hour traces at 16 GiB, none at 24 GiB).

Every policy starts from the static placement. The traces (--seeds of them, pooled): models whose
popularity (Zipf) is reshuffled every --phase seconds, spikes (one model at one copy's capacity for
two minutes), and realtime sessions. Per policy: SLO attainment (a job within 3x its standalone
time on rung full, a session live within 10 s) over all seeds and the worst seed's, loads, loads
per hour, GPU busy share; then the goal lines: the planner at >= 99 % attainment with at least
1.5x fewer violations than modelmesh and no more loads than it (and, for information, against lru).
One table per --vram-mib: 16 GiB, where the models' working set does not fit and ModelMesh's
cache thrashes, and 24 GiB, where two copies of most models fit.

The planner is replayed three times: at the defaults (PLACEMENT_TARGET_WAIT_SECONDS 30, the burst
rule on); "tuned", as an operator would set it for this SLO (PLACEMENT_TARGET_WAIT_JOBS 2: a copy
more once queued work per copy passes two of its jobs' own runs, the wait a 3x budget leaves); and
"tuned+ret", also retiring spare copies on slow rungs (retire_slow_copies, beyond the contract's
long-queue rule: for information). The API is modelled as feeding the planner each model's arrivals
(ModelDemand.recent_steps over demand_window_seconds, burst_steps over burst_window_seconds) on
every arrival and every PLACEMENT_SECONDS, and as dispatching jobs the way it does
(scheduling.policy.plan_dispatch: to the worker holding the fewest, up to JOB_DISPATCH_DEPTH, 2,
a worker; --dispatch-depth; a copy on group offload only as overflow), and as moving a job held
behind another to a worker that holds none (scheduling.policy.plan_moves, MOVE_SECONDS later;
--no-moves leaves it waiting there). It prints the trace's offered load against the fleet's
capacity, and counts the late jobs by what they met first (no copy when they came, a queue, a
slower rung: group offload's step is 3.7x full's, so a job there misses a 3x budget by itself).

A load takes --load-fixed-seconds plus the model's full needs at --load-mib-per-second (assumed:
1 s and 1,500 MiB/s; bench/load_unload.py measures a real one on a GPU host and prints the options).

    .venv/bin/python bench/placement.py [--seed 1] [--seeds 4] [--vram-mib 16384,24576] [--workers 8]
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet.placement.planner import (  # noqa: E402
    LOAD,
    UNLOAD,
    InstalledModel,
    LoadedModel,
    ModelDemand,
    PendingLoad,
    PlacementAction,
    PlacementSettings,
    WorkerState,
    plan_placement,
)
from potocolom.protocol.rungs import RUNG_FULL, RUNGS  # noqa: E402
from scheduling.policy import HeldJob, Holding, QueuedJob, WorkerCapacity, plan_dispatch, plan_moves  # noqa: E402

# --- the figures the model runs on ---------------------------------------------------------
# Memory per rung (MiB) and step time on full. SD-1.5 class: the ladder's estimates and the step
# measured on an H200 at 512x512 (docs/design/memory-ladder.md: 2,731 / 1,885 / 1,420 MiB, 0.027 s
# a step, rounded up to 30 ms). SDXL (1024x1024) and SD3-medium classes are not measured here: the
# needs scale SD-1.5's by their weights (SDXL ~6.9 GB fp16, SD3 without T5 ~ 8 GB) and the steps
# sit in the 30-120 ms range such models take on one data-centre GPU.
FAMILIES = {  # family: (needs full, model_offload, group_offload MiB; step ms; default steps; session slots)
    "sd15": ((2_731, 1_885, 1_420), 30.0, 25, 8),  # 8 slots within 500 ms: measured on an H200 (operations.md)
    "sdxl": ((9_800, 5_600, 3_400), 75.0, 30, 2),
    "sd3": ((12_000, 6_500, 4_000), 110.0, 28, 1),
}
MODEL_FAMILIES = ("sd15", "sdxl", "sd15", "sd3", "sdxl", "sd15", "sdxl", "sd3", "sd15", "sdxl", "sdxl", "sd3")
# A load reads safetensors from local NVMe and copies them to the device: ~1 s of fixed cost
# (pipeline construction) plus ~1.5 GB/s, so SD-1.5 takes ~2.8 s and SDXL ~7.5 s. (Re-placing an
# SD-1.5-sized model already in RAM took 0.7 s on the H200: the disk read is the larger part.)
LOAD_FIXED_SECONDS = 1.0
LOAD_MIB_PER_SECOND = 1_500.0
UNLOAD_SECONDS = 0.3
LOAD_FAILURE_RATE = 0.01  # a load fails now and then (a bad file, a transient OOM): exercises the back-off
# A job on a rung: steps x step x factor + fixed. From the H200 table, 10 steps: full 0.32 s,
# model_offload 1.10 s (same step, ~0.8 s moving modules per call), group_offload 1.22 s (3.7x a step).
RUNG_COST = {"full": (1.0, 0.05), "model_offload": (1.0, 0.8), "group_offload": (3.7, 0.1)}
SESSION_SLOWDOWN = 0.15  # each live session's frames take this share of its worker's steps from jobs
SESSION_GPU_SHARE = 0.15  # ... and count as that much GPU busy time
SESSION_MEAN_SECONDS = 120.0
SESSION_GIVE_UP_SECONDS = 60.0  # a browser waiting longer leaves (a violation either way)
JOB_SLO_FACTOR = 3.0
SESSION_SLO_SECONDS = 10.0
WORKER_VRAM_MIB = 16_384
DRAIN_SECONDS = 900.0  # after the trace ends, time for queued work to finish; what is left is a violation
PLACEMENT_SECONDS = 10.0
SPIKE_LOAD = 1.0  # a spike's extra jobs keep one copy on rung full busy all the time (its jobs back to back)
SPIKE_SECONDS = 120.0
# A move (plan_moves): `preempt` to the worker holding the job, its `job_preempted`, the database
# writes and the `job` order to the idle worker: a few round trips on a LAN, rounded up.
MOVE_SECONDS = 0.05


def load_seconds(needs_full_mib: float, fixed_seconds: float = LOAD_FIXED_SECONDS,
                 mib_per_second: float = LOAD_MIB_PER_SECOND) -> float:
    """How long the replay takes a load of a model needing `needs_full_mib` on rung full to take."""
    return fixed_seconds + needs_full_mib / mib_per_second


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    needs_mib: Mapping[str, int] = field(hash=False)
    step_ms: float
    steps: int
    slots: int
    load_fixed_seconds: float = LOAD_FIXED_SECONDS
    load_mib_per_second: float = LOAD_MIB_PER_SECOND

    @property
    def load_seconds(self) -> float:
        return load_seconds(self.needs_mib["full"], self.load_fixed_seconds, self.load_mib_per_second)

    def seconds(self, rung: str) -> float:
        factor, fixed = RUNG_COST[rung]
        return self.steps * self.step_ms / 1000 * factor + fixed


def model_specs(n: int, rungs: Sequence[str] = RUNGS, *, load_fixed_seconds: float = LOAD_FIXED_SECONDS,
                load_mib_per_second: float = LOAD_MIB_PER_SECOND) -> list[ModelSpec]:
    """`n` models cycling through the families, allowed only `rungs` (as a worker's MEMORY_MODE),
    each loading in `load_fixed_seconds` + its full needs / `load_mib_per_second`."""
    out = []
    for i in range(n):
        family = MODEL_FAMILIES[i % len(MODEL_FAMILIES)]
        needs, step_ms, steps, slots = FAMILIES[family]
        allowed = {r: mib for r, mib in zip(RUNGS, needs, strict=True) if r in rungs}
        out.append(ModelSpec(f"{family}-{i:02d}", allowed, step_ms, steps, slots, load_fixed_seconds,
                             load_mib_per_second))
    return out


# --- the baselines, pure --------------------------------------------------------------------

def static_preload(order: Sequence[InstalledModel], vram_mib: int | None) -> list[tuple[str, str]]:
    """v1: the worker loads its installed models in order, each on the highest rung that fits what
    is left, and keeps them (a model that fits on no rung is not served there)."""
    left = float("inf") if vram_mib is None else float(vram_mib)
    placed = []
    for m in order:
        rung = next((r for r in RUNGS if r in m.needs_mib and m.needs_mib[r] <= left), None)
        if rung is not None:
            left -= m.needs_mib[rung]
            placed.append((m.model_id, rung))
    return placed


def lru_on_miss(model_id: str, workers: Sequence[WorkerState], *, session: bool,
                load_of: Mapping[str, int]) -> list[PlacementAction]:
    """ModelMesh-style load on a miss: the least loaded worker (fewest jobs and sessions held, then
    most free memory, then worker_id) that has `model_id` installed and can make room by evicting
    its least recently used models that hold no job or session; rung full when it fits that way
    (a session needs it), else the highest rung that does. No residency, no back-off, one copy."""
    def free(w: WorkerState) -> float:
        if w.free_mib is None:
            return float("inf")
        needs = {m.model_id: m.needs_mib for m in w.installed}
        return w.free_mib - sum(needs[p.model_id][p.rung] for p in w.loading)

    for w in sorted(workers, key=lambda w: (load_of.get(w.worker_id, 0), -free(w), w.worker_id)):
        installed = next((m for m in w.installed if m.model_id == model_id), None)
        if (installed is None or w.draining or model_id in w.unloading
                or any(m.model_id == model_id for m in w.loaded) or any(p.model_id == model_id for p in w.loading)):
            continue  # one copy a worker: not where it is loaded, loading or being unloaded
        spare = sorted((m for m in w.loaded if not m.busy and m.model_id not in w.unloading),
                       key=lambda m: (m.last_used, m.model_id))
        for rung in (RUNG_FULL,) if session else RUNGS:
            if rung not in installed.needs_mib:
                continue
            short, evict = installed.needs_mib[rung] - free(w), []
            for m in spare:
                if short <= 0:
                    break
                evict.append(m)
                short -= m.held_mib
            if short <= 0:
                return [PlacementAction(UNLOAD, w.worker_id, m.model_id, None, "lru: evict") for m in evict] + [
                    PlacementAction(LOAD, w.worker_id, model_id, rung, "lru: miss")]
    return []


# --- the trace ------------------------------------------------------------------------------

@dataclass
class Job:
    model_id: str
    steps: int
    submitted: float
    budget: float  # JOB_SLO_FACTOR x its standalone time on rung full
    finished: float | None = None
    rung: str | None = None  # the rung of the copy it ran on
    copy_on_arrival: bool = True  # a copy was loaded when it came


@dataclass
class Session:
    model_id: str
    joined: float
    seconds: float
    live_at: float | None = None
    gone: bool = False


def trace(rng: random.Random, specs: Sequence[ModelSpec], *, duration: float, job_rate: float, phase: float,
          session_rate: float, spike_every: float) -> list[tuple[float, Job | Session]]:
    """Arrivals: Poisson jobs over a Zipf popularity reshuffled every `phase` s, spikes of one model
    (SPIKE_LOAD x one copy's capacity for SPIKE_SECONDS, one every `spike_every` s on average),
    Poisson sessions."""
    out: list[tuple[float, Job | Session]] = []
    weights: list[float] = []
    t, next_phase = 0.0, 0.0
    while True:
        t += rng.expovariate(job_rate)
        if t >= duration:
            break
        while t >= next_phase:
            ranks = list(range(len(specs)))
            rng.shuffle(ranks)
            weights = [1.0 / (r + 1) ** 1.1 for r in ranks]
            next_phase += phase
        spec = rng.choices(specs, weights)[0]
        out.append((t, Job(spec.model_id, spec.steps, t, JOB_SLO_FACTOR * spec.seconds(RUNG_FULL))))
        if rng.random() < session_rate / job_rate:
            spec = rng.choices(specs, weights)[0]
            out.append((t, Session(spec.model_id, t, rng.expovariate(1 / SESSION_MEAN_SECONDS))))
    t = rng.expovariate(1 / spike_every) if spike_every > 0 else duration
    while t < duration:
        spec = rng.choice(specs)
        rate, s = SPIKE_LOAD / spec.seconds(RUNG_FULL), t
        while (s := s + rng.expovariate(rate)) < min(t + SPIKE_SECONDS, duration):
            out.append((s, Job(spec.model_id, spec.steps, s, JOB_SLO_FACTOR * spec.seconds(RUNG_FULL))))
        t += rng.expovariate(1 / spike_every)
    return sorted(out, key=lambda e: e[0])


# --- the fleet --------------------------------------------------------------------------------

@dataclass
class Copy:
    rung: str
    held_mib: int
    last_used: float
    loaded_at: float | None  # by the API's load; None: preloaded
    unloading: bool = False


@dataclass
class SimWorker:
    worker_id: str
    vram_mib: int
    copies: dict[str, Copy] = field(default_factory=dict)
    inbox: deque[PlacementAction] = field(default_factory=deque)
    loader: PlacementAction | None = None  # the load or unload under way
    job: Job | None = None
    held: deque[Job] = field(default_factory=deque)  # dispatched to it, waiting for `job` to end
    incoming: list[Job] = field(default_factory=list)  # moved to it (plan_moves), on their way
    live: Counter[str] = field(default_factory=Counter)  # model_id -> live sessions
    failed_loads: dict[str, float] = field(default_factory=dict)

    def free_mib(self) -> int:
        return self.vram_mib - sum(c.held_mib for c in self.copies.values())

    def holds(self) -> int:
        """The jobs counted against its dispatch depth: the one it runs and those it holds."""
        return (self.job is not None) + len(self.held) + len(self.incoming)

    def busy(self, model_id: str) -> bool:
        """A job or a live session of `model_id` is on it (the planner never unloads it then)."""
        return (self.live[model_id] > 0 or (self.job is not None and self.job.model_id == model_id)
                or any(j.model_id == model_id for j in self.held) or any(j.model_id == model_id for j in self.incoming))

    def rungs(self) -> dict[str, str]:
        """model_id -> the rung of its copy here (what the dispatcher learns from the worker)."""
        return {m: c.rung for m, c in self.copies.items()}

    def ready(self, model_id: str) -> bool:
        c = self.copies.get(model_id)
        return c is not None and not c.unloading

    def actions(self) -> list[PlacementAction]:
        """The load or unload under way, then those waiting for it."""
        return ([self.loader] if self.loader else []) + list(self.inbox)


class Fleet:
    """The discrete-event model: per model a FIFO of queued jobs and waiting sessions; per worker up
    to `depth` jobs dispatched to it (the API's JOB_DISPATCH_DEPTH) run one at a time, its session
    slots on rung full, and a loader doing its loads and unloads one at a time, in the order sent,
    beside the jobs. A job dispatched behind another waits there even if another copy frees first."""

    def __init__(self, specs: Sequence[ModelSpec], n_workers: int, vram_mib: int, rng: random.Random,
                 window: float = PlacementSettings().demand_window_seconds,
                 burst_window: float = PlacementSettings().burst_window_seconds, depth: int = 2,
                 moves: bool = True) -> None:
        self.specs = {s.model_id: s for s in specs}
        self.depth = depth  # JOB_DISPATCH_DEPTH: jobs a worker may hold, the one it runs included
        self.moves = moves  # the API's rebalance (plan_moves)
        self.moved = 0
        self.installed = tuple(InstalledModel(s.model_id, s.needs_mib, s.step_ms) for s in specs)
        self.rng = rng
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.queued: dict[str, deque[Job]] = {s.model_id: deque() for s in specs}
        self.arrived: dict[str, deque[Job]] = {s.model_id: deque() for s in specs}  # within the demand window
        self.window = window  # what the API counts as recent arrivals (ModelDemand.recent_steps)
        self.burst_window = burst_window  # ... and as a burst (ModelDemand.burst_steps)
        self.waiting: dict[str, deque[Session]] = {s.model_id: deque() for s in specs}
        self.workers = [SimWorker(f"w{i:02d}", vram_mib) for i in range(n_workers)]
        self.loads = 0
        self.failed = 0
        self.busy_seconds = 0.0
        # (worker, model) -> job seconds started since ModelMesh's last rate check
        self.copy_busy: dict[tuple[str, str], float] = defaultdict(float)
        for i, w in enumerate(self.workers):
            start = i * len(specs) // n_workers
            order = self.installed[start:] + self.installed[:start]
            for model_id, rung in static_preload(order, vram_mib):
                w.copies[model_id] = Copy(rung, self.specs[model_id].needs_mib[rung], 0.0, None)

    def at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, what))

    # what the planner sees
    def demand(self) -> list[ModelDemand]:
        for recent in self.arrived.values():
            while recent and recent[0].submitted < self.now - max(self.window, self.burst_window):
                recent.popleft()
        return [ModelDemand(m, len(q), sum(j.steps for j in q), len(self.waiting[m]),
                            sum(j.steps for j in self.arrived[m] if j.submitted >= self.now - self.window),
                            sum(j.steps for j in self.arrived[m] if j.submitted >= self.now - self.burst_window))
                for m, q in self.queued.items() if q or self.waiting[m] or self.arrived[m]]

    def states(self) -> list[WorkerState]:
        out = []
        for w in self.workers:
            pending = [a for a in w.actions() if a.kind == LOAD]
            loaded = [LoadedModel(m, c.rung, c.held_mib, w.busy(m),
                                  self.now if w.live[m] else c.last_used, c.loaded_at) for m, c in w.copies.items()]
            out.append(WorkerState(w.worker_id, self.installed, loaded, w.free_mib(),
                                   [PendingLoad(a.model_id, a.rung or RUNG_FULL) for a in pending],
                                   frozenset(m for m, c in w.copies.items() if c.unloading), dict(w.failed_loads)))
        return out

    def load_of(self) -> dict[str, int]:
        return {w.worker_id: w.holds() + sum(w.live.values()) for w in self.workers}

    def has_copy_coming(self, model_id: str) -> bool:
        """A load of `model_id` is queued or under way on some worker."""
        return any(a.kind == LOAD and a.model_id == model_id
                   for w in self.workers for a in w.actions())

    def has_copy(self, model_id: str, *, full: bool) -> bool:
        return any(w.ready(model_id) and (not full or w.copies[model_id].rung == RUNG_FULL)
                   or any(a.kind == LOAD and a.model_id == model_id and (not full or a.rung == RUNG_FULL)
                          for a in w.actions()) for w in self.workers)

    # actions
    def apply(self, actions: Sequence[PlacementAction]) -> None:
        by_id = {w.worker_id: w for w in self.workers}
        for a in actions:
            w = by_id[a.worker_id]
            if a.kind == UNLOAD:
                w.copies[a.model_id].unloading = True  # takes no new work from now on
            w.inbox.append(a)
            self.next_on_loader(w)

    def next_on_loader(self, w: SimWorker) -> None:
        if w.loader is not None or not w.inbox:
            return
        a = w.loader = w.inbox.popleft()
        if a.kind == UNLOAD:
            self.at(self.now + UNLOAD_SECONDS, "loader", w)
        else:
            self.loads += 1
            self.at(self.now + self.specs[a.model_id].load_seconds, "loader", w)

    def loader_done(self, w: SimWorker) -> None:
        a, w.loader = w.loader, None
        assert a is not None
        if a.kind == UNLOAD:
            del w.copies[a.model_id]
        else:
            spec, rung = self.specs[a.model_id], a.rung or RUNG_FULL
            if spec.needs_mib[rung] > w.free_mib() or self.rng.random() < LOAD_FAILURE_RATE:
                self.failed += 1
                w.failed_loads[a.model_id] = self.now
            else:
                w.copies[a.model_id] = Copy(rung, spec.needs_mib[rung], self.now, self.now)
        self.next_on_loader(w)

    # work
    def dispatch(self) -> None:
        """The API's dispatch decision (scheduling.policy.plan_dispatch) over the models each worker
        has ready: a job goes to the worker holding the fewest, up to `depth` a worker, and a worker
        runs the jobs it holds in the order it got them."""
        for w in self.workers:
            if w.job is None and w.held:
                self.start(w, w.held.popleft())
        by_id = {w.worker_id: w for w in self.workers}
        queues = _Heads(self.queued)
        capacities = [WorkerCapacity(w.worker_id, frozenset(m for m in w.copies if w.ready(m)), w.holds(), i,
                                     w.rungs())
                      for i, w in enumerate(self.workers)]
        # No reservation (no priorities here), and the moves are the bench's own (move_waiting_jobs).
        for a in plan_dispatch(queues, capacities, depth=self.depth, reservations={}, moves=[]).assignments:
            w, job = by_id[a.worker_id], queues.popped.pop(a.job.job_id)
            if w.job is None:
                self.start(w, job)
            else:
                w.held.append(job)
        if self.moves:
            self.move_waiting_jobs()
        for model_id, q in self.waiting.items():
            while q:
                free = [w for w in self.workers if w.ready(model_id) and w.copies[model_id].rung == RUNG_FULL
                        and w.live[model_id] < self.specs[model_id].slots]
                if not free:
                    break
                w, s = min(free, key=lambda w: (w.live[model_id], w.worker_id)), q.popleft()
                s.live_at = self.now
                w.live[model_id] += 1
                self.busy_seconds += s.seconds * SESSION_GPU_SHARE
                self.at(self.now + s.seconds, "session_end", (w, s))

    def move_waiting_jobs(self) -> None:
        """The API's rebalance (scheduling.policy.plan_moves): a worker holding nothing takes back a
        job held on another worker behind that worker's own job; it is its own MOVE_SECONDS later
        (preempt, the answer, the job order)."""
        by_id = {w.worker_id: w for w in self.workers}
        jobs: dict[str, Job] = {}

        def held(job: Job, started: bool) -> HeldJob:
            jobs[str(id(job))] = job
            return HeldJob(QueuedJob(str(id(job)), job.model_id, 0, int(job.submitted * 1e6)), started)

        holdings = [Holding(w.worker_id, frozenset(m for m in w.copies if w.ready(m)), w.holds(),
                            tuple([held(w.job, True)] if w.job else []) + tuple(held(j, False) for j in w.held), i,
                            w.rungs())
                    for i, w in enumerate(self.workers)]
        for move in plan_moves(holdings):
            job, thief = jobs[move.job_id], by_id[move.to_worker_id]
            by_id[move.worker_id].held.remove(job)
            thief.incoming.append(job)
            self.moved += 1
            self.at(self.now + MOVE_SECONDS, "moved", (thief, job))

    def start(self, w: SimWorker, job: Job) -> None:
        spec, copy = self.specs[job.model_id], w.copies[job.model_id]
        seconds = spec.seconds(copy.rung) * (1 + SESSION_SLOWDOWN * sum(w.live.values()))
        w.job, copy.last_used, job.rung = job, self.now, copy.rung
        self.busy_seconds += seconds
        self.copy_busy[(w.worker_id, job.model_id)] += seconds
        self.at(self.now + seconds, "job_done", w)

    def run(self, arrivals: Sequence[tuple[float, Job | Session]], policy: Policy, *, duration: float) -> None:
        for t, arrival in arrivals:
            self.at(t, "arrive", arrival)
        self.at(PLACEMENT_SECONDS, "tick", None)
        end = duration + DRAIN_SECONDS
        while self.events:
            self.now, _, kind, what = heapq.heappop(self.events)
            if self.now > end:
                break
            if kind == "tick":
                self.apply(policy.periodic(self))
                if self.now < duration or any(self.queued.values()):
                    self.at(self.now + PLACEMENT_SECONDS, "tick", None)
            else:
                self.handle(kind, what)
                self.dispatch()
                self.apply(policy.event(self))
            self.dispatch()

    def handle(self, kind: str, what: object) -> None:
        if kind == "arrive" and isinstance(what, Job):
            what.copy_on_arrival = any(w.ready(what.model_id) for w in self.workers)
            self.queued[what.model_id].append(what)
            self.arrived[what.model_id].append(what)
        elif kind == "arrive" and isinstance(what, Session):
            self.waiting[what.model_id].append(what)
            self.at(self.now + SESSION_GIVE_UP_SECONDS, "give_up", what)
        elif kind == "give_up" and isinstance(what, Session) and what.live_at is None and not what.gone:
            what.gone = True
            self.waiting[what.model_id].remove(what)
        elif kind == "job_done" and isinstance(what, SimWorker):
            assert what.job is not None
            what.job.finished = self.now
            what.copies[what.job.model_id].last_used = self.now
            what.job = None
        elif kind == "session_end" and isinstance(what, tuple):
            w, s = what
            w.live[s.model_id] -= 1
            w.copies[s.model_id].last_used = self.now
        elif kind == "moved" and isinstance(what, tuple):
            thief, job = what
            thief.incoming.remove(job)
            if thief.ready(job.model_id) and thief.holds() < self.depth:
                if thief.job is None:
                    self.start(thief, job)
                else:
                    thief.held.append(job)
            else:  # back at its place: it was dispatched before every job still queued for its model
                self.queued[job.model_id].appendleft(job)
        elif kind == "loader" and isinstance(what, SimWorker):
            self.loader_done(what)


class _Heads:
    """The bench's per-model FIFOs as the dispatch decision reads queues (scheduling.policy.Heads):
    the oldest queued job of the models asked for, popped (one account, one priority)."""

    def __init__(self, queued: Mapping[str, deque[Job]]) -> None:
        self.queued = queued
        self.popped: dict[str, Job] = {}

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None:
        wanted = set(model_ids)
        heads = [q[0] for m, q in self.queued.items() if q and m in wanted]
        if not heads:
            return None
        job = min(heads, key=lambda j: j.submitted)
        self.queued[job.model_id].popleft()
        job_id = str(id(job))  # unique while the trace holds the job
        self.popped[job_id] = job
        return QueuedJob(job_id, job.model_id, 0, int(job.submitted * 1e6))


# --- the policies ----------------------------------------------------------------------------

@dataclass
class Policy:
    name: str
    event: Callable[[Fleet], list[PlacementAction]]
    periodic: Callable[[Fleet], list[PlacementAction]]


def planner(settings: PlacementSettings) -> Policy:
    return Policy("planner",
                  lambda f: plan_placement(f.demand(), f.states(), now=f.now, settings=settings),
                  lambda f: plan_placement(f.demand(), f.states(), now=f.now, periodic=True, settings=settings))


def lru_policy(f: Fleet) -> list[PlacementAction]:
    actions: list[PlacementAction] = []
    for model_id in f.specs:
        for session, waiting in ((True, bool(f.waiting[model_id])), (False, bool(f.queued[model_id]))):
            if waiting and not f.has_copy(model_id, full=session):
                mine = lru_on_miss(model_id, f.states(), session=session, load_of=f.load_of())
                f.apply(mine)
                actions += mine
    return []  # applied as planned, one miss at a time, so each sees the last one's evictions


# ModelMesh's own constants (kserve/modelmesh, src/main/java/com/ibm/watson/modelmesh/ModelMesh.java)
MM_RATE_CHECK_SECONDS = 10.0  # RATE_CHECK_INTERVAL_MS: the rate-tracking task's period
MM_SCALE_SHARE = 0.9  # MM_CONC_SCALEUP_BANDWIDTH_PCT (90): the latency-based threshold, a share of one copy's capacity
MM_SECOND_COPY_AGES = (420.0, 2_400.0)  # SECOND_COPY_MIN/MAX_AGE_SECS: "regular usage" earns a second copy
MM_JANITOR_SECONDS = 360.0  # LOCAL_JANITOR_FREQ_SECS: scale-down runs this often
MM_HEAVY_MIN_AGE_SECONDS = 600.0  # a copy beyond the second stays while the model was heavy this recently (at least)


class ModelMesh:
    """ModelMesh's copy scaling on top of load-on-miss with LRU eviction (`lru_on_miss`), as its
    rateTrackingTask and janitorTask do it in latency-based mode (a runtime that runs one request at
    a time, as a GPU worker does):

    - every 10 s, for each model used since: a copy busier than 90 % of its capacity over the
      interval gets floor(busy / 90 %) more copies (at most a third of the fleet past two), unless a
      copy of it was loaded within 20 s + 2x its load time (the rate would not show it yet);
    - a model with one copy, used now and also 7 to 40 minutes ago ("regular usage"), gets a second
      copy, unless the fleet's memory is more than 90 % full;
    - every 6 minutes a copy beyond the second is unloaded when its model has not been heavy (75 %
      of the threshold) for 10 minutes, is below 2/3 of it now and has at most one request queued;
    - a copy that does not fit evicts the worker's least recently used copies (ModelMesh's cache).
    """

    def __init__(self) -> None:
        self.checked_at = 0.0
        self.janitor_at = 0.0
        self.used_at: dict[str, deque[float]] = {}  # model -> rate checks it was used in (the last 40 minutes)
        self.heavy_at: dict[str, float] = {}
        self.loaded_at: dict[str, float] = {}  # model -> when a copy was last asked for by scaling

    def event(self, f: Fleet) -> list[PlacementAction]:
        return lru_policy(f)

    def periodic(self, f: Fleet) -> list[PlacementAction]:
        if f.now - self.checked_at < MM_RATE_CHECK_SECONDS - 1e-9:
            return []
        interval, self.checked_at = f.now - self.checked_at, f.now
        busy: dict[str, float] = {}  # model -> its busiest copy's share of the interval
        for (_, model_id), seconds in f.copy_busy.items():
            busy[model_id] = max(busy.get(model_id, 0.0), seconds / interval)
        for w in f.workers:
            for model_id, live in w.live.items():
                if live:
                    busy[model_id] = max(busy.get(model_id, 0.0), SESSION_GPU_SHARE * live)
        f.copy_busy.clear()
        full = 10 * sum(w.free_mib() for w in f.workers) < sum(w.vram_mib for w in f.workers)
        for model_id, share in sorted(busy.items()):
            used = self.used_at.setdefault(model_id, deque())
            used.append(f.now)
            while used and used[0] < f.now - MM_SECOND_COPY_AGES[1]:
                used.popleft()
            if share > MM_SCALE_SHARE * 0.75:
                self.heavy_at[model_id] = f.now
            copies = sum(1 for w in f.workers if w.ready(model_id))
            if copies == 0 or f.has_copy_coming(model_id):
                continue
            spec = f.specs[model_id]
            if copies == 1 and not full and any(t <= f.now - MM_SECOND_COPY_AGES[0] for t in used):
                self.add(f, model_id, 1)
            elif share >= MM_SCALE_SHARE and f.now - self.loaded_at.get(model_id, -1e9) >= (
                    2 * MM_RATE_CHECK_SECONDS + 2 * spec.load_seconds):
                n = int(share / MM_SCALE_SHARE)
                if n > 2:
                    n = min(n, len(f.workers) // 3)
                self.add(f, model_id, n)
        if f.now - self.janitor_at >= MM_JANITOR_SECONDS:
            self.janitor_at = f.now
            self.scale_down(f, busy)
        return []

    def add(self, f: Fleet, model_id: str, n: int) -> None:
        for _ in range(n):
            mine = lru_on_miss(model_id, f.states(), session=False, load_of=f.load_of())
            if not mine:
                return
            f.apply(mine)
            self.loaded_at[model_id] = f.now

    def scale_down(self, f: Fleet, busy: Mapping[str, float]) -> None:
        for model_id in f.specs:
            copies = [w for w in f.workers if w.ready(model_id)]
            if (len(copies) <= 2 or f.now - self.heavy_at.get(model_id, -1e9) < MM_HEAVY_MIN_AGE_SECONDS
                    or busy.get(model_id, 0.0) > MM_SCALE_SHARE * 2 / 3 or len(f.queued[model_id]) > 1):
                continue
            idle = [w for w in copies if not w.busy(model_id)]
            if idle:
                w = min(idle, key=lambda w: (w.copies[model_id].last_used, w.worker_id))
                f.apply([PlacementAction(UNLOAD, w.worker_id, model_id, None, "modelmesh: scale-down")])


POLICIES = {
    "static": lambda settings: Policy("static", lambda f: [], lambda f: []),
    "lru": lambda settings: Policy("lru", lru_policy, lambda f: []),
    "modelmesh": lambda settings: (lambda mm: Policy("modelmesh", mm.event, mm.periodic))(ModelMesh()),
    "planner": planner,
}


@dataclass(frozen=True)
class Result:
    policy: str
    jobs: int
    job_violations: int
    sessions: int
    session_violations: int
    loads: int
    failed_loads: int
    loads_per_hour: float
    busy_share: float
    wall_seconds: float
    late_why: Counter[str]
    worst_attainment: float = 1.0  # pooled over seeds: the worst seed's

    @property
    def violations(self) -> int:
        return self.job_violations + self.session_violations

    @property
    def attainment(self) -> float:
        total = self.jobs + self.sessions
        return 1.0 if total == 0 else 1 - self.violations / total


def replay(name: str, args: argparse.Namespace, settings: PlacementSettings) -> Result:
    rng = random.Random(args.seed)
    specs = model_specs(args.models, args.rungs.split(","), load_fixed_seconds=args.load_fixed_seconds,
                        load_mib_per_second=args.load_mib_per_second)
    arrivals = trace(rng, specs, duration=args.duration, job_rate=args.job_rate, phase=args.phase,
                     session_rate=args.session_rate, spike_every=args.spike_every)
    fleet = Fleet(specs, args.workers, args.vram_mib, random.Random(args.seed + 1), settings.demand_window_seconds,
                  settings.burst_window_seconds, args.dispatch_depth, args.moves)
    started = time.perf_counter()
    fleet.run(arrivals, POLICIES[name](settings), duration=args.duration)
    jobs = [a for _, a in arrivals if isinstance(a, Job)]
    sessions = [a for _, a in arrivals if isinstance(a, Session)]
    late_jobs = [j for j in jobs if j.finished is None or j.finished - j.submitted > j.budget]
    late = len(late_jobs)
    unseated = sum(1 for s in sessions if s.live_at is None or s.live_at - s.joined > SESSION_SLO_SECONDS)
    result = Result(name, len(jobs), late, len(sessions), unseated, fleet.loads, fleet.failed,
                    fleet.loads / (args.duration / 3600), fleet.busy_seconds / (args.workers * max(fleet.now, 1.0)),
                    time.perf_counter() - started, Counter(map(why_late, late_jobs)))
    return replace(result, worst_attainment=result.attainment)


def why_late(j: Job) -> str:
    """What a late job met first: never ran, a slower rung, no copy when it came, or a queue."""
    if j.finished is None:
        return "never ran"
    if j.rung != RUNG_FULL:
        return f"ran on {j.rung}"
    return "queued behind work" if j.copy_on_arrival else "no copy on arrival"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    parser.add_argument("--seeds", type=int, default=4, help="how many seeds (traces) from --seed on, pooled")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--models", type=int, default=12)
    parser.add_argument("--dispatch-depth", type=int, default=2,
                        help="JOB_DISPATCH_DEPTH: jobs a worker may hold, the one it runs included")
    parser.add_argument("--moves", action=argparse.BooleanOptionalAction, default=True,
                        help="the API's rebalance: an idle worker takes back a job held behind another (plan_moves)")
    parser.add_argument("--duration", type=float, default=14_400.0, help="seconds of trace (simulated)")
    parser.add_argument("--vram-mib", default=f"{WORKER_VRAM_MIB},24576",
                        help="each worker's device memory, MiB; several, comma-separated, for one table each")
    parser.add_argument("--job-rate", type=float, default=0.5, help="jobs per second outside spikes")
    parser.add_argument("--session-rate", type=float, default=1 / 30, help="sessions per second")
    parser.add_argument("--spike-every", type=float, default=300.0, help="mean seconds between spikes (0: none)")
    parser.add_argument("--phase", type=float, default=600.0, help="seconds between popularity reshuffles")
    parser.add_argument("--target-wait", type=float, default=PlacementSettings().target_wait_seconds,
                        help="the planner's PLACEMENT_TARGET_WAIT_SECONDS")
    parser.add_argument("--rungs", default=",".join(RUNGS), help="the rungs a model may take, e.g. full")
    parser.add_argument("--target-wait-jobs", type=float, default=PlacementSettings().target_wait_jobs,
                        help="the planner's PLACEMENT_TARGET_WAIT_JOBS (0: the target wait alone)")
    parser.add_argument("--burst-busy-share", type=float, default=PlacementSettings().burst_busy_share,
                        help="the planner's PLACEMENT_BURST_BUSY_SHARE, for every replay of it (0: the burst rule off)")
    parser.add_argument("--copy-busy-share", type=float, default=PlacementSettings().copy_busy_share,
                        help="the planner's PLACEMENT_COPY_BUSY_SHARE, for every replay of it (0: the trend rule off)")
    parser.add_argument("--also-target-wait", type=float, default=30.0,
                        help="also replay the planner tuned for the SLO: this target wait ... (0: not)")
    parser.add_argument("--also-target-wait-jobs", type=float, default=2.0,
                        help="... and at most this many of a job's own run (the SLO gives 3x: 2 runs of wait)")
    parser.add_argument("--load-fixed-seconds", type=float, default=LOAD_FIXED_SECONDS,
                        help="a load's fixed cost (bench/load_unload.py measures it on a GPU host)")
    parser.add_argument("--load-mib-per-second", type=float, default=LOAD_MIB_PER_SECOND,
                        help="a load's speed, of the model's full needs a second")
    parser.add_argument("--retire", action=argparse.BooleanOptionalAction, default=True,
                        help="also replay the tuned planner retiring spare slow copies (beyond the contract)")
    args = parser.parse_args()
    settings = PlacementSettings(target_wait_seconds=args.target_wait, target_wait_jobs=args.target_wait_jobs,
                                 burst_busy_share=args.burst_busy_share, copy_busy_share=args.copy_busy_share)
    tuned = replace(settings, target_wait_seconds=args.also_target_wait, target_wait_jobs=args.also_target_wait_jobs)
    replays: dict[str, tuple[str, PlacementSettings]] = {name: (name, settings) for name in POLICIES}
    if args.also_target_wait:  # the same planner with the settings an operator would pick for this SLO
        replays["tuned"] = ("planner", tuned)
        if args.retire:
            replays["tuned+ret"] = ("planner", replace(tuned, retire_slow_copies=True))
    seeds = list(range(args.seed, args.seed + max(1, args.seeds)))

    print(f"trace: seeds {', '.join(map(str, seeds))}, {args.workers} workers, {args.models} models, "
          f"{args.duration:,.0f} s each (+ up to {DRAIN_SECONDS:,.0f} s to drain), jobs {args.job_rate:g}/s + "
          f"spikes, sessions {args.session_rate:.3g}/s; rungs {args.rungs}; a load {args.load_fixed_seconds:g} s + "
          f"full needs at {args.load_mib_per_second:,.0f} MiB/s")
    print(f"planner: PLACEMENT_TARGET_WAIT_SECONDS={settings.target_wait_seconds:g}, "
          f"PLACEMENT_TARGET_WAIT_JOBS={settings.target_wait_jobs:g}, the rest the defaults (trend rule: "
          f"{settings.copy_busy_share:.0%}; burst rule: {settings.burst_busy_share:.0%} over "
          f"{settings.burst_window_seconds:g} s)")
    if "tuned" in replays:
        print(f"tuned: the planner with PLACEMENT_TARGET_WAIT_SECONDS={tuned.target_wait_seconds:g} and "
              f"PLACEMENT_TARGET_WAIT_JOBS={tuned.target_wait_jobs:g}: a copy more once queued work per copy "
              f"passes {tuned.target_wait_jobs:g} of its jobs' own runs on full (the 3x SLO leaves 2 runs of wait)")
    if "tuned+ret" in replays:
        print("tuned+ret: tuned, and spare copies on a rung slower than 2x full unloaded at once "
              "(retire_slow_copies: beyond the contract's long-queue rule, for information)")
    print("lru: load on a miss, one copy a model; modelmesh: the same with ModelMesh's copy scaling "
          "(second copies for regular use, more past 90 % busy, scale-down after 10 min): the issue's baseline")
    for vram in (int(v) for v in args.vram_mib.split(",")):
        each = [replace_args(args, seed=seed, vram_mib=vram) for seed in seeds]
        print(f"\n== {args.workers} workers x {vram:,} MiB ==")
        offered(each[0])
        results = {key: pooled(key, [replay(name, a, rules) for a in each]) for key, (name, rules) in replays.items()}
        report(results)


def replace_args(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def pooled(policy: str, results: Sequence[Result]) -> Result:
    """The replays of one policy over several seeds as one: counts summed, shares averaged, and the
    worst seed's attainment kept."""
    n = len(results)
    return Result(policy, sum(r.jobs for r in results), sum(r.job_violations for r in results),
                  sum(r.sessions for r in results), sum(r.session_violations for r in results),
                  sum(r.loads for r in results), sum(r.failed_loads for r in results),
                  sum(r.loads_per_hour for r in results) / n, sum(r.busy_share for r in results) / n,
                  sum(r.wall_seconds for r in results), sum((r.late_why for r in results), Counter()),
                  min(r.attainment for r in results))


def report(results: Mapping[str, Result]) -> None:
    print(f"{'policy':<11} {'jobs':>6} {'late':>6} {'sessions':>8} {'late':>5} {'attainment':>10} {'worst':>7} "
          f"{'loads':>6} {'failed':>6} {'loads/h':>8} {'gpu busy':>8} {'wall s':>7}")
    for r in results.values():
        print(f"{r.policy:<11} {r.jobs:>6} {r.job_violations:>6} {r.sessions:>8} {r.session_violations:>5} "
              f"{r.attainment:>10.2%} {r.worst_attainment:>7.2%} {r.loads:>6} {r.failed_loads:>6} "
              f"{r.loads_per_hour:>8.1f} {r.busy_share:>8.1%} {r.wall_seconds:>7.1f}")
    reasons = ("never ran", "no copy on arrival", "queued behind work", "ran on model_offload", "ran on group_offload")
    print("late jobs, by what they met:")
    for r in results.values():
        print(f"  {r.policy:<11} " + ", ".join(f"{why} {r.late_why[why]}" for why in reasons if r.late_why[why]))
    for key in ("planner", "tuned", "tuned+ret"):
        if key in results:
            goals(results[key], results["modelmesh"], also=results["lru"])


def goals(p: Result, baseline: Result, *, also: Result) -> None:
    """One PASS/MISSED line per goal of the issue for one replay of the planner against the
    ModelMesh-style baseline, and the violations and loads against one-copy LRU for information."""
    def fewer(other: Result) -> float:
        return float("inf") if p.violations == 0 else other.violations / p.violations

    for ok, what in ((p.attainment >= 0.99, f"attainment {p.attainment:.2%} (>= 99%; worst seed "
                                            f"{p.worst_attainment:.2%})"),
                     (fewer(baseline) >= 1.5, f"{fewer(baseline):.2f}x fewer violations than {baseline.policy} "
                                              f"({p.violations} vs {baseline.violations}; >= 1.5x)"),
                     (p.loads <= baseline.loads, f"loads {p.loads} vs {baseline.policy} {baseline.loads} (<=)")):
        print(f"goal {p.policy}: {what}: {'PASS' if ok else 'MISSED'}")
    print(f"     {p.policy} against {also.policy}, for information: {fewer(also):.2f}x fewer violations "
          f"({p.violations} vs {also.violations}), loads {p.loads} vs {also.loads}")


def offered(args: argparse.Namespace) -> None:
    """The trace's offered work against the fleet's capacity: each job's standalone run on rung full
    and each session's share of its worker, over workers x duration (no policy can do better than
    a fleet that is not overloaded; above ~100 % none can meet any SLO)."""
    specs = model_specs(args.models, args.rungs.split(","), load_fixed_seconds=args.load_fixed_seconds,
                        load_mib_per_second=args.load_mib_per_second)
    by_id = {s.model_id: s for s in specs}
    arrivals = trace(random.Random(args.seed), specs, duration=args.duration, job_rate=args.job_rate,
                     phase=args.phase, session_rate=args.session_rate, spike_every=args.spike_every)
    jobs = sum(by_id[a.model_id].seconds(RUNG_FULL) for _, a in arrivals if isinstance(a, Job))
    sessions = sum(a.seconds * SESSION_GPU_SHARE for _, a in arrivals if isinstance(a, Session))
    capacity = args.workers * args.duration
    per_minute: dict[int, float] = {}
    for t, a in arrivals:
        if isinstance(a, Job):
            minute = int(t // 60)
            per_minute[minute] = per_minute.get(minute, 0.0) + by_id[a.model_id].seconds(RUNG_FULL)
    peak = max(per_minute.values(), default=0.0) / (args.workers * 60)
    print(f"offered load: jobs {jobs / capacity:.1%} + sessions {sessions / capacity:.1%} = "
          f"{(jobs + sessions) / capacity:.1%} of the fleet's {args.workers} GPUs on rung full "
          f"(busiest minute's jobs {peak:.1%}); full needs of all {args.models} models "
          f"{sum(s.needs_mib.get(RUNG_FULL, 0) for s in specs):,} MiB of the fleet's "
          f"{args.workers * args.vram_mib:,} MiB")


if __name__ == "__main__":
    main()
