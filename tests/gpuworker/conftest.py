"""Fixtures for the GPU worker's tests: the tiny model (built once per session) and its pipeline.

Everything runs on CPU with one torch thread: with other processes busy, more threads make the
tiny pipeline slower, not faster (measured: 5-20x slower with 2 threads on a busy 2-core machine).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpuworker.support import GatedPipeline

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is written, never downloaded


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models dir holding the tiny model as models_dir/tiny (what --models-dir is given)."""
    from gpuworker.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "tiny")
    return root


@pytest.fixture(scope="session")
def tiny_manifest(models_dir: Path) -> Path:
    return models_dir / "tiny" / "manifest.json"


@pytest.fixture(scope="session")
def tiny_pipeline(models_dir: Path) -> Any:
    """The tiny model loaded on CPU by the worker's own loader (shared: tests must not change it)."""
    from gpuworker.installed import discover_models
    from gpuworker.pipelines import DiffusersPipeline

    (model,) = discover_models(models_dir)
    return DiffusersPipeline.load(model, "cpu")


@pytest.fixture
def gated_pipeline(tiny_pipeline: Any) -> Iterator[GatedPipeline]:
    gated = GatedPipeline(tiny_pipeline)
    yield gated
    gated.gate.set()  # never leave a denoising thread parked
