"""job_progress previews and welcome's preview_steps: parsed once, built once (v2)."""
from __future__ import annotations

from potocolom.protocol.worker import (
    MAX_PREVIEW_CHARS,
    PROTOCOL_V2,
    JobProgress,
    Welcome,
    parse_api_message,
    parse_worker_message,
)

JOB_ID = "8a1c7c3e-3f5e-4c55-9d8e-7c1f1f3b2a10"


def test_a_progress_preview_goes_both_ways() -> None:
    sent = JobProgress(JOB_ID, 4, 20, "/9j/4AAQ")
    assert parse_worker_message(sent.to_wire()) == sent


def test_a_progress_without_a_preview_says_none() -> None:
    wire = JobProgress(JOB_ID, 1, 2).to_wire()
    assert "preview" not in wire
    assert parse_worker_message(wire) == JobProgress(JOB_ID, 1, 2)


def test_a_bad_preview_is_dropped_and_the_progress_kept() -> None:
    for bad in (12, "", "x" * (MAX_PREVIEW_CHARS + 1), ["a"]):
        wire = {"type": "job_progress", "job_id": JOB_ID, "step": 3, "steps": 9, "preview": bad}
        assert parse_worker_message(wire) == JobProgress(JOB_ID, 3, 9)


def test_a_v2_welcome_carries_preview_steps_and_a_v1_one_does_not() -> None:
    v2 = Welcome([], 10.0, None, protocol=PROTOCOL_V2, preview_steps=4)
    assert parse_api_message(v2.to_wire()).preview_steps == 4
    v1 = Welcome([], 10.0, None, preview_steps=4).to_wire()
    assert "preview_steps" not in v1 and parse_api_message(v1).preview_steps == 0
