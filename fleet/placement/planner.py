"""The placement planner (pure: no Django, no I/O, no torch, time passed in): from the demand per model
and what each connected worker has installed, loaded and free, the load and unload actions that put
models where the demand is. The rules: docs/protocol.md, "Placement across workers"; why: docs/design/placement.md."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from potocolom.protocol.rungs import RUNG_FULL, RUNGS
from workers.placement_state import LOAD, UNLOAD, PlacementAction


@dataclass(frozen=True)
class PlacementSettings:
    """The API's placement settings, in seconds (the protocol's defaults)."""

    target_wait_seconds: float = 30.0  # PLACEMENT_TARGET_WAIT_SECONDS: queued work per copy worth another copy
    idle_seconds: float = 300.0  # PLACEMENT_IDLE_SECONDS: unused this long, a copy may make room for an extra copy
    min_residency_seconds: float = 60.0  # PLACEMENT_MIN_RESIDENCY_SECONDS: an API-loaded model stays this long
    failed_load_backoff_seconds: float = 60.0  # a worker whose load failed is not asked again for this long
    default_step_ms: float = 100.0  # a model's step time until a worker has measured it (step_ms None)
    # A copy's throughput is its step_ms (measured on full) times its rung's factor, plus the rung's
    # fixed cost a job spread over the job's steps: the H200 table (docs/design/memory-ladder.md)
    # has group offload at 3.7x full's step, and model offload at full's step plus ~0.8 s a job of
    # moving modules (10 steps: 0.32 s full, 1.10 s model offload, 1.22 s group offload).
    rung_step_factor: Mapping[str, float] = field(
        default_factory=lambda: {"full": 1.0, "model_offload": 1.0, "group_offload": 3.7})
    rung_job_seconds: Mapping[str, float] = field(
        default_factory=lambda: {"full": 0.0, "model_offload": 0.8, "group_offload": 0.0})
    default_job_steps: int = 25  # steps a job is taken to have when none is queued (for rung_job_seconds)
    # The trend rule (periodic): a model whose recent arrivals (ModelDemand.recent_steps over
    # demand_window_seconds) would keep every copy's worker busy more than its share of the time
    # gets another copy, before a queue forms; 0 turns it off. The share is copy_busy_share for a
    # model of the fleet's mean size and scales with the model's size (_Plan._copy_share): a copy of
    # a model a third of the mean size takes a third of the memory, so it is worth adding sooner.
    copy_max_step_factor: float = 2.0  # no copy for throughput on a rung slower than this (group offload)
    # 0: the target wait is PLACEMENT_TARGET_WAIT_SECONDS alone; N > 0: at most N of the model's
    # queued jobs' own run on full (an operator's choice for an SLO counted in a job's own time).
    target_wait_jobs: float = 0.0
    retire_slow_copies: bool = False  # see _Plan.retire_slow_copies: beyond the contract, off by default
    demand_window_seconds: float = 60.0
    copy_busy_share: float = 0.4
    # The burst rule (every run, events too): a model whose arrivals over the last
    # burst_window_seconds (ModelDemand.burst_steps) would keep every copy's worker busy more than
    # burst_busy_share of the time gets one more copy at once, while none is loading (0 turns it
    # off). A spike that saturates a copy shows within seconds, long before a 60 s trend or a queue
    # past the target wait; the high share keeps a few jobs' noise from loading anything.
    burst_window_seconds: float = 10.0
    burst_busy_share: float = 0.95


@dataclass(frozen=True)
class ModelDemand:
    """What waits for one model now: queued jobs (and their steps, summed) and sessions queued for
    admission (not placing, not live)."""

    model_id: str
    queued_jobs: int = 0
    queued_steps: int = 0
    waiting_sessions: int = 0
    recent_steps: int = 0  # steps of the jobs submitted for it in the last demand_window_seconds (the trend)
    burst_steps: int = 0  # ... in the last burst_window_seconds (the burst rule)


@dataclass(frozen=True)
class InstalledModel:
    """A model in a worker's models dir, as its hello's `installed` entry says.

    needs_mib: the device memory each rung needs, keyed by rung name ("full", "model_offload",
    "group_offload"); a rung left out is one the worker may not use. step_ms: one denoising step on
    the full rung, None until measured.
    """

    model_id: str
    needs_mib: Mapping[str, int] = field(hash=False)
    step_ms: float | None = None


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded on a worker.

    busy: it holds a job or a live session there now (never unloaded). last_used: when it last
    ran a job or a frame (or was loaded), seconds on the planner's clock. loaded_at: when the API's
    `load_model` loaded it, None when the worker preloaded it (only the former has a minimum
    residency).
    """

    model_id: str
    rung: str
    held_mib: int
    busy: bool
    last_used: float
    loaded_at: float | None = None


@dataclass(frozen=True)
class PendingLoad:
    """A `load_model` sent and not yet answered: its memory is spoken for, and it counts as a copy."""

    model_id: str
    rung: str


@dataclass(frozen=True)
class WorkerState:
    """One connected worker as the API knows it.

    free_mib: the free device memory its last message reported (before pending loads); None for a
    worker with no GPU budget (no CUDA, no --vram-mib), which the planner treats as unlimited: every
    model fits there on the full rung and nothing is unloaded to make room. unloading: models an
    `unload_model` was sent for and not yet answered (no longer a copy; their memory is not free yet).
    failed_loads: model_id -> when its last load on this worker failed. draining: takes no new work,
    so it is given no load and its copies do not count.
    """

    worker_id: str
    installed: Sequence[InstalledModel] = field(hash=False)
    loaded: Sequence[LoadedModel] = field(default=(), hash=False)
    free_mib: int | None = None
    loading: Sequence[PendingLoad] = field(default=(), hash=False)
    unloading: frozenset[str] = frozenset()
    failed_loads: Mapping[str, float] = field(default_factory=dict, hash=False)
    draining: bool = False


@dataclass
class _Worker:
    """The planner's running view of one worker while it plans (memory and copies after the
    actions planned so far)."""

    state: WorkerState
    available_mib: float  # free memory less pending and planned loads, plus planned unloads
    installed: dict[str, InstalledModel]
    loaded: dict[str, LoadedModel]  # still loaded and not being unloaded (planned unloads removed)
    copies: dict[str, str]  # model_id -> rung: loaded or loading, not being unloaded
    untouchable: set[str]  # models loaded or unloaded in this plan, or being unloaded: no second action


def plan_placement(demand: Iterable[ModelDemand], workers: Iterable[WorkerState], *, now: float,
                   periodic: bool = False, settings: PlacementSettings | None = None) -> list[PlacementAction]:
    """The load and unload actions for this moment, in the order to send them (a load's unloads come
    first, on the same worker). Every run applies the missing-copy and burst rules; `periodic` (every
    PLACEMENT_SECONDS) adds the long-queue and trend rules, and retire_slow_copies when set. No action
    for a model means its work waits. The rules, their order and why: docs/design/placement.md."""
    settings = settings or PlacementSettings()
    models = {d.model_id: d for d in demand if d.queued_jobs > 0 or d.queued_steps > 0 or d.waiting_sessions > 0
              or d.recent_steps > 0 or d.burst_steps > 0}
    plan = _Plan([_view(w) for w in sorted(workers, key=lambda w: w.worker_id)], models, now, settings)
    plan.missing_copy_rule()
    if settings.burst_busy_share > 0:
        plan.burst_rule()
    if periodic:
        plan.long_queue_rule()
        if settings.retire_slow_copies:
            plan.retire_slow_copies()
    return plan.actions


def _view(state: WorkerState) -> _Worker:
    """The running view of a worker at the start of a plan."""
    installed = {m.model_id: m for m in state.installed}
    pending = {p.model_id: p.rung for p in state.loading}
    if state.free_mib is None:
        available = float("inf")
    else:
        spoken_for = sum(_needs(installed.get(model_id), rung) for model_id, rung in pending.items())
        available = state.free_mib - spoken_for
    loaded = {m.model_id: m for m in state.loaded if m.model_id not in state.unloading}
    copies = {model_id: m.rung for model_id, m in loaded.items()}
    copies.update(pending)
    untouchable = set(state.unloading)
    return _Worker(state, available, installed, loaded, copies, untouchable)


def _needs(installed: InstalledModel | None, rung: str) -> float:
    """What a rung of an installed model needs (a pending load of a model the worker no longer lists
    as installed is counted as needing nothing: its answer will report the memory)."""
    if installed is None:
        return 0.0
    return float(installed.needs_mib.get(rung, 0))


@dataclass
class _Choice:
    worker: _Worker
    rung: str
    unloads: list[LoadedModel]


class _Plan:
    """One planning run: the workers' running views, the demand and the actions so far."""

    def __init__(self, workers: list[_Worker], models: dict[str, ModelDemand], now: float,
                 settings: PlacementSettings) -> None:
        self.workers = workers
        self.models = models  # every model with work waiting or recent arrivals
        self.wanted = {m: d for m, d in models.items()  # those with work waiting
                       if d.queued_jobs > 0 or d.queued_steps > 0 or d.waiting_sessions > 0}
        self.now = now
        self.settings = settings
        self.actions: list[PlacementAction] = []
        # each model's size (its largest rung's needs) and the mean over the fleet's models, for _copy_share
        self.sizes = {m.model_id: max(m.needs_mib.values(), default=0) for w in workers for m in w.installed.values()}
        self.mean_size = sum(self.sizes.values()) / len(self.sizes) if self.sizes else 0.0

    # the missing-copy rule (every run) -------------------------------------------------------

    def missing_copy_rule(self) -> None:
        """Load at once each waiting model that has no copy (for sessions: no full copy, or every full
        copy's slots taken); sessions first, then the most steps. Unloads least recently used first."""
        order = sorted(self.wanted.values(), key=lambda d: (-d.waiting_sessions, -d.queued_steps, d.model_id))
        for d in order:
            if d.waiting_sessions > 0 and not self._copies(d.model_id, full_only=True):
                why = (f"{_count(d.waiting_sessions, 'session')} waiting and no copy on rung full"
                       + (f" ({self._copies_text(d.model_id)})" if self._copies(d.model_id) else ""))
                self._place(d.model_id, why, full_only=True, idle_only=False)
            if (d.queued_jobs > 0 or d.queued_steps > 0) and not self._copies(d.model_id):
                why = f"{_count(d.queued_jobs, 'job')} waiting ({d.queued_steps} steps) and no copy loaded"
                self._place(d.model_id, why, full_only=False, idle_only=False)
            self._more_full_for_sessions(d, idle_only=False)

    # extra copies: the long-queue, trend and burst rules -------------------------------------

    def long_queue_rule(self) -> None:
        """The long-queue rule, and the trend rule with it (periodic): add copies where queued work
        per copy exceeds the target wait, or where the recent arrivals would keep the copies busier
        than the model's `_copy_share` (the trend: a copy in place before the queue forms); one more
        full copy for sessions still waiting when every full copy is in place (its slots taken).
        Only idle copies make room."""
        by_wait = sorted(self.models.values(), key=lambda d: (-self._wait_seconds(d), d.model_id))
        placed = True
        while placed:  # again until none is short: a copy placed loads its worker, which another model counted
            placed = False
            for d in by_wait:
                while self._copies(d.model_id) and (why := self._short_of_copies(d)):
                    if not self._place(d.model_id, why, full_only=False, idle_only=True):
                        break
                    placed = True
        for d in by_wait:
            self._more_full_for_sessions(d, idle_only=True)

    def burst_rule(self) -> None:
        """One more copy, at once, of each model whose arrivals of the last burst_window_seconds
        would keep every copy's worker busier than burst_busy_share (a burst: a copy's worth of
        demand come within seconds), while none of its copies is loading (the one on its way is
        counted first). Busiest first."""
        share = self.settings.burst_busy_share
        busiest = sorted(((self._busy_share(d, burst=True), d) for d in self.models.values() if d.burst_steps > 0),
                         key=lambda pair: (-pair[0], pair[1].model_id))
        for busy, d in busiest:
            copies = self._copies(d.model_id)
            if busy <= share or not copies or any(d.model_id not in w.loaded for w in copies):
                continue
            why = (f"a burst: {d.burst_steps} steps came in the last {self.settings.burst_window_seconds:g} s: "
                   f"a job finds {self._copies_text(d.model_id)} busy {busy:.0%} of the time, above {share:.0%}")
            self._place(d.model_id, why, full_only=False, idle_only=True, burst=True)

    def retire_slow_copies(self) -> None:
        """Unload idle copies on a rung slower than `copy_max_step_factor` that their model can do
        without (a faster copy carries its work): the dispatcher sends a job to any free copy, and
        one there runs late for sure. Beyond the contract's long-queue rule (which unloads only for
        another model's memory), hence off unless `retire_slow_copies`."""
        for w in self.workers:
            for m in sorted(w.loaded.values(), key=lambda m: (m.last_used, m.model_id)):
                installed = w.installed.get(m.model_id)
                step_ms = installed.step_ms if installed and installed.step_ms else self.settings.default_step_ms
                if (m.busy or m.model_id in w.untouchable or w.state.draining
                        or (m.loaded_at is not None and self.now - m.loaded_at < self.settings.min_residency_seconds)
                        or self._factor(m.model_id, m.rung, step_ms) <= self.settings.copy_max_step_factor
                        or not any(o is not w and o.copies[m.model_id] == RUNG_FULL for o in self._copies(m.model_id))
                        or not self._surplus(w, m.model_id)):
                    continue
                del w.loaded[m.model_id]
                del w.copies[m.model_id]
                w.untouchable.add(m.model_id)
                w.available_mib += m.held_mib
                self.actions.append(PlacementAction(
                    UNLOAD, w.state.worker_id, m.model_id, None,
                    f"unload: a spare copy on {m.rung}, slower than a full copy elsewhere that carries its work"))

    def _short_of_copies(self, d: ModelDemand) -> str | None:
        """Why `d`'s model wants another copy now (the reason for the log), or None."""
        target = self._target_wait(d)
        if (wait := self._wait_seconds(d)) > target:
            return (f"{d.queued_steps} queued steps are {wait:,.1f} s of work over "
                    f"{self._copies_text(d.model_id)}, above the {target:g} s target wait")
        share = self._copy_share(d.model_id)
        if share > 0 and (busy := self._busy_share(d)) > share:
            return (f"{d.recent_steps} steps came in the last {self.settings.demand_window_seconds:g} s: "
                    f"a job finds {self._copies_text(d.model_id)} busy {busy:.0%} of the time, above {share:.0%}")
        return None

    def _copy_share(self, model_id: str) -> float:
        """The trend rule's share for `model_id`: copy_busy_share times the model's size over the mean
        size of the fleet's installed models (at most 1.0). Memory is what a copy costs: at 24 GiB
        workers a copy of an SD-1.5-sized model takes a quarter of an SD3-sized one's, so it is
        worth adding at a lower chance of finding every copy busy, and a large model's copy only at
        a higher one (docs/design/placement.md, "What a copy is worth")."""
        share = self.settings.copy_busy_share
        if share <= 0 or not self.mean_size or model_id not in self.sizes:
            return share
        return min(1.0, share * self.sizes[model_id] / self.mean_size)

    def _target_wait(self, d: ModelDemand) -> float:
        """The target wait for `d`'s model: PLACEMENT_TARGET_WAIT_SECONDS, or less when
        `target_wait_jobs` is set: that many of its queued jobs' standalone run on rung full (a job
        waiting longer than a few of its own runs is late whatever the fleet-wide target says)."""
        target = self.settings.target_wait_seconds
        if self.settings.target_wait_jobs > 0 and d.queued_jobs and d.queued_steps:
            step_ms = self._step_ms(d.model_id)
            target = min(target, self.settings.target_wait_jobs * d.queued_steps / d.queued_jobs * step_ms / 1000.0)
        return target

    def _step_ms(self, model_id: str) -> float:
        """The model's step on full as its workers measured it (the smallest), else the default."""
        measured = [m.step_ms for w in self.workers if (m := w.installed.get(model_id)) and m.step_ms]
        return min(measured) if measured else self.settings.default_step_ms

    def _more_full_for_sessions(self, d: ModelDemand, *, idle_only: bool) -> None:
        """One more full copy for sessions still waiting while every full copy is in place (a
        session waits only when no full copy has a free slot) and none is on its way."""
        full = self._copies(d.model_id, full_only=True)
        if d.waiting_sessions > 0 and full and not self._pending_full(d.model_id):
            why = (f"{_count(d.waiting_sessions, 'session')} still waiting with every slot of "
                   f"{_count(len(full), 'full copy', 'full copies')} taken")
            self._place(d.model_id, why, full_only=True, idle_only=idle_only)

    def _steps_per_second(self, model_id: str, *, without: _Worker | None = None) -> float:
        """What the copies of `model_id` can do together, in steps a second: each copy's step_ms
        (measured on full) times its rung's factor."""
        per_second = 0.0
        for w in self._copies(model_id):
            if w is without:
                continue
            installed = w.installed.get(model_id)
            step_ms = installed.step_ms if installed and installed.step_ms else self.settings.default_step_ms
            free = max(0.1, 1.0 - self._worker_load(w) + self._copy_load(w, model_id))
            per_second += free * 1000.0 / (step_ms * self._factor(model_id, w.copies[model_id], step_ms))
        return per_second

    def _factor(self, model_id: str, rung: str, step_ms: float) -> float:
        """How much slower than full a job of `model_id` runs on `rung`: the rung's step factor plus
        its fixed cost a job over the job's steps (the queued jobs' mean, else default_job_steps)."""
        d = self.models.get(model_id)
        steps = (d.queued_steps / d.queued_jobs if d and d.queued_jobs and d.queued_steps
                 else self.settings.default_job_steps)
        fixed = self.settings.rung_job_seconds.get(rung, 0.0) * 1000.0 / (max(steps, 1) * step_ms)
        return self.settings.rung_step_factor.get(rung, 1.0) + fixed

    def _rate(self, d: ModelDemand, *, burst: bool = False) -> float:
        """`d`'s model's arrivals in steps a second: over the demand window, or for the burst rule
        the higher of that and the burst window's."""
        rate = d.recent_steps / self.settings.demand_window_seconds
        if burst and self.settings.burst_window_seconds > 0:
            rate = max(rate, d.burst_steps / self.settings.burst_window_seconds)
        return rate

    def _copy_load(self, w: _Worker, model_id: str, *, burst: bool = False) -> float:
        """The share of `w`'s time the recent arrivals of `model_id` take, spread evenly over its copies."""
        d = self.models.get(model_id)
        if d is None or model_id not in w.copies or (rate := self._rate(d, burst=burst)) == 0:
            return 0.0
        installed = w.installed.get(model_id)
        step_ms = installed.step_ms if installed and installed.step_ms else self.settings.default_step_ms
        factor = self._factor(model_id, w.copies[model_id], step_ms)
        copies = max(1, len(self._copies(model_id)))
        return rate * step_ms * factor / 1000.0 / copies

    def _worker_load(self, w: _Worker, unloads: Sequence[LoadedModel] = (), *, burst: bool = False) -> float:
        """The share of `w`'s time its copies' recent arrivals take (less the models to be unloaded):
        a copy on a worker busy with other models' jobs runs fewer of its own, and its jobs wait."""
        gone = {m.model_id for m in unloads}
        return sum(self._copy_load(w, m, burst=burst) for m in w.copies if m not in gone)

    def _wait_seconds(self, d: ModelDemand, *, without: _Worker | None = None) -> float:
        """Queued steps over the copies' summed throughput: the contract's queued steps x step_ms /
        copies when the copies are alike and on rung full."""
        if d.queued_steps == 0:
            return 0.0
        per_second = self._steps_per_second(d.model_id, without=without)
        return float("inf") if per_second == 0 else d.queued_steps / per_second

    def _busy_share(self, d: ModelDemand, *, without: _Worker | None = None, burst: bool = False) -> float:
        """The chance that a job of `d`'s model finds every copy's worker busy (so it queues), from
        the recent arrivals (with `burst`, the burst window's rate where higher): the product over
        its copies of each worker's load (its copies' recent work, this model's spread over its
        copies), 1.0 with no copy. A job whose budget is a few times its own run cannot wait for
        another model's job to end, so this, not a copy's own utilisation, is what makes it late."""
        if self._rate(d, burst=burst) == 0:
            return 0.0
        copies = [w for w in self._copies(d.model_id) if w is not without]
        chance = 1.0
        for w in copies:
            spread = len(self._copies(d.model_id)) / len(copies)  # its share of the copy left out
            load = self._worker_load(w, burst=burst) + self._copy_load(w, d.model_id, burst=burst) * (spread - 1)
            chance *= min(1.0, load)
        return chance

    # choosing a worker ----------------------------------------------------------------------

    def _place(self, model_id: str, why: str, *, full_only: bool, idle_only: bool, burst: bool = False) -> bool:
        """Plan one new copy of `model_id` on the best worker that can take it; False when none can.
        With `burst`, spare copies give way too (see _evictable)."""
        choices = [c for w in self.workers for c in self._choices(w, model_id, full_only, idle_only, burst)]
        if not choices:
            return False
        best = min(choices, key=lambda c: (self._slow(model_id, c.rung), self._last_copies(c.unloads),
                                           RUNGS.index(c.rung), round(self._worker_load(c.worker, c.unloads), 2),
                                           _busy(c.worker), self._last_copies(c.unloads),
                                           len(c.unloads),
                                           -(c.worker.available_mib + sum(m.held_mib for m in c.unloads)
                                             - _needs(c.worker.installed[model_id], c.rung)),
                                           c.worker.state.worker_id))
        w = best.worker
        for m in best.unloads:
            self._unload(w, m, model_id, idle_only, burst)
        w.available_mib -= _needs(w.installed[model_id], best.rung)
        w.copies[model_id] = best.rung
        w.untouchable.add(model_id)
        self.actions.append(PlacementAction(LOAD, w.state.worker_id, model_id, best.rung, f"load: {why}"))
        return True

    def _choices(self, w: _Worker, model_id: str, full_only: bool, idle_only: bool,
                 burst: bool = False) -> list[_Choice]:
        """Each rung `w` can give `model_id` (with the unloads each takes), highest first; none when
        `w` may not or cannot take it."""
        installed = w.installed.get(model_id)
        if (installed is None or w.state.draining or model_id in w.copies or model_id in w.untouchable
                or self._backing_off(w, model_id)):
            return []
        spare = self._evictable(w, idle_only, burst)
        out = []
        for rung in (RUNG_FULL,) if full_only else RUNGS:
            if rung not in installed.needs_mib:
                continue
            step_ms = installed.step_ms or self.settings.default_step_ms
            if idle_only and self._factor(model_id, rung, step_ms) > self.settings.copy_max_step_factor:
                continue  # a copy for throughput on a rung this slow adds little and makes its jobs late
            short = installed.needs_mib[rung] - w.available_mib
            unloads: list[LoadedModel] = []
            for m in spare:
                if short <= 0:
                    break
                unloads.append(m)
                short -= m.held_mib
            if short <= 0:
                out.append(_Choice(w, rung, _needed(unloads, short)))
        return out

    def _slow(self, model_id: str, rung: str) -> bool:
        """A job of `model_id` on `rung` runs more than `copy_max_step_factor` times its run on full."""
        return self._factor(model_id, rung, self._step_ms(model_id)) > self.settings.copy_max_step_factor

    def _last_copies(self, unloads: list[LoadedModel]) -> int:
        """How many of these unloads take a model's last copy (its next job or session waits for a load)."""
        return sum(1 for m in unloads if self._ready(m.model_id) <= 1)

    def _backing_off(self, w: _Worker, model_id: str) -> bool:
        failed_at = w.state.failed_loads.get(model_id)
        return failed_at is not None and self.now - failed_at < self.settings.failed_load_backoff_seconds

    def _evictable(self, w: _Worker, idle_only: bool, burst: bool = False) -> list[LoadedModel]:
        """`w`'s models that may give way: not busy, not API-loaded within the minimum residency, not
        the last copy of a model work waits for, and for an extra copy (idle_only) idle for
        `idle_seconds` with no work waiting for it. For the burst rule also a spare copy however recently used
        (_surplus): a burst cannot wait for a copy to idle; a copy more for a trend or a queue can,
        and taking spare copies for those too made 27-41 % more loads for about the same
        attainment (docs/design/placement.md).

        The missing-copy rule takes them least recently used first (the contract's words). The
        long-queue, trend and burst rules take first the copies of the models with the most ready
        copies, then the least recently used: a model left with one copy is the one whose next
        arrivals want a copy back, so taking its second copy tends to cost a load again minutes later."""
        out = []
        for m in w.loaded.values():
            if m.busy or m.model_id in w.untouchable:
                continue
            if m.loaded_at is not None and self.now - m.loaded_at < self.settings.min_residency_seconds:
                continue
            if idle_only and burst and self._surplus(w, m.model_id):
                out.append(m)
                continue
            if idle_only and self.now - m.last_used < self.settings.idle_seconds:
                continue
            if m.model_id in self.wanted and (idle_only or self._ready(m.model_id) <= 1):
                continue
            out.append(m)
        if idle_only:
            return sorted(out, key=lambda m: (-self._ready(m.model_id), m.last_used, m.model_id))
        return sorted(out, key=lambda m: (m.last_used, m.model_id))

    def _surplus(self, w: _Worker, model_id: str) -> bool:
        """`w`'s copy of `model_id` is one its model can do without: another copy stays, and
        without this one neither its queued work nor its recent arrivals would want a copy back
        (so a burst may take it for another model however recently it ran, and retire_slow_copies
        may unload it)."""
        if self._ready(model_id) <= 1:
            return False
        d = self.models.get(model_id)
        if d is None:
            return True
        share = self._copy_share(model_id)  # half the thresholds: no copy taken that would be wanted back soon
        return (self._wait_seconds(d, without=w) <= self._target_wait(d) / 2
                and (share <= 0 or self._busy_share(d, without=w) <= share / 2)
                and not (d.waiting_sessions and w.copies[model_id] == RUNG_FULL))

    def _unload(self, w: _Worker, m: LoadedModel, for_model: str, idle_only: bool, burst: bool = False) -> None:
        spare = idle_only and burst and self._surplus(w, m.model_id)
        del w.loaded[m.model_id]
        del w.copies[m.model_id]
        w.untouchable.add(m.model_id)
        w.available_mib += m.held_mib
        idle = (f"a spare copy, last used {self.now - m.last_used:,.0f} s ago" if spare
                else f"idle {self.now - m.last_used:,.0f} s" if idle_only else
                f"least recently used, last used {self.now - m.last_used:,.0f} s ago")
        self.actions.append(PlacementAction(
            UNLOAD, w.state.worker_id, m.model_id, None,
            f"unload: frees {m.held_mib:,} MiB for {for_model} ({idle}, holds no job or session)"))

    # copies ---------------------------------------------------------------------------------

    def _copies(self, model_id: str, *, full_only: bool = False) -> list[_Worker]:
        """Workers taking work that hold `model_id` (loaded or loading, not being unloaded)."""
        return [w for w in self.workers if not w.state.draining and model_id in w.copies
                and (not full_only or w.copies[model_id] == RUNG_FULL)]

    def _ready(self, model_id: str) -> int:
        """How many copies of `model_id` are loaded (not loading) on workers taking work: a model's
        last ready copy is not taken while another is still on its way."""
        return sum(1 for w in self._copies(model_id) if model_id in w.loaded)

    def _pending_full(self, model_id: str) -> bool:
        """A full copy of `model_id` is on its way (sent earlier or planned now)."""
        return any(model_id not in w.loaded for w in self._copies(model_id, full_only=True))

    def _copies_text(self, model_id: str) -> str:
        copies = self._copies(model_id)
        return _count(len(copies), "copy", "copies") + (
            " on " + ", ".join(f"{w.state.worker_id} ({w.copies[model_id]})" for w in copies) if copies else "")


def _needed(unloads: list[LoadedModel], short: float) -> list[LoadedModel]:
    """The least recently used prefix that made room, less those it can do without (the most
    recently used first kept): a large model taken last may leave room for a small one taken before."""
    kept = list(unloads)
    for m in sorted(unloads[:-1], key=lambda m: (-m.last_used, m.model_id)):
        if short + m.held_mib <= 0:
            short += m.held_mib
            kept.remove(m)
    return kept


def _busy(w: _Worker) -> int:
    """How many of a worker's loaded models hold a job or a session now."""
    return sum(1 for m in w.state.loaded if m.busy)


def _count(n: int, one: str, many: str | None = None) -> str:
    """'1 job', '3 jobs'."""
    return f"{n} {one if n == 1 else (many or one + 's')}"
