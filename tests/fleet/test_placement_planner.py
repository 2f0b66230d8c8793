"""The placement planner (fleet/placement/planner.py): tables of cases for each rule and Hypothesis
properties over random fleets (memory, busy models, residency, back-off, a second plan adds nothing)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.placement.planner import InstalledModel as Installed
from fleet.placement.planner import (
    LoadedModel,
    ModelDemand,
    PendingLoad,
    PlacementAction,
    PlacementSettings,
    WorkerState,
    plan_placement,
)

NOW = 10_000.0
SD = Installed("sd", {"full": 2_700, "model_offload": 1_900, "group_offload": 1_400}, step_ms=30.0)
XL = Installed("xl", {"full": 9_800, "model_offload": 5_600, "group_offload": 3_400}, step_ms=75.0)
ANIME = Installed("anime", {"full": 2_700, "model_offload": 1_900, "group_offload": 1_400}, step_ms=30.0)
BIG = Installed("big", {"full": 10_000}, step_ms=80.0)
SMALL = Installed("small", {"full": 1_000}, step_ms=20.0)
ALL = (SD, XL, ANIME)


def held(model_id: str, *, rung: str = "full", mib: int = 2_700, busy: bool = False, last_used: float = NOW - 10,
         loaded_at: float | None = None) -> LoadedModel:
    return LoadedModel(model_id, rung, mib, busy, last_used, loaded_at)


def worker(worker_id: str, free_mib: int | None, *loaded: LoadedModel, installed=ALL, **kw) -> WorkerState:
    return WorkerState(worker_id, installed, loaded, free_mib, **kw)


def jobs(model_id: str, n: int = 3, steps: int = 30) -> ModelDemand:
    return ModelDemand(model_id, queued_jobs=n, queued_steps=n * steps)


def sessions(model_id: str, n: int = 1) -> ModelDemand:
    return ModelDemand(model_id, waiting_sessions=n)


def brief(actions: list[PlacementAction]) -> list[tuple[str, str, str, str | None]]:
    return [(a.kind, a.worker_id, a.model_id, a.rung) for a in actions]


EVENT_CASES = [
    pytest.param([jobs("sd")], [worker("w1", 3_000), worker("w2", 5_000)],
                 [("load", "w2", "sd", "full")], id="it-loads-a-model-no-worker-holds-on-the-worker-with-most-room"),
    pytest.param([jobs("sd")], [worker("w2", 5_000), worker("w1", 5_000)],
                 [("load", "w1", "sd", "full")], id="it-breaks-a-tie-by-worker-id"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, held("sd"))], [],
                 id="it-does-nothing-when-a-copy-is-loaded"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, loading=[PendingLoad("sd", "full")])], [],
                 id="it-counts-a-pending-load-as-a-copy"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, held("sd"), unloading=frozenset({"sd"})), worker("w2", 3_000)],
                 [("load", "w2", "sd", "full")], id="it-does-not-count-a-copy-being-unloaded"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, held("sd"), draining=True), worker("w2", 3_000)],
                 [("load", "w2", "sd", "full")], id="it-does-not-count-a-copy-on-a-draining-worker"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, draining=True)], [],
                 id="it-asks-no-draining-worker-to-load"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, installed=(XL,))], [],
                 id="it-asks-only-workers-that-have-the-model-installed"),
    pytest.param([jobs("sd")], [worker("w1", 2_000)], [("load", "w1", "sd", "model_offload")],
                 id="it-loads-a-job-model-on-the-highest-rung-that-fits"),
    pytest.param([jobs("sd")], [worker("w1", 1_000)], [],
                 id="it-leaves-jobs-waiting-when-no-rung-fits-and-nothing-can-give-way"),
    pytest.param([jobs("sd")], [worker("w1", 1_400), worker("w2", 3_000)], [("load", "w2", "sd", "full")],
                 id="it-prefers-the-worker-that-gives-the-higher-rung"),
    pytest.param([sessions("sd")], [worker("w1", 2_000)], [],
                 id="it-loads-a-session-model-only-on-rung-full"),
    pytest.param([ModelDemand("sd", queued_jobs=2, queued_steps=60, waiting_sessions=1)], [worker("w1", 2_000)],
                 [("load", "w1", "sd", "model_offload")],
                 id="it-still-loads-for-the-jobs-when-the-sessions-cannot-have-rung-full"),
    pytest.param([sessions("sd")], [worker("w1", 9_000, held("sd", rung="model_offload")), worker("w2", 3_000)],
                 [("load", "w2", "sd", "full")], id="it-loads-a-full-copy-when-sessions-wait-and-copies-are-offloaded"),
    pytest.param([jobs("sd")], [worker("w1", None)], [("load", "w1", "sd", "full")],
                 id="it-treats-a-worker-without-a-gpu-budget-as-unlimited"),
    pytest.param([jobs("sd")], [worker("w1", 500, held("xl", mib=9_800, last_used=NOW - 5),
                                       held("anime", last_used=NOW - 50))],
                 [("unload", "w1", "anime", None), ("load", "w1", "sd", "full")],
                 id="it-unloads-the-least-recently-used-model-first-idle-or-not"),
    pytest.param([jobs("xl")], [worker("w1", 500, held("sd", last_used=NOW - 50),
                                       held("big", mib=10_000, last_used=NOW - 20), installed=(SD, XL, BIG))],
                 [("unload", "w1", "big", None), ("load", "w1", "xl", "full")],
                 id="it-unloads-no-more-than-the-load-needs"),
    pytest.param([jobs("sd"), jobs("small", n=1)], [worker("w1", 500, held("anime"), installed=(SD, ANIME, SMALL))],
                 [("unload", "w1", "anime", None), ("load", "w1", "sd", "full")],
                 id="it-counts-the-unloads-and-loads-it-plans-against-the-memory"),
    pytest.param([jobs("sd")], [worker("w1", 500, held("anime", busy=True))], [],
                 id="it-never-unloads-a-model-holding-a-job-or-session"),
    pytest.param([jobs("sd")], [worker("w1", 500, held("anime", loaded_at=NOW - 30))], [],
                 id="it-keeps-an-api-loaded-model-for-its-minimum-residency"),
    pytest.param([jobs("sd")], [worker("w1", 500, held("anime", loaded_at=NOW - 61))],
                 [("unload", "w1", "anime", None), ("load", "w1", "sd", "full")],
                 id="it-unloads-an-api-loaded-model-after-its-minimum-residency"),
    pytest.param([jobs("sd"), jobs("anime")], [worker("w1", 500, held("anime"))], [],
                 id="it-does-not-unload-the-last-copy-of-a-model-with-work-waiting"),
    pytest.param([jobs("sd"), jobs("anime")], [worker("w1", 500, held("anime")), worker("w2", 0, held("anime"))],
                 [("unload", "w1", "anime", None), ("load", "w1", "sd", "full")],
                 id="it-may-unload-one-of-two-copies-of-a-model-with-work-waiting"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, failed_loads={"sd": NOW - 30}), worker("w2", 2_000)],
                 [("load", "w2", "sd", "model_offload")], id="it-backs-off-a-worker-whose-load-failed"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, failed_loads={"sd": NOW - 60})],
                 [("load", "w1", "sd", "full")], id="it-asks-again-after-the-back-off"),
    pytest.param([jobs("sd")], [worker("w1", 9_000, failed_loads={"xl": NOW - 1})],
                 [("load", "w1", "sd", "full")], id="it-backs-off-only-the-model-that-failed"),
    pytest.param([jobs("sd"), jobs("anime")], [worker("w1", 6_000, loading=[PendingLoad("xl", "group_offload")])],
                 [("load", "w1", "anime", "model_offload")],
                 id="it-counts-pending-and-planned-loads-against-free-memory"),
    pytest.param([ModelDemand("sd", queued_jobs=1, queued_steps=20), sessions("anime")], [worker("w1", 3_000)],
                 [("load", "w1", "anime", "full")], id="it-serves-waiting-sessions-first"),
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)], [],
                 id="it-adds-no-second-copy-on-an-event"),
    pytest.param([jobs("sd"), jobs("anime")], [worker("w1", 500, held("anime")),
                                               worker("w2", 0, loading=[PendingLoad("anime", "full")])], [],
                 id="it-does-not-take-a-models-last-ready-copy-while-another-is-loading"),
    pytest.param([jobs("xl")], [worker("w1", 7_500, held("sd"))], [("load", "w1", "xl", "model_offload")],
                 id="it-takes-a-lower-rung-that-is-fast-enough-before-a-models-last-copy"),
    pytest.param([jobs("xl")], [worker("w1", 7_500, held("sd")), worker("w3", 0, held("sd"))],
                 [("unload", "w1", "sd", None), ("load", "w1", "xl", "full")],
                 id="it-takes-a-copy-that-is-not-the-last-for-rung-full"),
    pytest.param([sessions("sd")], [worker("w1", 0, held("sd")), worker("w2", 3_000)],
                 [("load", "w2", "sd", "full")],
                 id="it-adds-a-full-copy-at-once-for-a-session-waiting-with-every-slot-taken"),
    pytest.param([sessions("sd")], [worker("w1", 0, held("sd")),
                                    worker("w2", 3_000, loading=[PendingLoad("sd", "full")])],
                 [], id="it-waits-on-an-event-for-a-full-copy-on-its-way"),
    pytest.param([jobs("sd")], [worker("w1", 500, held("anime", last_used=NOW - 50)),
                                worker("w2", 500, held("xl", mib=9_800, last_used=NOW - 50)),
                                worker("w3", 0, held("anime", busy=True))],
                 [("unload", "w1", "anime", None), ("load", "w1", "sd", "full")],
                 id="it-prefers-a-worker-whose-unloads-leave-every-model-a-copy"),
]


@pytest.mark.parametrize("demand, workers, expected", EVENT_CASES)
def test_it_plans_on_an_event_by_the_missing_copy_rule(demand, workers, expected):
    assert brief(plan_placement(demand, workers, now=NOW)) == expected


PERIODIC_CASES = [
    # 50 jobs x 30 steps x 75 ms = 112.5 s on one copy: copies until at most 30 s each (4 copies)
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800))]
                 + [worker(f"w{n}", 20_000) for n in (2, 3, 4, 5)],
                 [("load", "w2", "xl", "full"), ("load", "w3", "xl", "full"), ("load", "w4", "xl", "full")],
                 id="it-adds-copies-until-queued-work-per-copy-is-within-the-target-wait"),
    pytest.param([jobs("xl", n=10)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)], [],
                 id="it-adds-no-copy-while-work-per-copy-is-within-the-target-wait"),
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 1_000, held("sd", last_used=NOW - 299))], [],
                 id="it-unloads-for-another-copy-only-models-idle-for-the-idle-seconds"),
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 3_000, held("sd", last_used=NOW - 300))],
                 [("unload", "w2", "sd", None), ("load", "w2", "xl", "model_offload")],
                 id="it-unloads-an-idle-copy-when-its-memory-is-wanted"),
    # group offload's step is 3.7x full's: a copy there for throughput makes every job on it late
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 3_500)], [],
                 id="it-adds-no-copy-for-throughput-on-a-rung-slower-than-copy-max-step-factor"),
    # 10 jobs x 30 steps x 75 ms = 22.5 s on full, within 30 s; on group offload 3.7x that
    pytest.param([jobs("xl", n=10)], [worker("w1", 0, held("xl", rung="group_offload", mib=3_400)),
                                      worker("w2", 20_000)],
                 [("load", "w2", "xl", "full")], id="it-counts-a-copy-on-a-slower-rung-for-less"),
    # 700 steps in the last 60 s x 75 ms: the one copy's worker busy 87.5 % of the time, above xl's
    # share of the chance of finding every copy busy (40 % x 9,800 MiB over the fleet's mean model,
    # 5,067 MiB: 77 %); two copies: 44 % each, 19 % both
    pytest.param([ModelDemand("xl", recent_steps=700)],
                 [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000), worker("w3", 20_000)],
                 [("load", "w2", "xl", "full")],
                 id="it-adds-a-copy-from-the-trend-before-a-queue-forms"),
    pytest.param([ModelDemand("xl", recent_steps=100)],
                 [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)], [],
                 id="it-adds-no-copy-while-the-trend-keeps-its-copies-mostly-free"),
    pytest.param([ModelDemand("xl", recent_steps=700)],
                 [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000, held("sd", mib=2_700)),
                  worker("w3", 20_000, held("anime", mib=2_700))],
                 [("load", "w2", "xl", "full")],
                 id="it-puts-a-copy-on-the-worker-least-busy-with-other-models-recent-work"),
    pytest.param([ModelDemand("xl", recent_steps=700), ModelDemand("anime", recent_steps=1_500)],
                 [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000, held("anime")),
                  worker("w3", 20_000, held("anime")), worker("w4", 20_000)],
                 [("load", "w4", "xl", "full")],
                 id="it-puts-a-copy-where-other-models-recent-work-leaves-room"),
    # sd's copy on w2 is one sd can do without (w3 holds another), but it ran 5 s ago: only a burst
    # may take it; a queue waits for it to idle, and takes the rung that fits meanwhile
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 7_500, held("sd", last_used=NOW - 5)),
                                      worker("w3", 0, held("sd", busy=True))],
                 [("load", "w2", "xl", "model_offload")],
                 id="it-takes-no-recently-used-spare-copy-for-a-queue"),
    pytest.param([jobs("xl", n=50)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 3_000, held("sd", last_used=NOW - 5)),
                                      worker("w3", 0, held("sd", busy=True))], [],
                 id="it-adds-no-copy-for-a-queue-where-only-a-recently-used-copy-would-make-room"),
    pytest.param([], [worker("w1", 0, held("sd", last_used=0.0))], [],
                 id="it-unloads-nothing-when-no-other-model-wants-the-memory"),
    pytest.param([sessions("sd", 2)], [worker("w1", 0, held("sd")), worker("w2", 3_000)],
                 [("load", "w2", "sd", "full")], id="it-adds-a-full-copy-for-sessions-still-waiting"),
    pytest.param([sessions("sd", 2)], [worker("w1", 3_000, held("sd")),
                                       worker("w2", 3_000, loading=[PendingLoad("sd", "full")])], [],
                 id="it-waits-for-a-pending-full-copy-before-adding-another-for-sessions"),
    pytest.param([jobs("sd")], [worker("w1", 3_000)], [("load", "w1", "sd", "full")],
                 id="it-applies-the-missing-copy-rule-on-a-periodic-run-too"),
]


@pytest.mark.parametrize("demand, workers, expected", PERIODIC_CASES)
def test_it_plans_periodically_by_the_long_queue_and_trend_rules_too(demand, workers, expected):
    assert brief(plan_placement(demand, workers, now=NOW, periodic=True)) == expected


def test_it_adds_a_copy_of_a_small_model_sooner_than_of_a_large_one():
    # Both models' recent arrivals keep their one copy's worker busy half the time. The trend
    # rule's share is priced by memory: 40 % x size / the fleet's mean model (5,067 MiB): sd's
    # 2,700 MiB copy is worth adding above 21 %, xl's 9,800 MiB one only above 77 %.
    fleet = [worker("w1", 0, held("sd")), worker("w2", 0, held("xl", mib=9_800)), worker("w3", 20_000)]
    half = [ModelDemand("sd", recent_steps=1_000), ModelDemand("xl", recent_steps=400)]

    (load,) = plan_placement(half, fleet, now=NOW, periodic=True)

    assert brief([load]) == [("load", "w3", "sd", "full")]
    assert load.reason.endswith("busy 50% of the time, above 21%")
    # xl's own share, 77 %: 600 steps (its copy busy 75 %) add nothing, 700 (87.5 %) a copy
    assert plan_placement([ModelDemand("xl", recent_steps=600)], fleet, now=NOW, periodic=True) == []
    (xl,) = plan_placement([ModelDemand("xl", recent_steps=700)], fleet, now=NOW, periodic=True)
    assert brief([xl]) == [("load", "w3", "xl", "full")]
    assert xl.reason.endswith("busy 88% of the time, above 77%")


def idle_pair(**kw) -> list[WorkerState]:
    """w2's two idle copies: sd (also on w3) and anime (its only copy, used longer ago); either
    makes room for xl on model_offload."""
    return [worker("w2", 3_000, held("sd", last_used=NOW - 400), held("anime", last_used=NOW - 500)),
            worker("w3", 0, held("sd", busy=True))] + [worker("w1", 0, held("xl", mib=9_800))] * kw.get("xl", 1)


def test_it_takes_a_copy_of_the_model_with_most_copies_first_for_the_long_queue_rule():
    assert brief(plan_placement([jobs("xl", n=50)], idle_pair(), now=NOW, periodic=True)) == [
        ("unload", "w2", "sd", None), ("load", "w2", "xl", "model_offload")]


def test_it_takes_the_least_recently_used_model_first_for_the_missing_copy_rule():
    assert brief(plan_placement([jobs("xl")], idle_pair(xl=0), now=NOW)) == [
        ("unload", "w2", "anime", None), ("load", "w2", "xl", "model_offload")]


def test_it_counts_the_target_wait_in_the_jobs_own_runs_when_told():
    # 3 jobs x 30 steps x 75 ms = 6.75 s of work on one copy: within 30 s, above 2 runs of 2.25 s
    fleet = [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)]

    assert plan_placement([jobs("xl", n=3)], fleet, now=NOW, periodic=True) == []
    tuned = plan_placement([jobs("xl", n=3)], fleet, now=NOW, periodic=True,
                           settings=PlacementSettings(target_wait_jobs=2.0))
    assert brief(tuned) == [("load", "w2", "xl", "full")]
    assert "above the 4.5 s target wait" in tuned[0].reason


RETIRE = PlacementSettings(retire_slow_copies=True)


def test_it_retires_a_spare_copy_on_a_slow_rung_only_when_told():
    fleet = [worker("w1", 0, held("xl", mib=9_800)),
             worker("w2", 0, held("xl", rung="group_offload", mib=3_400, last_used=NOW - 5))]

    assert plan_placement([], fleet, now=NOW, periodic=True) == []
    assert brief(plan_placement([], fleet, now=NOW, periodic=True, settings=RETIRE)) == [("unload", "w2", "xl", None)]
    assert plan_placement([], fleet, now=NOW, settings=RETIRE) == []  # on a periodic run only


@pytest.mark.parametrize("fleet", [
    pytest.param([worker("w1", 0, held("xl", rung="model_offload", mib=5_600)),
                  worker("w2", 0, held("xl", rung="group_offload", mib=3_400))], id="no-full-copy-elsewhere"),
    pytest.param([worker("w1", 0, held("xl", mib=9_800)),
                  worker("w2", 0, held("xl", rung="group_offload", mib=3_400, busy=True))], id="busy"),
    pytest.param([worker("w1", 0, held("xl", mib=9_800)),
                  worker("w2", 0, held("xl", rung="group_offload", mib=3_400, loaded_at=NOW - 30))],
                 id="within-its-minimum-residency"),
])
def test_it_retires_no_slow_copy_that_is_busy_recent_or_the_fastest_left(fleet):
    assert plan_placement([], fleet, now=NOW, periodic=True, settings=RETIRE) == []


def test_it_retires_no_slow_copy_its_models_work_still_wants():
    fleet = [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 0, held("xl", rung="group_offload", mib=3_400))]

    assert plan_placement([jobs("xl", n=30)], fleet, now=NOW, periodic=True, settings=RETIRE) == []


def burst(model_id: str, steps: int) -> ModelDemand:
    return ModelDemand(model_id, burst_steps=steps)


# 132 steps in the last 10 s x 75 ms: the one copy's worker busy 99 % of the time, above 95 %
BURST_CASES = [
    pytest.param([burst("xl", 132)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)],
                 [("load", "w2", "xl", "full")], id="it-adds-a-copy-at-once-for-a-burst"),
    pytest.param([burst("xl", 80)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)], [],
                 id="it-adds-no-copy-for-a-few-jobs-within-the-share"),
    pytest.param([burst("xl", 240)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 10_000, loading=[PendingLoad("xl", "full")]),
                                      worker("w3", 20_000)], [],
                 id="it-waits-for-the-copy-on-its-way-before-adding-another"),
    pytest.param([burst("xl", 132)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 0, held("sd", last_used=NOW - 5))], [],
                 id="it-takes-no-memory-from-a-models-only-copy-in-use"),
    pytest.param([burst("xl", 132)], [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 4_000)], [],
                 id="it-adds-no-copy-on-a-rung-slower-than-copy-max-step-factor"),
    pytest.param([burst("xl", 132)], [worker("w1", 0), worker("w2", 20_000)], [],
                 id="it-leaves-a-model-with-no-copy-and-no-queue-to-the-missing-copy-rule"),
    pytest.param([burst("xl", 132)], [worker("w1", 0, held("xl", mib=9_800)),
                                      worker("w2", 7_500, held("sd", last_used=NOW - 5)),
                                      worker("w3", 0, held("sd", busy=True))],
                 [("unload", "w2", "sd", None), ("load", "w2", "xl", "full")],
                 id="it-takes-a-spare-copy-however-recently-used"),
    pytest.param([burst("xl", 132), ModelDemand("sd", recent_steps=3_000)],
                 [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 7_500, held("sd", last_used=NOW - 5)),
                  worker("w3", 0, held("sd", busy=True))], [("load", "w2", "xl", "model_offload")],
                 id="it-keeps-a-second-copy-its-models-trend-wants-and-takes-a-lower-rung"),
]


@pytest.mark.parametrize("demand, workers, expected", BURST_CASES)
@pytest.mark.parametrize("periodic", [False, True], ids=["event", "periodic"])
def test_it_plans_for_a_burst_on_every_run(demand, workers, expected, periodic):
    actions = plan_placement(demand, workers, now=NOW, periodic=periodic)
    assert brief(actions) == expected
    assert all("a burst: " in a.reason for a in actions if a.kind == "load")


def test_it_plans_nothing_for_a_burst_when_the_burst_rule_is_off():
    fleet = [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)]
    off = PlacementSettings(burst_busy_share=0.0)

    assert plan_placement([burst("xl", 600)], fleet, now=NOW, settings=off) == []
    assert brief(plan_placement([burst("xl", 600)], fleet, now=NOW)) == [("load", "w2", "xl", "full")]


def test_it_says_why_a_burst_loads():
    fleet = [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 20_000)]

    (load,) = plan_placement([burst("xl", 132)], fleet, now=NOW)

    assert load.reason == ("load: a burst: 132 steps came in the last 10 s: a job finds 1 copy on w1 (full) "
                           "busy 99% of the time, above 95%")


def test_it_says_a_burst_took_a_spare_copy():
    fleet = [worker("w1", 0, held("xl", mib=9_800)), worker("w2", 7_500, held("sd", last_used=NOW - 5)),
             worker("w3", 0, held("sd", busy=True))]

    unload, _ = plan_placement([burst("xl", 132)], fleet, now=NOW)

    assert unload.reason == ("unload: frees 2,700 MiB for xl (a spare copy, last used 5 s ago, "
                             "holds no job or session)")


def test_it_uses_the_default_step_time_until_a_step_is_measured():
    unmeasured = replace(XL, step_ms=None)
    fleet = [worker("w1", 0, held("xl", mib=9_800), installed=(unmeasured,)),
             worker("w2", 20_000, installed=(unmeasured,))]
    slow = PlacementSettings(default_step_ms=75.0)

    assert brief(plan_placement([jobs("xl", n=50)], fleet, now=NOW, periodic=True, settings=slow)) == [
        ("load", "w2", "xl", "full")]
    assert plan_placement([jobs("xl", n=50)], fleet, now=NOW, periodic=True,
                          settings=PlacementSettings(default_step_ms=10.0)) == []


def test_it_says_why_in_words():
    fleet = [worker("w1", 500, held("anime", last_used=NOW - 42))]

    unload, load = plan_placement([jobs("sd", n=3)], fleet, now=NOW)

    assert load.reason == "load: 3 jobs waiting (90 steps) and no copy loaded"
    assert unload.reason == ("unload: frees 2,700 MiB for sd (least recently used, last used 42 s ago, "
                             "holds no job or session)")


# properties ----------------------------------------------------------------------------------

MODELS = ("m0", "m1", "m2", "m3", "m4")
BACKOFF = PlacementSettings().failed_load_backoff_seconds
RESIDENCY = PlacementSettings().min_residency_seconds


@st.composite
def installed_model(draw, model_id: str) -> Installed:
    group = draw(st.integers(1, 4_000))
    offload = group + draw(st.integers(0, 4_000))
    rungs = {"full": offload + draw(st.integers(0, 8_000)), "model_offload": offload, "group_offload": group}
    allowed = draw(st.sets(st.sampled_from(sorted(rungs)), min_size=1))
    step_ms = draw(st.one_of(st.none(), st.floats(5.0, 200.0)))
    return Installed(model_id, {r: n for r, n in rungs.items() if r in allowed}, step_ms)


@st.composite
def worker_state(draw, worker_id: str, catalogue: dict[str, Installed], crowded: bool) -> WorkerState:
    installed = [catalogue[m] for m in sorted(draw(st.sets(st.sampled_from(MODELS), min_size=2)))]
    loaded, loading = [], []
    for m in installed:
        what = draw(st.sampled_from(("none", "none", "loaded", "loaded", "loading")))
        rung = draw(st.sampled_from(sorted(m.needs_mib)))
        if what == "loaded":
            loaded.append(LoadedModel(m.model_id, rung, m.needs_mib[rung], draw(st.booleans()),
                                      draw(st.floats(NOW - 1_000, NOW)),
                                      draw(st.one_of(st.none(), st.floats(NOW - 200, NOW)))))
        elif what == "loading":
            loading.append(PendingLoad(m.model_id, rung))
    unloading = draw(st.sets(st.sampled_from([m.model_id for m in loaded]), max_size=1)) if loaded else set()
    failed = draw(st.dictionaries(st.sampled_from(MODELS), st.floats(NOW - 120, NOW), max_size=1))
    short, any_free = st.integers(0, 500), st.integers(0, 30_000)
    free = draw(short if crowded else st.one_of(st.none(), short, any_free))
    return WorkerState(worker_id, tuple(installed), tuple(loaded), free, tuple(loading), frozenset(unloading),
                       failed, draw(st.sampled_from((False, False, False, True))))


@st.composite
def fleets(draw) -> list[WorkerState]:
    """1-5 workers sharing one catalogue (a model needs the same everywhere), each with some of it
    installed, loaded or loading; in a crowded fleet every worker is short of memory (so loads
    need unloads)."""
    catalogue = {m: draw(installed_model(m)) for m in MODELS}
    crowded = draw(st.booleans())
    return [draw(worker_state(f"w{i}", catalogue, crowded)) for i in range(draw(st.integers(1, 5)))]


demands = st.lists(st.builds(ModelDemand, st.sampled_from(MODELS), st.integers(0, 60), st.integers(0, 3_000),
                             st.integers(0, 4), st.integers(0, 3_000), st.integers(0, 1_000)),
                   max_size=5, unique_by=lambda d: d.model_id)
# the defaults, the settings the bench tunes for a 3x SLO (with the opt-in retire), and the contract's rules alone
TUNINGS = (PlacementSettings(), PlacementSettings(target_wait_jobs=1.0, retire_slow_copies=True),
           PlacementSettings(burst_busy_share=0.0, copy_busy_share=0.0))
plans = st.tuples(demands, fleets(), st.booleans(), st.sampled_from(TUNINGS))


def memory_left(w: WorkerState, actions: list[PlacementAction]) -> float:
    installed = {m.model_id: m for m in w.installed}
    held_mib = {m.model_id: m.held_mib for m in w.loaded}
    assert w.free_mib is not None
    left = float(w.free_mib) - sum(installed[p.model_id].needs_mib[p.rung] for p in w.loading)
    for a in actions:
        if a.worker_id == w.worker_id:
            assert a.kind == "load" or a.rung is None
            left += held_mib[a.model_id] if a.kind == "unload" else -installed[a.model_id].needs_mib[a.rung or ""]
    return left


@settings(max_examples=300, deadline=None)
@given(plans)
def test_it_never_plans_past_reported_free_memory(plan):
    demand, fleet, periodic, tuning = plan
    actions = plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning)
    for w in fleet:
        # a worker already past its memory (pending loads above its free) may still be given unloads
        if w.free_mib is not None and any(a.worker_id == w.worker_id and a.kind == "load" for a in actions):
            assert memory_left(w, actions) >= 0


@settings(max_examples=300, deadline=None)
@given(plans)
def test_it_never_unloads_a_busy_model_nor_one_within_its_minimum_residency(plan):
    demand, fleet, periodic, tuning = plan
    by_id = {w.worker_id: w for w in fleet}
    for a in plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning):
        if a.kind == "unload":
            m = next(m for m in by_id[a.worker_id].loaded if m.model_id == a.model_id)
            assert not m.busy
            assert m.loaded_at is None or NOW - m.loaded_at >= RESIDENCY
            assert a.model_id not in by_id[a.worker_id].unloading


@settings(max_examples=300, deadline=None)
@given(plans)
def test_it_never_acts_twice_on_one_model_of_a_worker_in_one_plan(plan):
    demand, fleet, periodic, tuning = plan
    actions = plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning)
    pairs = [(a.worker_id, a.model_id) for a in actions]
    assert len(pairs) == len(set(pairs))


@settings(max_examples=300, deadline=None)
@given(plans)
def test_it_never_asks_a_worker_in_back_off_draining_or_without_the_model(plan):
    demand, fleet, periodic, tuning = plan
    by_id = {w.worker_id: w for w in fleet}
    wanted = {d.model_id: d for d in demand}
    for a in plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning):
        if a.kind == "load":
            w = by_id[a.worker_id]
            assert not w.draining
            assert NOW - w.failed_loads.get(a.model_id, -1e9) >= BACKOFF
            installed = next(m for m in w.installed if m.model_id == a.model_id)
            assert a.rung in installed.needs_mib
            assert a.model_id in wanted
            d = wanted[a.model_id]
            if d.waiting_sessions and not (d.queued_jobs or d.queued_steps):
                assert a.rung == "full"


def applied(fleet: list[WorkerState], actions: list[PlacementAction]) -> list[WorkerState]:
    """The fleet once the actions are sent and not yet answered."""
    out = []
    for w in fleet:
        mine = [a for a in actions if a.worker_id == w.worker_id]
        loading = tuple(w.loading) + tuple(PendingLoad(a.model_id, a.rung or "") for a in mine if a.kind == "load")
        unloading = w.unloading | {a.model_id for a in mine if a.kind == "unload"}
        out.append(replace(w, loading=loading, unloading=frozenset(unloading)))
    return out


@settings(max_examples=300, deadline=None)
@given(plans)
def test_it_adds_no_load_when_planning_again_with_its_actions_applied(plan):
    demand, fleet, periodic, tuning = plan
    first = plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning)
    again = plan_placement(demand, applied(fleet, first), now=NOW, periodic=periodic, settings=tuning)
    assert [a for a in again if a.kind == "load"] == []


@settings(max_examples=200, deadline=None)
@given(plans)
def test_it_plans_the_same_whatever_the_order_of_its_inputs(plan):
    demand, fleet, periodic, tuning = plan
    assert plan_placement(demand, fleet, now=NOW, periodic=periodic, settings=tuning) == plan_placement(
        list(reversed(demand)), list(reversed(fleet)), now=NOW, periodic=periodic, settings=tuning)
