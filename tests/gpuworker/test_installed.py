"""Finding the installed models: DIR/*/manifest.json (parsed with the contract's manifest rules),
narrowed by --models."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuworker.installed import ManifestError, UnknownModelError, discover_models, parse_model_ids, read_manifest


def manifest(model_id: str, source: str = ".", **extra: Any) -> dict[str, Any]:
    return {"model_id": model_id, "tier": "draft", "cost": 1.0, "capabilities": ["txt2img"],
            "pipeline": "StableDiffusionPipeline", "source": source,
            "params_schema": {"type": "object", "properties": {"prompt": {"type": "string"}}}, **extra}


def install(models_dir: Path, folder: str, content: Any) -> Path:
    path = models_dir / folder / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_it_finds_every_manifest_one_folder_down(tmp_path: Path) -> None:
    install(tmp_path, "b", manifest("model-b"))
    install(tmp_path, "a", [manifest("model-a"), manifest("model-c", source="weights")])
    (tmp_path / "a" / "weights").mkdir()
    install(tmp_path / "deeper", "x", manifest("too-deep"))  # DIR/*/*/manifest.json is not installed

    models = discover_models(tmp_path)

    assert [m.model_id for m in models] == ["model-a", "model-b", "model-c"]
    by_id = {m.model_id: m for m in models}
    assert by_id["model-a"].source == str((tmp_path / "a").resolve())
    assert by_id["model-c"].source == str((tmp_path / "a" / "weights").resolve())
    assert by_id["model-b"].capabilities == ("txt2img",)


def test_it_keeps_an_absolute_source_and_a_hub_id(tmp_path: Path) -> None:
    weights = tmp_path / "elsewhere"
    weights.mkdir()
    install(tmp_path, "one", [manifest("local", source=str(weights)), manifest("hub", source="org/name")])

    by_id = {m.model_id: m for m in discover_models(tmp_path)}

    assert by_id["local"].source == str(weights.resolve())
    assert by_id["hub"].source == "org/name"


def test_it_narrows_to_the_models_named(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        install(tmp_path, name, manifest(f"model-{name}"))

    models = discover_models(tmp_path, only=["model-c", "model-a"])

    assert [m.model_id for m in models] == ["model-a", "model-c"]


def test_it_refuses_a_model_that_is_not_installed(tmp_path: Path) -> None:
    install(tmp_path, "a", manifest("model-a"))

    with pytest.raises(UnknownModelError, match="not installed.*model-x.*installed: model-a"):
        discover_models(tmp_path, only=["model-a", "model-x"])


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    (json.dumps(["just a string"]), "must be a JSON object"),
    (json.dumps({"model_id": "x", "source": "."}), "missing field 'tier'"),
    (json.dumps({k: v for k, v in manifest("x").items() if k != "params_schema"}), "missing field 'params_schema'"),
    (json.dumps(manifest("x", cost=-1)), "cost"),
    (json.dumps(manifest("x", tier="gold")), "tier"),
    (json.dumps(manifest("x", capabilities="txt2img")), "capabilities"),
    (json.dumps(manifest("x", params_schema=[])), "params_schema"),
])
def test_it_fails_loudly_on_a_bad_manifest(tmp_path: Path, content: str, message: str) -> None:
    path = install(tmp_path, "bad", content)

    with pytest.raises(ManifestError, match=message) as raised:
        discover_models(tmp_path)
    assert str(path.resolve()) in str(raised.value)


def test_it_refuses_a_model_installed_twice(tmp_path: Path) -> None:
    install(tmp_path, "a", manifest("same"))
    install(tmp_path, "b", manifest("same"))

    with pytest.raises(ManifestError, match="installed twice"):
        discover_models(tmp_path)


def test_it_refuses_a_models_dir_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="does not exist"):
        discover_models(tmp_path / "missing")


def test_it_reads_the_tiny_manifest(tiny_manifest: Path) -> None:
    (model,) = read_manifest(tiny_manifest)

    assert (model.model_id, model.pipeline, model.source) == (
        "tiny-sd", "StableDiffusionPipeline", str(tiny_manifest.parent))
    assert model.source_is_local


@pytest.mark.parametrize(("text", "ids"), [
    (None, None), ("", None), (" , ", None), ("a", ["a"]), ("a, b,,c ", ["a", "b", "c"]),
])
def test_it_parses_the_models_flag(text: str | None, ids: list[str] | None) -> None:
    assert parse_model_ids(text) == ids
