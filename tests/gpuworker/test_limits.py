"""The worker's caps (MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, MAX_STEPS): read from the environment, used by
the memory estimates for the largest size a model allows, and enforced on the jobs it runs; and the
lists a worker keeps for days stay bounded."""
from __future__ import annotations

import base64
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from gpuworker.footprints import pipeline_footprint
from gpuworker.frames import FrameRunner, QueuedFrame, SessionParams
from gpuworker.inputs import ParamsRefused
from gpuworker.installed import ModelOnDisk, discover_models
from gpuworker.limits import Limits, allowed_maximum
from gpuworker.loading import load_pipelines
from gpuworker.pipelines import DiffusersPipeline
from tests.gpuworker.support import TEST_SECONDS
from tests.gpuworker.test_sessions import RED

NO_MAXIMUM = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"type": "string"}, "width": {"type": "integer"}, "height": {"type": "integer"},
    "steps": {"type": "integer", "minimum": 1}}}


@pytest.fixture(scope="module")
def unbounded_model(models_dir: Path) -> ModelOnDisk:
    """The tiny model under a schema that sets no maximum for width, height or steps."""
    (model,) = discover_models(models_dir)
    return dataclasses.replace(model, params_schema=NO_MAXIMUM)


def test_the_limits_default_to_the_contract_and_read_the_environment() -> None:
    assert Limits.from_env({}) == Limits(max_image_pixels=4_194_304, max_image_side=2048, max_steps=150)
    assert Limits.from_env({"MAX_IMAGE_PIXELS": "1000", "MAX_IMAGE_SIDE": " 512 ", "MAX_STEPS": "30"}) == Limits(
        1000, 512, 30)
    for name, text in (("MAX_IMAGE_PIXELS", "lots"), ("MAX_IMAGE_SIDE", "0"), ("MAX_STEPS", "-3")):
        with pytest.raises(ValueError, match=name):
            Limits.from_env({name: text})


@pytest.mark.parametrize(("spec", "expected"), [
    ({"type": "integer", "enum": [64, 512, 256]}, 512),
    ({"type": "integer", "minimum": 8, "maximum": 1024}, 1024),
    ({"type": "integer"}, 2048),  # no maximum: the cap
    ({"type": "integer", "enum": ["x", True]}, 2048),
    (None, 2048),  # not in the schema at all
])
def test_the_largest_allowed_value_is_the_schemas_or_the_cap(spec: Any, expected: int) -> None:
    schema = {"properties": {"width": spec}} if spec is not None else {"properties": {}}
    assert allowed_maximum(schema, "width", 2048) == expected


def test_the_memory_estimate_covers_max_image_side_when_the_schema_sets_no_maximum(
        tiny_pipeline: Any, unbounded_model: ModelOnDisk) -> None:
    pipe, model_id = tiny_pipeline.pipe, unbounded_model.model_id
    unbounded = pipeline_footprint(model_id, pipe, NO_MAXIMUM)
    capped = pipeline_footprint(model_id, pipe, NO_MAXIMUM, max_side=256)

    assert unbounded == pipeline_footprint(model_id, pipe, NO_MAXIMUM, size=(2048, 2048))
    assert capped == pipeline_footprint(model_id, pipe, NO_MAXIMUM, size=(256, 256))
    assert capped.working_bytes < unbounded.working_bytes
    # The loader plans with the same figure its limits give.
    loaded = load_pipelines([unbounded_model], "cpu", limits=Limits(max_image_side=256))
    assert loaded.pipelines[unbounded_model.model_id].footprint == capped


def test_a_job_over_max_image_side_or_max_steps_is_refused_where_the_schema_sets_no_maximum(
        tiny_pipeline: Any, unbounded_model: ModelOnDisk) -> None:
    pipeline = DiffusersPipeline(unbounded_model, tiny_pipeline.pipe, tiny_pipeline.img2img, "cpu", "full",
                                 limits=Limits(max_image_side=256, max_steps=10))

    assert pipeline.check_inputs({"prompt": "p", "width": 256, "height": 64, "steps": 10}).width == 256
    with pytest.raises(ParamsRefused, match="width must be between 8 and 256, got 264"):
        pipeline.check_inputs({"prompt": "p", "width": 264})
    with pytest.raises(ParamsRefused, match="steps must be between 1 and 10, got 11"):
        pipeline.check_inputs({"prompt": "p", "steps": 11})
    assert pipeline.check_inputs({"prompt": "p"}).steps == 10  # the default, within the cap
    # A schema's own maximum wins over the cap (the tiny manifest allows 50 steps).
    own = DiffusersPipeline(tiny_pipeline.model, tiny_pipeline.pipe, None, "cpu", "full",
                            limits=Limits(max_steps=10))
    assert own.check_inputs({"prompt": "p", "steps": 50}).steps == 50


def test_a_frame_runner_keeps_only_its_latest_batches(tiny_pipeline: Any) -> None:
    posted: list[dict[str, Any]] = []
    each_posted = threading.Condition()

    def post(message: dict[str, Any]) -> None:
        with each_posted:
            posted.append(message)
            each_posted.notify_all()

    runner = FrameRunner({"tiny-sd": tiny_pipeline}, {"tiny-sd": 1}, post, keep_runs=2)
    params = SessionParams(width=64, height=64, steps=1, guidance_scale=7.5, seed=1)
    try:
        for seq in range(1, 6):
            runner.queue.put(QueuedFrame("s-1", seq, "tiny-sd", params, "a sketch", 1.0, base64.b64decode(RED)))
            assert runner.run_pending() == 1
            assert len(runner.runs) <= 2
        with each_posted:
            assert each_posted.wait_for(lambda: len(posted) == 5, TEST_SECONDS)
    finally:
        runner.close()

    assert runner.batch_sizes == [1, 1] and len(runner.runs) == 2
    assert [m["seq"] for m in posted] == [1, 2, 3, 4, 5]  # every batch ran and was answered
