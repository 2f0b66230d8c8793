"""`manage.py load_manifests PATH...` and GET /api/v1/models/."""
from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from models_registry.models import ModelManifest
from tests.helpers import PROMPT_SCHEMA, api_client, manifest_dict

pytestmark = pytest.mark.django_db


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def load(*paths: Path) -> list[str]:
    out = StringIO()
    call_command("load_manifests", *[str(p) for p in paths], stdout=out)
    return out.getvalue().splitlines()


def registered() -> dict[str, tuple]:
    return {m.model_id: (m.tier, m.cost, m.capabilities) for m in ModelManifest.objects.all()}


def test_it_registers_models_and_prints_loaded_n_last(tmp_path):
    one = write(tmp_path / "one.json", manifest_dict("tiny-sd"))
    many = write(tmp_path / "many.json", [manifest_dict("sd-std", tier="standard", cost=2, capabilities=("txt2img",)),
                                          manifest_dict("sd-xl", tier="premium", cost=5)])

    lines = load(one, many)

    assert lines[-1] == "loaded 3"
    assert registered() == {"tiny-sd": ("draft", 1.0, ["txt2img", "img2img"]),
                            "sd-std": ("standard", 2.0, ["txt2img"]),
                            "sd-xl": ("premium", 5.0, ["txt2img", "img2img"])}
    row = ModelManifest.objects.get(model_id="tiny-sd")
    assert row.params_schema == PROMPT_SCHEMA
    assert row.pipeline == "StableDiffusionPipeline" and row.source == "models/tiny-sd"
    assert row.loaded_from == str(one.resolve())


def test_it_updates_a_model_loaded_again(tmp_path):
    path = write(tmp_path / "manifest.json", manifest_dict("tiny-sd"))
    load(path)
    write(path, manifest_dict("tiny-sd", tier="standard", cost=4.5, capabilities=("img2img",),
                              params_schema={"type": "object"}))

    lines = load(path)

    assert lines[-1] == "loaded 1"
    assert ModelManifest.objects.count() == 1
    assert registered() == {"tiny-sd": ("standard", 4.5, ["img2img"])}
    assert ModelManifest.objects.get().params_schema == {"type": "object"}


def test_it_leaves_other_registered_models_alone(tmp_path):
    load(write(tmp_path / "a.json", manifest_dict("model-a")))

    load(write(tmp_path / "b.json", manifest_dict("model-b")))

    assert sorted(registered()) == ["model-a", "model-b"]


BAD_FILES = [
    pytest.param(lambda path: write(path, "{not json"), id="bad JSON"),
    pytest.param(lambda path: write(path, {**manifest_dict("bad"), "tier": "ultra"}), id="unknown tier"),
    pytest.param(lambda path: write(path, {k: v for k, v in manifest_dict("bad").items() if k != "source"}),
                 id="missing field"),
    pytest.param(lambda path: write(path, {**manifest_dict("bad"), "params_schema": {"type": 5}}),
                 id="bad JSON Schema"),
    pytest.param(lambda path: write(path, [manifest_dict("bad"), manifest_dict("bad")]), id="duplicate ids"),
    pytest.param(lambda path: path, id="missing file"),
    pytest.param(lambda path: path.mkdir() or path, id="a directory"),
    pytest.param(lambda path: path.write_bytes(b'{"model_id": "caf\xe9"}') and path, id="not UTF-8"),
]


@pytest.mark.parametrize("make_bad", BAD_FILES)
def test_it_loads_nothing_when_one_file_is_bad_and_names_it(tmp_path, make_bad):
    existing = write(tmp_path / "existing.json", manifest_dict("already-there", cost=1))
    load(existing)
    good = write(tmp_path / "good.json", [manifest_dict("new-model"), manifest_dict("already-there", cost=9)])
    bad = make_bad(tmp_path / "bad.json")

    with pytest.raises(CommandError) as raised:
        load(good, bad)

    assert str(bad) in str(raised.value)
    assert "nothing loaded" in str(raised.value)
    assert registered() == {"already-there": ("draft", 1.0, ["txt2img", "img2img"])}


def test_it_refuses_one_model_id_in_two_files(tmp_path):
    first = write(tmp_path / "first.json", manifest_dict("twin"))
    second = write(tmp_path / "second.json", manifest_dict("twin", cost=2))

    with pytest.raises(CommandError) as raised:
        load(first, second)

    assert str(second) in str(raised.value) and str(first) in str(raised.value)
    assert ModelManifest.objects.count() == 0


def test_it_needs_a_path():
    with pytest.raises(CommandError):
        call_command("load_manifests", stdout=StringIO(), stderr=StringIO())


# --- GET /api/v1/models/ -------------------------------------------------------------------------

def test_it_lists_the_registered_models_cheapest_first(tmp_path, alice):
    load(write(tmp_path / "m.json", [manifest_dict("sd-xl", tier="premium", cost=5),
                                     manifest_dict("tiny-b", cost=1), manifest_dict("tiny-a", cost=1)]))

    response = api_client(alice).get("/api/v1/models/")

    assert response.status_code == 200
    body = response.json()
    assert [m["model_id"] for m in body] == ["tiny-a", "tiny-b", "sd-xl"]
    assert body[2] == {"model_id": "sd-xl", "tier": "premium", "cost": 5.0, "capabilities": ["txt2img", "img2img"],
                       "pipeline": "StableDiffusionPipeline", "source": "models/sd-xl", "params_schema": PROMPT_SCHEMA}


def test_it_lists_models_only_to_an_authenticated_account(tmp_path, alice):
    load(write(tmp_path / "m.json", manifest_dict("tiny-sd")))

    anonymous = api_client().get("/api/v1/models/")
    bad_token = api_client()
    bad_token.credentials(HTTP_AUTHORIZATION="Token not-a-token")

    assert anonymous.status_code == 401
    assert bad_token.get("/api/v1/models/").status_code == 401
