"""Tiny random-weight pipelines of each model family, SD, SDXL and SD3 (the sizes of diffusers' own
dummy components), seeded and written offline with their manifests, for CPU demos and tests: the
same loading and denoising code as a real model, in a few MB (docs/design/families.md)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

TINY_MODEL_ID = "tiny-sd"
TINY_FAMILIES = ("sd", "sdxl", "sd3")
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
             "sd3": "StableDiffusion3Pipeline"}
TINY_SEED = 0
MAX_SEED = 2**32 - 1
TOKENIZER_MAX_LENGTH = 77  # CLIP's; without it the pipeline pads prompts to ~1e30 tokens
TEXT_VOCAB_SIZE = 1000
SIZES = [64, 128, 256, 512]

# A few merges so the BPE has something to merge; each result is added to the vocabulary.
_MERGES = [("t", "h"), ("th", "e</w>"), ("i", "n"), ("e", "r</w>"), ("a", "n</w>"), ("o", "n</w>")]
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def tiny_model_id(family: str = "sd") -> str:
    """"tiny-sd", "tiny-sdxl" or "tiny-sd3"."""
    return f"tiny-{_checked(family)}"


def _checked(family: str) -> str:
    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(TINY_FAMILIES)}, got {family!r}")
    return family


def tiny_manifest(family: str = "sd") -> dict[str, Any]:
    """The manifest of the tiny model of `family`; `source` "." is the folder holding the manifest."""
    text = {"type": "string", "maxLength": 1000}
    size = {"type": "integer", "enum": list(SIZES)}
    return {
        "model_id": tiny_model_id(family),
        "tier": "draft",
        "cost": 1.0,
        "capabilities": ["txt2img", "img2img"],
        "pipeline": PIPELINES[family],
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


def _clip_encoder(tokenizer: Any, *, projection: bool) -> Any:
    """A seeded tiny CLIP text encoder (with a projection: SDXL's second, SD3's two) for `tokenizer`."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    config = CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4, layer_norm_eps=1e-5,
        vocab_size=TEXT_VOCAB_SIZE, max_position_embeddings=TOKENIZER_MAX_LENGTH, projection_dim=32,
        hidden_act="gelu", bos_token_id=vocab[_BOS], eos_token_id=vocab[_EOS], pad_token_id=vocab[_EOS])
    torch.manual_seed(TINY_SEED)
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _tokenizers(scratch: Path, count: int) -> list[Any]:
    """`count` CLIP tokenizers over the tiny BPE (written into `scratch` first)."""
    from transformers import CLIPTokenizer

    write_tokenizer_files(scratch)
    return [CLIPTokenizer.from_pretrained(str(scratch), model_max_length=TOKENIZER_MAX_LENGTH) for _ in range(count)]


def _vae(latent_channels: int, **extra: Any) -> Any:
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(TINY_SEED)
    return AutoencoderKL(
        block_out_channels=[32, 64], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=latent_channels,
        norm_num_groups=2, **extra)


def _sdxl_components(scratch: Path) -> dict[str, Any]:
    """SDXL's modules (diffusers' SDXL dummy components, with its time ids and pooled embeds):
    a UNet with `text_time` added embeddings, CLIP and CLIP-with-projection encoders."""
    import torch
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

    tokenizer, tokenizer_2 = _tokenizers(scratch, 2)
    torch.manual_seed(TINY_SEED)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80,  # 6 time ids x 8 + the pooled embeds' 32
        cross_attention_dim=64, norm_num_groups=2)  # both encoders' hidden states side by side: 32 + 32
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    # force_upcast off, as in SDXL's fp16-fixed VAE: img2img would otherwise cast the VAE to float32
    # on every call (and log a warning each time).
    return {"unet": unet, "vae": _vae(4, force_upcast=False),
            "text_encoder": _clip_encoder(tokenizer, projection=False), "tokenizer": tokenizer,
            "text_encoder_2": _clip_encoder(tokenizer_2, projection=True),
            "tokenizer_2": tokenizer_2, "scheduler": scheduler, "image_encoder": None, "feature_extractor": None,
            "force_zeros_for_empty_prompt": True}


def _sd3_components(scratch: Path) -> dict[str, Any]:
    """SD3's modules (diffusers' SD3 dummy components): an MMDiT transformer on 16 latent channels
    (SD3's own), flow matching, two CLIP-with-projection encoders and no T5 (diffusers then
    encodes its part as zeros)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    tokenizer, tokenizer_2 = _tokenizers(scratch, 2)
    torch.manual_seed(TINY_SEED)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32,
        joint_attention_dim=64,  # the CLIP encoders' hidden states side by side (T5's width when it is there)
        pooled_projection_dim=64)  # both encoders' pooled projections: 32 + 32
    vae = _vae(16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    return {"transformer": transformer, "vae": vae, "text_encoder": _clip_encoder(tokenizer, projection=True),
            "tokenizer": tokenizer, "text_encoder_2": _clip_encoder(tokenizer_2, projection=True),
            "tokenizer_2": tokenizer_2, "text_encoder_3": None, "tokenizer_3": None,
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0), "image_encoder": None,
            "feature_extractor": None}


def make_tiny_model(directory: str | os.PathLike[str], family: str = "sd") -> Path:
    """Write the tiny pipeline of `family` ("sd", "sdxl" or "sd3") into `directory` with
    `save_pretrained`, and its manifest as `directory/manifest.json`; return the manifest's
    absolute path. Offline and deterministic."""
    _checked(family)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, even by accident
    import diffusers

    target = Path(directory).resolve()
    target.mkdir(parents=True, exist_ok=True)
    scratch = target / "tokenizer"
    build = {"sd": _components, "sdxl": _sdxl_components, "sd3": _sd3_components}[family]
    pipe: Any = getattr(diffusers, PIPELINES[family])(**build(scratch))
    # SD3 leaves out its T5 encoder: diffusers warns that None "cannot be saved" (it is written as null).
    pipeline_log = logging.getLogger("diffusers.pipelines.pipeline_utils")
    level = pipeline_log.level
    pipeline_log.setLevel(logging.ERROR)
    try:
        pipe.save_pretrained(str(target), safe_serialization=True)
    finally:
        pipeline_log.setLevel(level)
    manifest_path = target / "manifest.json"
    manifest_path.write_text(json.dumps(tiny_manifest(family), indent=2) + "\n", encoding="utf-8")
    return manifest_path
