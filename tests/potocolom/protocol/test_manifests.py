"""Manifests: parsing and validation with one set of rules (pure, no database)."""
from __future__ import annotations

import json
import re

import pytest

from potocolom.protocol.manifests import REQUIRED_FIELDS, Manifest, ManifestError, parse_manifests
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
