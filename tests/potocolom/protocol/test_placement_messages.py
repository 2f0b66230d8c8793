"""The worker socket's placement messages (issue 12), both ways: a v2 hello's `installed`, the
entries' `step_ms`, load_model / unload_model to the worker, and model_loaded / model_load_failed /
model_unloaded from it, each carrying the worker's `gpu`; what is off the contract is refused."""
from __future__ import annotations

from typing import Any

import pytest

from potocolom.protocol.errors import MessageError
from potocolom.protocol.worker import (
    Hello,
    InstalledEntry,
    LoadModel,
    ModelEntry,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    UnloadModel,
    parse_api_message,
    parse_worker_message,
)

GPU = {"name": "NVIDIA H200", "total_mib": 143771, "free_mib": 120000}
NEEDS = {"full": 4002, "model_offload": 3355, "group_offload": 2425}


def hello(**fields: Any) -> dict[str, Any]:
    return {"type": "hello", "worker_id": "host-a:0", "gpu": GPU, "models": [], "protocol": 2, "jobs": [],
            **fields}


def test_a_v2_hello_carries_every_installed_model_with_its_needs_and_step_time() -> None:
    installed = [{"model_id": "sd15", "needs_mib": NEEDS, "step_ms": 31.5},
                 {"model_id": "sdxl", "needs_mib": {**NEEDS, "full": 9000}, "step_ms": None}]
    models = [{"model_id": "sd15", "rung": "full", "realtime": True, "frame_ms_p95": 80.0, "realtime_slots": 2,
               "step_ms": 31.5}]

    parsed = parse_worker_message(hello(installed=installed, models=models))

    assert isinstance(parsed, Hello)
    assert parsed.installed == (InstalledEntry("sd15", NEEDS, 31.5), InstalledEntry("sdxl", {**NEEDS, "full": 9000}))
    assert parsed.models[0].step_ms == 31.5
    assert parse_worker_message(parsed.to_wire()) == parsed  # written as it was read


def test_a_hello_without_installed_says_nothing_of_it_and_a_v1_hello_never_does() -> None:
    assert parse_worker_message(hello()).installed is None  # type: ignore[union-attr]
    v1 = {"type": "hello", "worker_id": "host-a:0", "gpu": None, "models": [],
          "installed": [{"model_id": "sd15", "needs_mib": NEEDS}]}
    parsed = parse_worker_message(v1)
    assert isinstance(parsed, Hello) and parsed.installed is None
    assert "installed" not in parsed.to_wire()


def test_an_entry_without_a_step_time_is_written_as_v1_wrote_it() -> None:
    assert ModelEntry("sd15", "full").to_wire() == {"model_id": "sd15", "rung": "full", "realtime": False,
                                                    "frame_ms_p95": None, "realtime_slots": 0}


@pytest.mark.parametrize("installed", [
    pytest.param("sd15", id="not a list"),
    pytest.param(["sd15"], id="an entry that is not an object"),
    pytest.param([{"model_id": "sd15", "needs_mib": {"full": 1}}], id="a rung missing"),
    pytest.param([{"model_id": "sd15", "needs_mib": {**NEEDS, "turbo": 1}}], id="an unknown rung"),
    pytest.param([{"model_id": "sd15", "needs_mib": {**NEEDS, "full": -1}}], id="a negative need"),
    pytest.param([{"model_id": "sd15", "needs_mib": {**NEEDS, "full": 1.5}}], id="a need that is not whole"),
    pytest.param([{"model_id": "sd15", "needs_mib": {**NEEDS, "full": 2**40}}], id="a need past any device"),
    pytest.param([{"model_id": "sd15", "needs_mib": NEEDS, "step_ms": -3}], id="a negative step time"),
    pytest.param([{"model_id": "", "needs_mib": NEEDS}], id="an empty model_id"),
    pytest.param([{"model_id": "sd15", "needs_mib": NEEDS}] * 2, id="a model twice"),
    pytest.param([{"model_id": f"m{n}", "needs_mib": NEEDS} for n in range(1001)], id="too many"),
])
def test_a_hello_with_installed_off_the_contract_is_refused(installed: Any) -> None:
    with pytest.raises(MessageError):
        parse_worker_message(hello(installed=installed))


def test_the_answers_to_load_and_unload_carry_the_worker_s_gpu() -> None:
    loaded = {"type": "model_loaded", "model_id": "sd15", "rung": "model_offload", "realtime": True,
              "frame_ms_p95": None, "realtime_slots": 3, "step_ms": 40.0, "gpu": GPU}
    parsed = parse_worker_message(loaded)
    # realtime only on rung full, as in a hello
    assert parsed == ModelLoaded(ModelEntry("sd15", "model_offload", False, None, 0, 40.0), GPU)
    assert parse_worker_message(parsed.to_wire()) == parsed

    failed = parse_worker_message({"type": "model_load_failed", "model_id": "sd15", "error": "x" * 900, "gpu": None})
    assert failed == ModelLoadFailed("sd15", "x" * 500, None)  # the reason is kept short
    unloaded = ModelUnloaded("sd15", GPU)
    assert parse_worker_message(unloaded.to_wire()) == unloaded


@pytest.mark.parametrize("message", [
    pytest.param({"type": "model_loaded", "model_id": "sd15", "rung": "turbo", "gpu": None}, id="loaded: bad rung"),
    pytest.param({"type": "model_loaded", "model_id": "sd15", "rung": "full", "gpu": "H200"}, id="loaded: bad gpu"),
    pytest.param({"type": "model_load_failed", "model_id": "sd15", "gpu": None}, id="failed: no error"),
    pytest.param({"type": "model_unloaded", "gpu": None}, id="unloaded: no model_id"),
])
def test_placement_answers_off_the_contract_are_refused(message: dict[str, Any]) -> None:
    with pytest.raises(MessageError):
        parse_worker_message(message)


def test_load_model_names_a_rung_or_leaves_it_to_the_worker_and_unload_model_names_the_model() -> None:
    assert LoadModel("sd15").to_wire() == {"type": "load_model", "model_id": "sd15"}
    assert parse_api_message(LoadModel("sd15").to_wire()) == LoadModel("sd15")
    assert parse_api_message(LoadModel("sd15", "full").to_wire()) == LoadModel("sd15", "full")
    assert parse_api_message(UnloadModel("sd15").to_wire()) == UnloadModel("sd15")
    with pytest.raises(MessageError):
        parse_api_message({"type": "load_model", "model_id": "sd15", "rung": "turbo"})
    with pytest.raises(MessageError):
        parse_api_message({"type": "unload_model"})
