"""The event series of GET /metrics: prometheus-client objects of this process, observed where each
event happens (a dispatch's claim, a worker's job_preempted, a frame's result sent to its browser, a
model load). Imports no app. The story, and the series read from the database: docs/operations.md, "Metrics"."""
from __future__ import annotations

from typing import Literal

from prometheus_client import Counter, Histogram

PreemptionReason = Literal["pause", "drain", "priority", "move"]
PREEMPTION_REASONS: tuple[PreemptionReason, ...] = ("pause", "drain", "priority", "move")
ModelLoadOutcome = Literal["loaded", "failed"]

# Submission to dispatch: from well under a second (a free worker) to the queue's worst hours.
JOB_WAIT_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# A frame's round trip around FRAME_BUDGET_MS (500 ms by default).
FRAME_BUCKETS_SECONDS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2, 5)
# From a tiny model's second to a large one read from a slow disk.
MODEL_LOAD_BUCKETS_SECONDS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
# |eta - actual| / actual of a job's first estimated wait: 0.1 is within 10 %, 1 off by the whole wait.
ETA_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)

JOB_WAIT_SECONDS = Histogram(
    "potocolom_job_wait_seconds", "Time from a job's submission to its dispatch (each claim of this process)",
    buckets=JOB_WAIT_BUCKETS_SECONDS)
FRAME_SECONDS = Histogram(
    "potocolom_frame_seconds", "Time from a browser's frame arriving to its result sent back (this process)",
    ["model_id"], buckets=FRAME_BUCKETS_SECONDS)
PREEMPTIONS = Counter(
    "potocolom_preemptions", "Jobs a worker of this process gave back at a step boundary, by why", ["reason"])
MODEL_LOADS = Counter(
    "potocolom_model_loads", "Model loads a worker of this process reported, by model and outcome",
    ["model_id", "outcome"])
MODEL_LOAD_SECONDS = Histogram(
    "potocolom_model_load_seconds", "Time a worker took to load a model (loads reported to this process)",
    buckets=MODEL_LOAD_BUCKETS_SECONDS)

ETA_ERROR_RATIO = Histogram(
    "potocolom_eta_error_ratio", "How far off a job's first eta_seconds was when it started: |eta - actual| / actual "
    "(jobs estimated and started on this process)", buckets=ETA_ERROR_BUCKETS)

for _reason in PREEMPTION_REASONS:  # known from the start: each reads 0 until it happens
    PREEMPTIONS.labels(_reason)


def job_dispatched(*, wait_seconds: float) -> None:
    """A job was claimed for a worker `wait_seconds` after its submission."""
    JOB_WAIT_SECONDS.observe(max(0.0, wait_seconds))


def job_preempted(*, reason: PreemptionReason) -> None:
    """A worker gave a job back at a step boundary."""
    PREEMPTIONS.labels(reason).inc()


def frame_seconds_of(model_id: str) -> Histogram:
    """The frame histogram of one model, looked up once per session (the frame path is hot)."""
    return FRAME_SECONDS.labels(model_id)


def model_load_finished(*, model_id: str, registered: bool, outcome: ModelLoadOutcome, seconds: float | None) -> None:
    """A worker reported a load (model_loaded or model_load_failed); a load's time when it said one.
    A model the registry does not know counts in no series: a worker never makes one (any string
    may be a model id, so no fixed label could stand for all of them without meeting a real one)."""
    if registered:
        MODEL_LOADS.labels(model_id, outcome).inc()
    if seconds is not None:
        MODEL_LOAD_SECONDS.observe(max(0.0, seconds))


def eta_checked(*, error_ratio: float) -> None:
    """A job that had an estimated wait started: how far off its first estimate was."""
    ETA_ERROR_RATIO.observe(max(0.0, error_ratio))
