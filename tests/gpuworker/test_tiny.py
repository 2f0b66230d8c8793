"""The tiny random-weight pipeline: written offline, deterministic, loadable with from_pretrained."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gpuworker import tiny


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_it_writes_a_pipeline_that_loads_with_from_pretrained(models_dir: Path) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(models_dir / "tiny")

    assert pipe.tokenizer.model_max_length == 77
    assert pipe.safety_checker is None
    assert list(pipe.unet.config.block_out_channels) == [32, 64]
    assert pipe.text_encoder.config.vocab_size == 1000
    assert type(pipe.scheduler).__name__ == "EulerDiscreteScheduler"
    tokens = pipe.tokenizer("the cat in the hat").input_ids
    assert max(tokens) < pipe.text_encoder.config.vocab_size
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", num_inference_steps=1, generator=torch.Generator("cpu").manual_seed(0)).images[0]
    assert image.size == (64, 64)


def test_it_writes_the_manifest_next_to_the_weights(tiny_manifest: Path) -> None:
    written = json.loads(tiny_manifest.read_text())

    assert written == tiny.tiny_manifest()
    assert written["source"] == "."
    schema = written["params_schema"]
    assert schema["required"] == ["prompt"] and schema["additionalProperties"] is False
    assert schema["properties"]["width"]["enum"] == [64, 128, 256, 512]
    assert "init_image" in schema["properties"] and "img2img" in written["capabilities"]


def test_it_writes_the_same_weights_every_time(models_dir: Path, tmp_path: Path) -> None:
    again = tiny.make_tiny_model(tmp_path / "again").parent

    for part in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/vocab.json"):
        assert digest(again / part) == digest(models_dir / "tiny" / part), part
