"""Routing a request to a model (pure, no database), and reading manifest files."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models_registry.errors import InvalidParams, NoMatchingModel, UnknownModel
from models_registry.routing import route
from models_registry.services import read_manifest_file
from potocolom.protocol.manifests import Manifest, ManifestError
from tests.helpers import manifest_dict


def text_of(data) -> str:
    return json.dumps(data)


# --- routing ------------------------------------------------------------------------------------

def manifest(model_id: str, tier: str, cost: float, capabilities: tuple[str, ...], widths: list[int]) -> Manifest:
    schema = {"type": "object", "required": ["prompt"],
              "properties": {"prompt": {"type": "string"}, "width": {"type": "integer", "enum": widths}}}
    return Manifest(model_id=model_id, tier=tier, cost=cost, capabilities=capabilities,
                    pipeline="StableDiffusionPipeline", source=f"models/{model_id}", params_schema=schema)


CATALOGUE = [
    manifest("premium-xl", "premium", 5.0, ("txt2img",), [512, 1024, 2048]),
    manifest("standard-sd", "standard", 2.0, ("txt2img", "img2img"), [256, 512, 1024]),
    manifest("draft-b", "draft", 1.0, ("txt2img",), [64, 128, 256]),
    manifest("draft-a", "draft", 1.0, ("txt2img", "img2img"), [64, 128]),
    manifest("draft-pricey", "draft", 1.5, ("txt2img", "img2img"), [64, 128, 256]),
]
PROMPT = {"prompt": "a red circle"}

ROUTES = [
    # (request, the model it routes to)
    pytest.param({}, "draft-a", id="cheapest, tie broken by the smaller model_id"),
    pytest.param({"tier": "draft"}, "draft-a", id="tier draft"),
    pytest.param({"tier": "standard"}, "standard-sd", id="tier filters out cheaper models"),
    pytest.param({"tier": "premium"}, "premium-xl", id="tier premium"),
    pytest.param({"capabilities": ["img2img"]}, "draft-a", id="one capability"),
    pytest.param({"capabilities": ["txt2img", "img2img"], "params": {**PROMPT, "width": 256}}, "draft-pricey",
                 id="all capabilities required, params schema filters"),
    pytest.param({"params": {**PROMPT, "width": 256}}, "draft-b", id="params_schema filters the cheapest out"),
    pytest.param({"params": {**PROMPT, "width": 1024}}, "standard-sd", id="only bigger models take big widths"),
    pytest.param({"params": {**PROMPT, "width": 2048}}, "premium-xl", id="only the premium model takes 2048"),
    pytest.param({"tier": "standard", "capabilities": ["img2img"], "params": {**PROMPT, "width": 512}},
                 "standard-sd", id="tier, capabilities and params together"),
    pytest.param({"model_id": "premium-xl"}, "premium-xl", id="a named model"),
    pytest.param({"model_id": "premium-xl", "tier": "draft", "capabilities": ["img2img"]}, "premium-xl",
                 id="model_id wins over tier and capabilities"),
]


@pytest.mark.parametrize(("request_", "model_id"), ROUTES)
def test_it_routes_a_request(request_, model_id):
    options = {"params": PROMPT, **request_}

    assert route(CATALOGUE, **options).model_id == model_id


ROUTING_ERRORS = [
    # (request, error, its code, what its detail says)
    pytest.param({"model_id": "nope"}, UnknownModel, "unknown_model",
                 {"model_id": ["no model 'nope' is registered"]}, id="unknown model"),
    pytest.param({"model_id": "draft-a", "params": {**PROMPT, "width": 4096}}, InvalidParams, "invalid_params",
                 "width", id="params the named model rejects"),
    pytest.param({"model_id": "draft-a", "params": {}}, InvalidParams, "invalid_params", "prompt",
                 id="params missing a required field"),
    pytest.param({"tier": "premium", "capabilities": ["img2img"]}, NoMatchingModel, "no_matching_model", "premium",
                 id="no model of that tier has that capability"),
    pytest.param({"params": {**PROMPT, "width": 4096}}, NoMatchingModel, "no_matching_model", None,
                 id="no model takes these params"),
    pytest.param({"params": {"prompt": 7}}, NoMatchingModel, "no_matching_model", None,
                 id="params of the wrong type"),
]


@pytest.mark.parametrize(("request_", "error", "code", "detail"), ROUTING_ERRORS)
def test_it_refuses_a_request_it_cannot_route(request_, error, code, detail):
    options = {"params": PROMPT, **request_}

    with pytest.raises(error) as raised:
        route(CATALOGUE, **options)

    assert raised.value.code == code
    if isinstance(detail, dict):
        assert raised.value.detail == detail
    elif detail is not None:
        assert detail in str(raised.value.detail)


def test_it_says_which_params_the_named_model_rejects():
    with pytest.raises(InvalidParams) as raised:
        route(CATALOGUE, model_id="draft-a", params={"prompt": 3, "width": 4096})

    assert list(raised.value.detail) == ["params"]
    messages = raised.value.detail["params"]
    assert any(m.startswith("prompt:") for m in messages) and any(m.startswith("width:") for m in messages)


def test_it_finds_no_matching_model_in_an_empty_registry():
    with pytest.raises(NoMatchingModel):
        route([], params=PROMPT)
    with pytest.raises(UnknownModel):
        route([], model_id="draft-a", params=PROMPT)


@st.composite
def catalogues(draw):
    count = draw(st.integers(0, 8))
    ids = draw(st.lists(st.text("abcxyz-", min_size=1, max_size=4), min_size=count, max_size=count, unique=True))
    return [manifest(model_id, draw(st.sampled_from(["draft", "standard", "premium"])),
                     draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
                     tuple(draw(st.sets(st.sampled_from(["txt2img", "img2img"]), min_size=1))),
                     sorted(draw(st.sets(st.sampled_from([64, 128, 256]), min_size=1))))
            for model_id in ids]


@given(catalogue=catalogues(), tier=st.sampled_from([None, "draft", "standard", "premium"]),
       capabilities=st.sets(st.sampled_from(["txt2img", "img2img"])), width=st.sampled_from([None, 64, 128, 256]),
       data=st.data())
@settings(max_examples=200, deadline=None)
def test_it_routes_to_the_cheapest_fitting_model_whatever_the_registry_order(catalogue, tier, capabilities, width,
                                                                            data):
    params = {**PROMPT, **({"width": width} if width else {})}
    shuffled = data.draw(st.permutations(catalogue))

    def fits(m: Manifest) -> bool:
        return ((tier is None or m.tier == tier) and capabilities <= set(m.capabilities)
                and (width is None or width in m.params_schema["properties"]["width"]["enum"]))

    fitting = [m for m in catalogue if fits(m)]
    if not fitting:
        with pytest.raises(NoMatchingModel):
            route(shuffled, tier=tier, capabilities=capabilities, params=params)
        return
    chosen = route(shuffled, tier=tier, capabilities=capabilities, params=params)
    assert fits(chosen)
    assert all((chosen.cost, chosen.model_id) <= (m.cost, m.model_id) for m in fitting)


def test_it_reads_a_manifest_file_and_names_a_missing_one(tmp_path: Path):
    path = tmp_path / "manifest.json"
    path.write_text(text_of(manifest_dict("on-disk")))

    assert [m.model_id for m in read_manifest_file(path)] == ["on-disk"]
    with pytest.raises(ManifestError, match=re.escape(str(tmp_path / "absent.json"))):
        read_manifest_file(tmp_path / "absent.json")


def test_it_names_a_manifest_file_that_is_not_utf8(tmp_path: Path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"model_id": "caf\xe9"}')

    with pytest.raises(ManifestError, match=re.escape(str(path))):
        read_manifest_file(path)


# --- caps for params a schema leaves open, and what each candidate refused --------------------

OPEN_SCHEMA = {"type": "object", "required": ["prompt"],
               "properties": {"prompt": {"type": "string"}, "width": {"type": "integer"},
                              "steps": {"type": "integer", "minimum": 1}}}
CAPS = {"width": 2048, "height": 2048, "steps": 150}


def open_model(model_id: str, cost: float = 1.0, schema: dict | None = None) -> Manifest:
    return Manifest(model_id=model_id, tier="draft", cost=cost, capabilities=("txt2img",),
                    pipeline="StableDiffusionPipeline", source=f"models/{model_id}",
                    params_schema=schema or OPEN_SCHEMA, caps=CAPS)


@pytest.mark.parametrize(("params", "refused"), [
    ({"width": 2048, "height": 2048, "steps": 150}, {}),
    ({"width": 2049}, {"width"}),
    ({"height": 4096}, {"height"}),  # not even declared by the schema: capped all the same
    ({"steps": 151}, {"steps"}),
    ({"width": 1e9, "steps": 1000}, {"width", "steps"}),
])
def test_a_schema_without_a_maximum_gets_the_caps(params, refused):
    [model] = [open_model("open")]

    if not refused:
        assert route([model], model_id="open", params={**PROMPT, **params}) == model
        return
    with pytest.raises(InvalidParams) as raised:
        route([model], model_id="open", params={**PROMPT, **params})
    assert {message.split(":")[0] for message in raised.value.detail["params"]} == refused


def test_a_schema_s_own_maximum_wins_over_the_cap():
    schema = {"type": "object", "properties": {"width": {"type": "integer", "maximum": 8192},
                                               "steps": {"type": "integer", "exclusiveMaximum": 500}}}
    model = open_model("big", schema=schema)

    assert route([model], model_id="big", params={"width": 8192, "steps": 499}) == model


def test_without_model_id_the_detail_names_what_each_candidate_refused():
    catalogue = [open_model("open-a"), open_model("open-b", cost=2.0, schema={
        "type": "object", "properties": {"width": {"type": "integer", "enum": [64, 128]}}}),
        manifest("premium-xl", "premium", 5.0, ("txt2img",), [512])]

    with pytest.raises(NoMatchingModel) as raised:
        route(catalogue, tier="draft", params={"width": 4096})

    assert raised.value.code == "no_matching_model"
    detail = raised.value.detail
    assert "no registered model fits" in detail["message"]
    assert set(detail["candidates"]) == {"open-a", "open-b"}  # premium-xl is not of the tier asked for
    assert set(detail["candidates"]["open-a"]) == {"params", "width"}  # prompt missing, width over the cap
    assert detail["candidates"]["open-a"]["width"] == ["4096 is greater than the maximum of 2048"]
    assert set(detail["candidates"]["open-b"]) == {"width"}
