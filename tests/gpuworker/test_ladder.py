"""The memory ladder's decisions (pure): tables of (footprints, free memory, mode) -> rung."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuworker.ladder import (
    GROUP_RESIDENT_BLOCKS,
    MIB,
    RAM_RESERVE_BYTES,
    RUNGS,
    VAE_LIVE_TENSORS,
    WORKING_FLOOR_BYTES,
    ComponentFootprint,
    Footprint,
    choose_rung,
    group_offload_to_disk,
    plan_rungs,
    rung_after_oom,
    working_bytes,
    working_parts,
)

GIB = 1024 * MIB


def model(model_id: str, *, text: float, unet: float, vae: float, working: float,
          unet_top: float = 0.0, unet_block: float = 0.0) -> Footprint:
    """A footprint in GiB: three components, the UNet with its top-level group and largest block."""
    return Footprint(model_id=model_id, working_bytes=int(working * GIB), components=(
        ComponentFootprint("text_encoder", int(text * GIB), top_level_bytes=int(text * GIB)),
        ComponentFootprint("unet", int(unet * GIB), int(unet_top * GIB), int(unet_block * GIB)),
        ComponentFootprint("vae", int(vae * GIB), top_level_bytes=int(vae * GIB))))


# GiB needed: full 2.5 (weights 2 + working 0.5), model_offload 2.0 (unet 1.5 + working),
# group_offload 1.2 (unet's top-level group 0.1 + 2 blocks of 0.3 + working)
SD = model("sd", text=0.25, unet=1.5, vae=0.25, working=0.5, unet_top=0.1, unet_block=0.3)
SMALL = model("small", text=0.05, unet=0.3, vae=0.05, working=0.1, unet_top=0.05, unet_block=0.1)  # 0.5 / 0.4 / 0.35
BIG = model("big", text=2.0, unet=10.0, vae=0.5, working=1.5, unet_top=0.5, unet_block=1.0)  # 14 / 11.5 / 4


def test_a_footprint_adds_up_what_each_rung_needs() -> None:
    assert SD.weights_bytes == 2 * GIB and SD.largest_component_bytes == int(1.5 * GIB)
    assert SD.largest_group_bytes == int(0.3 * GIB)
    assert [SD.needs(rung) / GIB for rung in RUNGS] == pytest.approx([2.5, 2.0, 1.2], abs=1e-6)
    assert [SD.resident_bytes(rung) for rung in RUNGS] == [2 * GIB, 0, 0]


def test_a_group_peak_is_capped_by_the_component_itself() -> None:
    whole = ComponentFootprint("unet", 100, top_level_bytes=60, largest_group_bytes=30)

    assert whole.group_peak_bytes == 100  # 60 + 2 x 30 = 120 is more than the component
    assert ComponentFootprint("unet", 100, 10, 20).group_peak_bytes == 10 + GROUP_RESIDENT_BLOCKS * 20


@pytest.mark.parametrize(("free_gib", "mode", "rung"), [
    (80.0, "auto", "full"),
    (2.5, "auto", "full"),  # exactly enough
    (2.49, "auto", "model_offload"),
    (2.0, "auto", "model_offload"),
    (1.99, "auto", "group_offload"),
    (1.2, "auto", "group_offload"),
    (1.19, "auto", None),  # fits nowhere
    (80.0, "full", "full"),
    (2.0, "full", None),  # a pinned rung never moves down
    (80.0, "model_offload", "model_offload"),  # nor up
    (1.99, "model_offload", None),
    (80.0, "group_offload", "group_offload"),
    (1.19, "group_offload", None),
])
def test_it_picks_the_highest_rung_the_mode_allows_that_fits(free_gib: float, mode: str, rung: str | None) -> None:
    choice = choose_rung(SD, free_bytes=int(free_gib * GIB), mode=mode)

    assert choice.rung == rung
    assert choice.served == (rung is not None)


def test_it_says_why_in_figures() -> None:
    chosen = choose_rung(SD, free_bytes=int(2.2 * GIB))
    refused = choose_rung(SD, free_bytes=GIB, mode="full")

    assert chosen.reason == ("rung model_offload: 2,253 MiB free; full needs 2,560 MiB, "
                             "model_offload needs 2,048 MiB")
    assert refused.reason == "fits on no rung (pinned by MEMORY_MODE=full): 1,024 MiB free; full needs 2,560 MiB"


@pytest.mark.parametrize(("mode", "rung"), [("auto", "full"), ("full", "full"), ("model_offload", "model_offload"),
                                            ("group_offload", "group_offload")])
def test_without_a_vram_figure_auto_runs_as_full_and_a_pin_is_kept(mode: str, rung: str) -> None:
    choice = choose_rung(BIG, free_bytes=None, mode=mode)

    assert choice.rung == rung and choice.free_bytes is None


def test_one_worker_keeps_a_small_model_resident_while_a_large_one_uses_offload() -> None:
    small_first = plan_rungs([SMALL, BIG], free_bytes=12 * GIB)
    big_first = plan_rungs([BIG, SMALL], free_bytes=12 * GIB)

    assert [c.rung for c in small_first] == ["full", "model_offload"]  # 0.4 resident + 11.5 <= 12
    assert [c.rung for c in big_first] == ["model_offload", "full"]
    assert small_first[1].needs == {"full": 14 * GIB, "model_offload": int(11.5 * GIB)}


@pytest.mark.parametrize(("free_gib", "rungs"), [
    (40.0, ["full", "full", "full"]),
    (5.5, ["full", "full", "group_offload"]),  # 1.5 left beside two resident: only group offload's 1.2
    (4.0, ["full", "model_offload", "model_offload"]),  # 2.0 left: one offloaded model runs at a time
    (2.5, ["full", None, None]),  # 0.5 left beside one resident: too little for any rung
    (2.0, ["model_offload", "model_offload", "model_offload"]),  # nothing resident, transients shared
    (1.0, [None, None, None]),
])
def test_resident_weights_leave_the_budget_and_transients_are_shared(free_gib: float, rungs: list[str | None]) -> None:
    sds = [Footprint(f"sd-{n}", SD.components, SD.working_bytes) for n in range(3)]

    assert [c.rung for c in plan_rungs(sds, free_bytes=int(free_gib * GIB))] == rungs


def test_a_model_placed_later_leaves_room_for_the_working_memory_of_those_before() -> None:
    hungry = Footprint("hungry", SMALL.components, working_bytes=3 * GIB)  # full: 0.4 resident + 3 working

    # After hungry (0.4 resident), SMALL on full needs 0.4 + max(3 of hungry's, 0.1 of its own) = 3.4.
    assert [c.rung for c in plan_rungs([hungry, SMALL], free_bytes=4 * GIB)] == ["full", "full"]
    assert [c.rung for c in plan_rungs([hungry, SMALL], free_bytes=int(3.6 * GIB))] == ["full", "model_offload"]


@pytest.mark.parametrize(("rung", "mode", "after"), [
    ("full", "auto", "model_offload"),
    ("model_offload", "auto", "group_offload"),
    ("group_offload", "auto", None),  # the lowest: the job fails
    ("full", "full", None),  # pinned: the job fails, the model stays
    ("model_offload", "model_offload", None),
    ("group_offload", "group_offload", None),
])
def test_an_out_of_memory_error_moves_one_rung_down_only_under_auto(rung: str, mode: str, after: str | None) -> None:
    assert rung_after_oom(rung, mode) == after


def test_it_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="MEMORY_MODE must be one of auto, full, model_offload, group_offload"):
        choose_rung(SD, free_bytes=GIB, mode="tiny")


@pytest.mark.parametrize(("weights", "ram", "to_disk"), [
    (2 * GIB, None, False),  # no RAM figure: keep the groups in RAM
    (2 * GIB, 2 * GIB + RAM_RESERVE_BYTES, False),
    (2 * GIB, 2 * GIB + RAM_RESERVE_BYTES - 1, True),
    (2 * GIB, GIB, True),
])
def test_offloaded_groups_go_to_disk_when_ram_is_too_short(weights: int, ram: int | None, to_disk: bool) -> None:
    assert group_offload_to_disk(weights, ram) == to_disk


def test_group_offload_is_chosen_with_its_disk_decision() -> None:
    short = choose_rung(SD, free_bytes=int(1.6 * GIB), ram_free_bytes=GIB)
    roomy = choose_rung(SD, free_bytes=int(1.6 * GIB), ram_free_bytes=64 * GIB)
    full = choose_rung(SD, free_bytes=64 * GIB, ram_free_bytes=GIB)

    assert (short.rung, short.offload_to_disk) == ("group_offload", True)
    assert (roomy.rung, roomy.offload_to_disk) == ("group_offload", False)
    assert (full.rung, full.offload_to_disk) == ("full", False)  # only group offload uses the disk


def test_offloaded_models_take_their_weights_out_of_the_ram_left_for_the_next() -> None:
    # Each SD on group offload keeps 2 GiB of groups in RAM; 3 GiB + the reserve holds one, not two.
    choices = plan_rungs([SD, SD], free_bytes=int(1.6 * GIB), ram_free_bytes=3 * GIB + RAM_RESERVE_BYTES)

    assert [(c.rung, c.offload_to_disk) for c in choices] == [("group_offload", False), ("group_offload", True)]


def test_working_memory_of_stable_diffusion_is_the_vae_decoders_and_covers_what_an_h200_measured() -> None:
    def sd15(size: int) -> int:
        return working_bytes(width=size, height=size, vae_scale_factor=8, unet_channels=[320, 640, 1280, 1280],
                             vae_channels=[128, 256, 512, 512], dtype_bytes=2)

    assert sd15(512) == 512 * 512 * 128 * VAE_LIVE_TENSORS * 2 + WORKING_FLOOR_BYTES
    # bench/gpu_ladder.py on an H200, float16, full residency: max_memory_allocated less the weights
    # (1,963 MiB) was 665 MiB at 512x512 and 2,490 MiB at 1024x1024
    assert sd15(512) >= 665 * MIB and sd15(1024) >= 2490 * MIB
    assert sd15(1024) > 3 * sd15(512)


SD15_WEIGHTS_MIB = {"text_encoder": 165, "unet": 1639, "vae": 159}  # bench/gpu_ladder.py's model, float16


def sd15_footprint(size: int) -> Footprint:
    unet, vae = working_parts(width=size, height=size, vae_scale_factor=8, unet_channels=[320, 640, 1280, 1280],
                              vae_channels=[128, 256, 512, 512], dtype_bytes=2)
    own = {"unet": unet, "vae": vae}
    return Footprint("sd15", tuple(ComponentFootprint(name, weights * MIB, working_bytes=own.get(name, 0))
                                   for name, weights in SD15_WEIGHTS_MIB.items()), max(unet, vae) + WORKING_FLOOR_BYTES)


@pytest.mark.parametrize(("size", "full_peak_mib", "offload_peak_mib"), [(512, 2628, 1816), (1024, 4453, 2633)])
def test_the_estimates_cover_the_peaks_an_h200_measured_without_paying_for_the_vae_twice(
        size: int, full_peak_mib: int, offload_peak_mib: int) -> None:
    footprint = sd15_footprint(size)  # peaks: torch.cuda.max_memory_allocated in bench/gpu_ladder.py

    assert footprint.needs("full") >= full_peak_mib * MIB
    assert footprint.needs("model_offload") >= offload_peak_mib * MIB
    # the VAE decodes after the UNet has left: adding its activations to the UNet's weights (the
    # whole-model rule) would ask 4.5 GiB at 1024 for a job that peaked at 2.6
    assert footprint.needs("model_offload") <= 1.2 * offload_peak_mib * MIB


def test_offload_rungs_run_one_component_at_a_time_with_its_own_working_memory() -> None:
    unet = ComponentFootprint("unet", 1000, top_level_bytes=100, largest_group_bytes=200, working_bytes=50)
    vae = ComponentFootprint("vae", 100, top_level_bytes=100, working_bytes=700)
    footprint = Footprint("m", (unet, vae), working_bytes=700 + WORKING_FLOOR_BYTES)

    assert footprint.needs("full") == 1100 + 700 + WORKING_FLOOR_BYTES
    assert footprint.needs("model_offload") == 1000 + 50 + WORKING_FLOOR_BYTES  # the UNet with its own
    assert footprint.needs("group_offload") == 100 + 700 + WORKING_FLOOR_BYTES  # the VAE with its own
    whole = Footprint("m", (replace(unet, working_bytes=0), replace(vae, working_bytes=0)), 700 + WORKING_FLOOR_BYTES)
    assert whole.needs("model_offload") == 1000 + 700 + WORKING_FLOOR_BYTES  # no per-component figures


footprints = st.builds(
    lambda text, unet, vae, working, block, split: Footprint("m", (
        ComponentFootprint("text_encoder", text, text),
        ComponentFootprint("unet", unet, unet // 4, min(block, unet // 3), working_bytes=working // 3 if split else 0),
        ComponentFootprint("vae", vae, vae, working_bytes=working if split else 0)),
        working + WORKING_FLOOR_BYTES if split else working),
    *(st.integers(0, 20 * GIB) for _ in range(5)), st.booleans())


@given(footprint=footprints, free=st.integers(0, 64 * GIB), pool=st.integers(0, 4 * GIB))
def test_auto_takes_the_highest_rung_that_fits_and_no_higher_one_fits(footprint: Footprint, free: int,
                                                                      pool: int) -> None:
    choice = choose_rung(footprint, free_bytes=free, transient_pool=pool)

    tried = list(choice.needs)
    assert tried == list(RUNGS[:len(tried)])  # highest first, stopping at the first fit
    assert all(need > free for rung, need in choice.needs.items() if rung != choice.rung)
    if choice.rung is not None:
        assert choice.needs[choice.rung] <= free
    else:
        assert tried == list(RUNGS)


@given(footprint=footprints)
def test_every_rung_needs_no_more_than_the_one_above(footprint: Footprint) -> None:
    needs = [footprint.needs(rung) for rung in RUNGS]

    assert needs == sorted(needs, reverse=True)
