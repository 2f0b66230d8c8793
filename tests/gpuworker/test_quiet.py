"""The worker's log set-up (gpuworker/quiet.py): the libraries' progress bars and empty notices are
gone, their real warnings are not ("Logs" in docs/operations.md)."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from gpuworker.quiet import quiet_libraries


@pytest.fixture(autouse=True)
def quiet() -> None:
    quiet_libraries()
    quiet_libraries()  # twice, as a worker loading models on demand may: still one filter each


def test_the_libraries_draw_no_progress_bars(capsys) -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    assert list(diffusers_logging.tqdm(range(3), desc="Loading pipeline components...")) == [0, 1, 2]
    assert list(transformers_logging.tqdm(range(3), desc="Loading weights")) == [0, 1, 2]

    assert capsys.readouterr().err == ""  # tqdm draws on sys.stderr


def test_a_vae_cast_says_nothing_about_an_empty_float32_list(caplog) -> None:
    import torch
    from diffusers import AutoencoderKL

    vae: Any = AutoencoderKL(block_out_channels=(8,), layers_per_block=1, norm_num_groups=8, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))

    with caplog.at_level(logging.WARNING):
        vae.to(torch.float32)  # what SDXL's and SD3's pipelines do to their VAE at each decode

    assert caplog.records == []


def test_the_torchvision_notice_is_dropped_and_real_warnings_still_show(caplog) -> None:
    caplog.set_level(logging.WARNING)
    logging.getLogger("transformers.utils.import_utils").warning(
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`")
    logging.getLogger("diffusers.models.modeling_utils").warning(
        "There are modules in UNet that should be kept in float32: ['proj_out'].")
    logging.getLogger("transformers.modeling_utils").warning("Some weights of CLIPTextModel were not initialized")

    assert [record.getMessage() for record in caplog.records] == [
        "There are modules in UNet that should be kept in float32: ['proj_out'].",
        "Some weights of CLIPTextModel were not initialized"]
