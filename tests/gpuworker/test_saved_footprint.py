"""A model's footprint read from its saved files alone (what a worker says of an installed model it
has not loaded, issue 12): the same weights, block groups and working memory as the footprint
measured from the loaded modules, at the run dtype, save for the buffers a model makes at load."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpuworker.footprints import block_group_of, pipeline_footprint, saved_footprint
from gpuworker.installed import ModelOnDisk, discover_models
from potocolom.protocol.rungs import RUNGS

LOAD_TIME_BUFFERS_BYTES = 1024  # e.g. CLIP's position_ids: made by the model, not saved


@pytest.fixture(scope="module")
def tiny(models_dir: Path) -> ModelOnDisk:
    (model,) = discover_models(models_dir)
    return model


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_the_saved_footprint_is_the_loaded_one(tiny: ModelOnDisk, dtype_name: str) -> None:
    import diffusers
    import torch

    dtype = getattr(torch, dtype_name)
    pipe = getattr(diffusers, tiny.pipeline).from_pretrained(tiny.source, dtype=dtype)
    loaded = pipeline_footprint(tiny.model_id, pipe, tiny.params_schema)

    saved = saved_footprint(tiny.model_id, tiny.source, tiny.params_schema, dtype_bytes=dtype.itemsize)

    by_name = {c.name: c for c in saved.components}
    assert set(by_name) == {c.name for c in loaded.components} == {"text_encoder", "unet", "vae"}
    for measured in loaded.components:
        read = by_name[measured.name]
        assert 0 <= measured.weights_bytes - read.weights_bytes <= LOAD_TIME_BUFFERS_BYTES, measured.name
        assert 0 <= measured.top_level_bytes - read.top_level_bytes <= LOAD_TIME_BUFFERS_BYTES, measured.name
        assert (read.largest_group_bytes, read.working_bytes) == (measured.largest_group_bytes,
                                                                  measured.working_bytes), measured.name
    assert saved.working_bytes == loaded.working_bytes
    for rung in RUNGS:
        assert 0 <= loaded.needs(rung) - saved.needs(rung) <= LOAD_TIME_BUFFERS_BYTES, rung


def test_half_precision_halves_the_floating_weights(tiny: ModelOnDisk) -> None:
    full = saved_footprint(tiny.model_id, tiny.source, tiny.params_schema, dtype_bytes=4)
    half = saved_footprint(tiny.model_id, tiny.source, tiny.params_schema, dtype_bytes=2)

    assert half.weights_bytes * 2 == pytest.approx(full.weights_bytes, abs=LOAD_TIME_BUFFERS_BYTES)
    assert half.working_bytes < full.working_bytes


@pytest.mark.parametrize(("name", "explicit", "group"), [
    pytest.param("conv_in.weight", (), None, id="a plain child: top level"),
    pytest.param("down_blocks.1.resnets.0.conv1.weight", (), "down_blocks.1", id="an indexed child: its own group"),
    pytest.param("mid_block.resnets.0.conv1.weight", (), None, id="a block that is no list: top level"),
    pytest.param("encoder.down_blocks.0.resnets.0.norm1.weight", ("encoder",), "encoder.down_blocks.0",
                 id="inside a listed block module: cut like a module of its own"),
    pytest.param("encoder.conv_in.weight", ("encoder",), None, id="a listed module's plain child: top level"),
    pytest.param("quant_conv.weight", ("quant_conv",), None, id="a listed leaf: top level"),
    pytest.param("text_model.encoder.layers.3.mlp.fc1.weight", (), None, id="a text encoder: one unmatched group"),
])
def test_a_tensor_falls_in_the_group_block_level_offload_gives_it(name: str, explicit: tuple[str, ...],
                                                                   group: str | None) -> None:
    assert block_group_of(name.split("."), explicit) == group
