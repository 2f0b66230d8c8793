"""Manifests: parsing and validation, and routing a request to a model (pure, no database)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models_registry.manifests import (
    REQUIRED_FIELDS,
    InvalidParamsError,
    Manifest,
    ManifestError,
    NoMatchingModelError,
    UnknownModelError,
    parse_manifests,
    read_manifest_file,
    route,
)
from tests.helpers import PROMPT_SCHEMA, manifest_dict

ORIGIN = "models/tiny-sd/manifest.json"


def text_of(data) -> str:
    return json.dumps(data)


def with_field(name: str, value) -> dict:
    return {**manifest_dict("tiny-sd"), name: value}


def without_field(name: str) -> dict:
    data = manifest_dict("tiny-sd")
    del data[name]
    return data


# --- parsing ------------------------------------------------------------------------------------

def test_it_parses_the_contracts_example():
    example = {"model_id": "tiny-sd", "tier": "draft", "cost": 1.0, "capabilities": ["txt2img", "img2img"],
               "pipeline": "StableDiffusionPipeline", "source": "models/tiny-sd", "params_schema": PROMPT_SCHEMA}

    [manifest] = parse_manifests(text_of(example), origin=ORIGIN)

    assert manifest == Manifest(model_id="tiny-sd", tier="draft", cost=1.0, capabilities=("txt2img", "img2img"),
                                pipeline="StableDiffusionPipeline", source="models/tiny-sd",
                                params_schema=PROMPT_SCHEMA)
    assert manifest.params_schema == PROMPT_SCHEMA


def test_it_parses_a_list_of_manifests_in_order():
    text = text_of([manifest_dict("b-model", tier="standard", cost=2), manifest_dict("a-model")])

    manifests = parse_manifests(text, origin=ORIGIN)

    assert [(m.model_id, m.tier, m.cost) for m in manifests] == [("b-model", "standard", 2.0),
                                                                  ("a-model", "draft", 1.0)]
    assert isinstance(manifests[0].cost, float)


@pytest.mark.parametrize("tier", ["draft", "standard", "premium"])
def test_it_accepts_each_of_the_three_tiers(tier):
    [manifest] = parse_manifests(text_of(with_field("tier", tier)), origin=ORIGIN)
    assert manifest.tier == tier


def test_it_accepts_an_integer_cost_and_a_cost_of_zero():
    assert parse_manifests(text_of(with_field("cost", 0)), origin=ORIGIN)[0].cost == 0.0
    assert parse_manifests(text_of(with_field("cost", 3)), origin=ORIGIN)[0].cost == 3.0


BAD_MANIFESTS = [
    # (file text, the field the error must name, or None for a problem of the whole file)
    pytest.param("{not json", None, "not valid JSON", id="bad JSON"),
    pytest.param("", None, "not valid JSON", id="empty file"),
    pytest.param("[]", None, "no manifest", id="empty list"),
    pytest.param('"tiny-sd"', None, "JSON object", id="a string, not an object"),
    pytest.param(text_of(with_field("tier", "ultra")), "tier", "ultra", id="unknown tier"),
    pytest.param(text_of(with_field("tier", "Draft")), "tier", None, id="tier is case-sensitive"),
    pytest.param(text_of(with_field("tier", None)), "tier", None, id="null tier"),
    pytest.param(text_of(with_field("cost", -1)), "cost", None, id="negative cost"),
    pytest.param(text_of(with_field("cost", "1.0")), "cost", None, id="cost as a string"),
    pytest.param(text_of(with_field("cost", True)), "cost", None, id="cost as a boolean"),
    pytest.param(text_of(with_field("cost", None)), "cost", None, id="null cost"),
    pytest.param(text_of(with_field("cost", float("nan"))), "cost", None, id="cost NaN"),
    pytest.param(text_of(with_field("cost", float("inf"))), "cost", None, id="cost Infinity"),
    pytest.param(text_of(with_field("capabilities", [])), "capabilities", None, id="no capabilities"),
    pytest.param(text_of(with_field("capabilities", ["realtime"])), "capabilities", None,
                 id="realtime is never a manifest capability"),
    pytest.param(text_of(with_field("capabilities", "txt2img")), "capabilities", None, id="capabilities not a list"),
    pytest.param(text_of(with_field("model_id", "")), "model_id", None, id="empty model_id"),
    pytest.param(text_of(with_field("model_id", "   ")), "model_id", None, id="blank model_id"),
    pytest.param(text_of(with_field("model_id", 7)), "model_id", None, id="model_id not a string"),
    pytest.param(text_of(with_field("model_id", "m" * 201)), "model_id", None, id="model_id too long"),
    pytest.param(text_of(with_field("pipeline", "")), "pipeline", None, id="empty pipeline"),
    pytest.param(text_of(with_field("source", 3)), "source", None, id="source not a string"),
    pytest.param(text_of(with_field("params_schema", {"type": "nonsense"})), "params_schema", "JSON Schema",
                 id="bad JSON Schema"),
    pytest.param(text_of(with_field("params_schema", {"properties": {"steps": {"minimum": "one"}}})),
                 "params_schema", "JSON Schema", id="bad JSON Schema deep inside"),
    pytest.param(text_of(with_field("params_schema", ["prompt"])), "params_schema", None,
                 id="params_schema not an object"),
    *[pytest.param(text_of(without_field(name)), name, "missing", id=f"missing {name}") for name in REQUIRED_FIELDS],
]


@pytest.mark.parametrize(("text", "field", "says"), BAD_MANIFESTS)
def test_it_rejects_a_bad_manifest_naming_the_file_and_the_field(text, field, says):
    with pytest.raises(ManifestError) as raised:
        parse_manifests(text, origin=ORIGIN)

    message = str(raised.value)
    assert message.startswith(ORIGIN), message
    if field is not None:
        assert repr(field) in message, message
    if says is not None:
        assert says in message, message


def test_it_names_the_entry_of_a_list_that_is_bad():
    text = text_of([manifest_dict("good"), with_field("tier", "ultra")])

    with pytest.raises(ManifestError, match=re.escape(f"{ORIGIN}[1]: field 'tier'")):
        parse_manifests(text, origin=ORIGIN)


def test_it_rejects_a_list_naming_one_model_id_twice():
    text = text_of([manifest_dict("twin"), manifest_dict("other"), manifest_dict("twin", cost=2)])

    with pytest.raises(ManifestError, match=re.escape(f"{ORIGIN}: model_id 'twin' appears twice")):
        parse_manifests(text, origin=ORIGIN)


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
    pytest.param({"model_id": "nope"}, UnknownModelError, "unknown_model",
                 {"model_id": ["no model 'nope' is registered"]}, id="unknown model"),
    pytest.param({"model_id": "draft-a", "params": {**PROMPT, "width": 4096}}, InvalidParamsError, "invalid_params",
                 "width", id="params the named model rejects"),
    pytest.param({"model_id": "draft-a", "params": {}}, InvalidParamsError, "invalid_params", "prompt",
                 id="params missing a required field"),
    pytest.param({"tier": "premium", "capabilities": ["img2img"]}, NoMatchingModelError, "no_matching_model", "premium",
                 id="no model of that tier has that capability"),
    pytest.param({"params": {**PROMPT, "width": 4096}}, NoMatchingModelError, "no_matching_model", None,
                 id="no model takes these params"),
    pytest.param({"params": {"prompt": 7}}, NoMatchingModelError, "no_matching_model", None,
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
    with pytest.raises(InvalidParamsError) as raised:
        route(CATALOGUE, model_id="draft-a", params={"prompt": 3, "width": 4096})

    assert list(raised.value.detail) == ["params"]
    messages = raised.value.detail["params"]
    assert any(m.startswith("prompt:") for m in messages) and any(m.startswith("width:") for m in messages)


def test_it_finds_no_matching_model_in_an_empty_registry():
    with pytest.raises(NoMatchingModelError):
        route([], params=PROMPT)
    with pytest.raises(UnknownModelError):
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
        with pytest.raises(NoMatchingModelError):
            route(shuffled, tier=tier, capabilities=capabilities, params=params)
        return
    chosen = route(shuffled, tier=tier, capabilities=capabilities, params=params)
    assert fits(chosen)
    assert all((chosen.cost, chosen.model_id) <= (m.cost, m.model_id) for m in fitting)
