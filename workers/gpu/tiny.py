"""A tiny random-weight Stable-Diffusion-style pipeline (the sizes of diffusers' own dummy
components), seeded and written offline with its manifest, for CPU demos and tests: the same
loading and denoising code as a real model, in about 8 MB."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_MODEL_ID = "tiny-sd"
TINY_SEED = 0
MAX_SEED = 2**32 - 1
TOKENIZER_MAX_LENGTH = 77  # CLIP's; without it the pipeline pads prompts to ~1e30 tokens
TEXT_VOCAB_SIZE = 1000
SIZES = [64, 128, 256, 512]

# A few merges so the BPE has something to merge; each result is added to the vocabulary.
_MERGES = [("t", "h"), ("th", "e</w>"), ("i", "n"), ("e", "r</w>"), ("a", "n</w>"), ("o", "n</w>")]
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def tiny_manifest() -> dict[str, Any]:
    """The manifest of the tiny model; `source` "." is the folder holding the manifest."""
    text = {"type": "string", "maxLength": 1000}
    size = {"type": "integer", "enum": list(SIZES)}
    return {
        "model_id": TINY_MODEL_ID,
        "tier": "draft",
        "cost": 1.0,
        "capabilities": ["txt2img", "img2img"],
        "pipeline": "StableDiffusionPipeline",
        "source": ".",
        "params_schema": {
            "type": "object",
            "required": ["prompt"],
            "additionalProperties": False,
            "properties": {
                "prompt": text,
                "negative_prompt": text,
                "width": size,
                "height": size,
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "steps": {"type": "integer", "minimum": 1, "maximum": 50},
                "guidance_scale": {"type": "number", "minimum": 0, "maximum": 20},
                "strength": {"type": "number", "minimum": 0, "maximum": 1},
                "init_image": {"type": "string",
                               "description": "base64 PNG or a data: URL; makes the job img2img"},
            },
        },
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters), strict=True))


def write_tokenizer_files(directory: Path) -> None:
    """vocab.json and merges.txt of a byte-level BPE small enough for a 1000-token text encoder."""
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [f"{c}</w>" for c in alphabet] + ["".join(pair) for pair in _MERGES] + [_BOS, _EOS]
    assert len(tokens) <= TEXT_VOCAB_SIZE
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _MERGES)
    (directory / "merges.txt").write_text(merges, encoding="utf-8")


def _components(scratch: Path) -> dict[str, Any]:
    """The pipeline's modules with seeded random weights (diffusers' dummy-component sizes)."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    write_tokenizer_files(scratch)
    tokenizer = CLIPTokenizer.from_pretrained(str(scratch), model_max_length=TOKENIZER_MAX_LENGTH)
    vocab = tokenizer.get_vocab()
    # Seed before each module, so one module's size never changes another's weights.
    torch.manual_seed(TINY_SEED)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=2)
    torch.manual_seed(TINY_SEED)
    vae = AutoencoderKL(
        block_out_channels=[32, 64], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4, norm_num_groups=2)
    torch.manual_seed(TINY_SEED)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4,
        layer_norm_eps=1e-5, vocab_size=TEXT_VOCAB_SIZE, max_position_embeddings=TOKENIZER_MAX_LENGTH,
        bos_token_id=vocab[_BOS], eos_token_id=vocab[_EOS], pad_token_id=vocab[_EOS]))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1)
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler, "safety_checker": None, "feature_extractor": None,
            "image_encoder": None, "requires_safety_checker": False}


def make_tiny_model(directory: str | os.PathLike[str]) -> Path:
    """Write the tiny pipeline into `directory` with `save_pretrained`, and its manifest as
    `directory/manifest.json`; return the manifest's absolute path. Offline and deterministic."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, even by accident
    from diffusers import StableDiffusionPipeline

    target = Path(directory).resolve()
    target.mkdir(parents=True, exist_ok=True)
    pipe: Any = StableDiffusionPipeline(**_components(target / "tokenizer"))
    pipe.save_pretrained(str(target), safe_serialization=True)
    manifest_path = target / "manifest.json"
    manifest_path.write_text(json.dumps(tiny_manifest(), indent=2) + "\n", encoding="utf-8")
    return manifest_path
