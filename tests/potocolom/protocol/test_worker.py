"""The worker socket's messages (potocolom/protocol/worker.py), both ways: every message a side
writes, sent as JSON text, reads back as the same value; what is off the contract is refused with
MessageError (UnknownMessage for a type this side does not handle); the optional fields of a `job`
and a `welcome` are read as absent when they are off the contract; a v1 peer never sees a v2 field.
Previews are in test_worker_messages_preview.py, placement's fields in test_placement_messages.py."""
from __future__ import annotations

import json
import typing
import uuid
from typing import Any

import pytest

from potocolom.protocol.errors import MessageError
from potocolom.protocol.worker import (
    MAX_CHECKPOINT_CHARS,
    MAX_HELD_JOBS,
    MAX_MODELS,
    MAX_STEPS,
    REASON_CHARS,
    ApiMessage,
    Cancel,
    Draining,
    FrameOrder,
    FrameResult,
    Heartbeat,
    Hello,
    InstalledEntry,
    JobAck,
    JobCheckpoint,
    JobFailed,
    JobOrder,
    JobPreempted,
    JobProgress,
    JobResult,
    JobStarted,
    LoadModel,
    ModelEntry,
    ModelLoaded,
    ModelLoadFailed,
    ModelUnloaded,
    Preempt,
    Resume,
    RungChanged,
    SessionAccepted,
    SessionEnd,
    SessionEnded,
    SessionRefused,
    SessionStart,
    UnknownMessage,
    UnloadModel,
    Welcome,
    WorkerMessage,
    parse_api_message,
    parse_worker_message,
)

JOB = "5b0f6c1e-3d7a-4c1b-9f0e-2a8d4e6b7c91"
OTHER_JOB = "8a1c7c3e-3f5e-4c55-9d8e-7c1f1f3b2a10"
SESSION = "c2e8a4f0-7b1d-4e5a-8c3f-9d6b1a2e4f70"
GPU = {"name": "NVIDIA H200", "total_mib": 143771, "free_mib": 139920}
NEEDS = {"full": 4002, "model_offload": 3355, "group_offload": 2425}
TINY = ModelEntry("tiny-sd", "full", True, 41.7, 4, 12.5)
SD15 = ModelEntry("sd15", "model_offload")
CHECKPOINT = "UEsDBBQAAAAI"  # base64
ALICE_KEY = "9f1c0b6e2d7a4c58b3e1f0a9d8c7b6a5"  # the opaque account key of alice's jobs
PARAMS = {"prompt": "a lighthouse at dusk", "width": 256, "height": 256, "steps": 20, "seed": 7}

WORKER_MESSAGES = [
    Hello("gpu-a:0", GPU, (TINY, SD15)),
    Hello("gpu-a:0", None, ()),
    Hello("gpu-a:0", GPU, (TINY,), protocol=2, jobs=(JOB, OTHER_JOB)),
    Hello("gpu-a:0", GPU, (), protocol=2, installed=(InstalledEntry("sd15", NEEDS, 31.5),)),
    JobStarted(JOB),
    JobProgress(JOB, 5, 20),
    JobResult(JOB, ["iVBORw0KGgo=", "data:image/png;base64,iVBORw0KGgo="], 1371.6, "full"),
    JobResult(JOB, ["iVBORw0KGgo="], None, "group_offload"),
    JobFailed(JOB, "out of memory on rung group_offload, the lowest there is"),
    JobPreempted(JOB, 9, 20, CHECKPOINT),
    JobPreempted(JOB, 0, 20, None),
    JobCheckpoint(JOB, 12, 20, CHECKPOINT),
    RungChanged(ModelEntry("tiny-sd", "model_offload")),
    SessionAccepted(SESSION),
    SessionRefused(SESSION, "no free realtime slot for model tiny-sd (4 in use)"),
    FrameResult(SESSION, 42, "/9j/4AAQSkZJRg==", 38.2, 2),
    FrameResult(SESSION, 0, "/9j/4AAQSkZJRg==", None),
    Heartbeat(),
    Draining(),
    SessionEnded(SESSION),
    ModelLoaded(TINY, None),
    ModelLoadFailed("sdxl", "not installed", GPU),
    ModelUnloaded("sd15", None),
]

API_MESSAGES = [
    Welcome([], 10.0, 500.0),
    Welcome(["sdxl"], None, None),
    Welcome([], 10.0, 500.0, protocol=2, checkpoint_seconds=10.0, preview_steps=4),
    JobAck(JOB),
    JobOrder(JOB, 1, "tiny-sd", PARAMS),
    JobOrder(JOB, 2, "tiny-sd", PARAMS, priority=3, account=ALICE_KEY, resume=Resume(12, CHECKPOINT)),
    JobOrder(JOB, 1, "tiny-sd", {}, priority=0, account=ALICE_KEY),
    Cancel(JOB),
    Preempt(JOB),
    SessionStart(SESSION, "tiny-sd", {"width": 256, "height": 256, "steps": 2}),
    SessionStart(SESSION, "tiny-sd"),
    SessionEnd(SESSION),
    FrameOrder(SESSION, 42, "iVBORw0KGgo=", {"prompt": "a red fox, watercolour", "strength": 0.6}),
    FrameOrder(SESSION, 43, "iVBORw0KGgo="),
    LoadModel("sdxl", "group_offload"),
    UnloadModel("sdxl"),
]


def over_the_wire(message: Any) -> Any:
    return json.loads(json.dumps(message.to_wire()))


@pytest.mark.parametrize("message", WORKER_MESSAGES, ids=repr)
def test_what_a_worker_writes_the_api_reads_back_unchanged(message: WorkerMessage) -> None:
    assert parse_worker_message(over_the_wire(message)) == message


@pytest.mark.parametrize("message", API_MESSAGES, ids=repr)
def test_what_the_api_writes_a_worker_reads_back_unchanged(message: ApiMessage) -> None:
    assert parse_api_message(over_the_wire(message)) == message


@pytest.mark.parametrize(("union", "table"), [(WorkerMessage, WORKER_MESSAGES), (ApiMessage, API_MESSAGES)])
def test_every_message_of_the_socket_is_in_the_round_trip_tables(union: Any, table: list[Any]) -> None:
    assert set(typing.get_args(union)) == {type(message) for message in table}


@pytest.mark.parametrize("parse", [parse_worker_message, parse_api_message])
@pytest.mark.parametrize("message", [[], "hello", None, 7])
def test_it_refuses_a_message_that_is_not_an_object(parse: Any, message: Any) -> None:
    with pytest.raises(MessageError) as refused:
        parse(message)
    assert not isinstance(refused.value, UnknownMessage)


@pytest.mark.parametrize(("parse", "message"), [
    pytest.param(parse_worker_message, {"type": "gossip"}, id="worker: an unknown type"),
    pytest.param(parse_worker_message, {"job_id": JOB}, id="worker: no type"),
    pytest.param(parse_worker_message, {"type": "welcome", "unknown_models": []}, id="worker: the API's welcome"),
    pytest.param(parse_api_message, {"type": "gossip"}, id="api: an unknown type"),
    pytest.param(parse_api_message, {"type": ["job"], "job_id": JOB}, id="api: a type that is not a string"),
    pytest.param(parse_api_message, Hello("gpu-a:0", None, ()).to_wire(), id="api: a worker's hello"),
])
def test_it_refuses_a_type_its_side_does_not_handle_as_unknown(parse: Any, message: dict[str, Any]) -> None:
    with pytest.raises(UnknownMessage):
        parse(message)


def hello(**fields: Any) -> dict[str, Any]:
    return {"type": "hello", "worker_id": "gpu-a:0", "gpu": GPU, "models": [], **fields}


def entry(model_id: str = "sd15", **fields: Any) -> dict[str, Any]:
    return {"model_id": model_id, "rung": "full", **fields}


def held_jobs(count: int) -> list[str]:
    return [str(uuid.UUID(int=n)) for n in range(count)]


def step_report(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "job_id": JOB, "step": 9, "steps": 20, "checkpoint": CHECKPOINT, **fields}


@pytest.mark.parametrize("message", [
    pytest.param(hello(worker_id=None), id="hello: no worker_id"),
    pytest.param(hello(worker_id=""), id="hello: an empty worker_id"),
    pytest.param(hello(worker_id=7), id="hello: a worker_id that is not a string"),
    pytest.param(hello(worker_id="w" * 201), id="hello: a worker_id over 200 characters"),
    pytest.param(hello(gpu="NVIDIA H200"), id="hello: a gpu that is not an object"),
    pytest.param(hello(models=None), id="hello: no models"),
    pytest.param(hello(models=[entry(f"m{n}") for n in range(MAX_MODELS + 1)]), id="hello: too many models"),
    pytest.param(hello(models=[entry(), entry(rung="model_offload")]), id="hello: a model twice"),
    pytest.param(hello(models=["sd15"]), id="hello: a model that is not an object"),
    pytest.param(hello(models=[entry(rung="turbo")]), id="hello: an unknown rung"),
    pytest.param(hello(models=[entry(realtime="yes")]), id="hello: realtime not a boolean"),
    pytest.param(hello(models=[entry(realtime=True, realtime_slots=-1)]), id="hello: negative slots"),
    pytest.param(hello(models=[entry(realtime=True, realtime_slots=True)]), id="hello: slots a boolean"),
    pytest.param(hello(models=[entry(frame_ms_p95=-1.0)]), id="hello: a negative frame time"),
    pytest.param(hello(protocol=True), id="hello: protocol a boolean"),
    pytest.param(hello(protocol="2"), id="hello: protocol a string"),
    pytest.param(hello(protocol=0), id="hello: protocol below 1"),
    pytest.param(hello(protocol=2, jobs=JOB), id="hello v2: jobs not a list"),
    pytest.param(hello(protocol=2, jobs=None), id="hello v2: jobs null"),
    pytest.param(hello(protocol=2, jobs=["job-1"]), id="hello v2: a held job that is not a UUID"),
    pytest.param(hello(protocol=2, jobs=held_jobs(MAX_HELD_JOBS + 1)), id="hello v2: too many held jobs"),
    pytest.param({"type": "job_started", "job_id": "job-1"}, id="started: a job_id that is not a UUID"),
    pytest.param({"type": "job_started"}, id="started: no job_id"),
    # uuid.UUID would read it (it drops every hyphen); the id is capped at 64 characters first
    pytest.param({"type": "job_started", "job_id": "-" * 33 + JOB.replace("-", "")}, id="started: a long id"),
    pytest.param({"type": "job_progress", "job_id": JOB, "step": "5", "steps": 20}, id="progress: a string step"),
    pytest.param({"type": "job_progress", "job_id": JOB, "step": True, "steps": 20}, id="progress: a boolean step"),
    pytest.param({"type": "job_progress", "job_id": JOB, "step": -1, "steps": 20}, id="progress: a negative step"),
    pytest.param({"type": "job_progress", "job_id": JOB, "step": 5}, id="progress: no steps"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": []}, id="result: no image"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": "iVBO"}, id="result: images not a list"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": [1]}, id="result: an image not a string"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": ["iVBO"], "rung": 1}, id="result: a rung not text"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": ["iVBO"], "gpu_ms": -1}, id="result: negative ms"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": ["iVBO"], "gpu_ms": True}, id="result: boolean ms"),
    pytest.param({"type": "job_failed", "job_id": JOB}, id="failed: no error"),
    pytest.param({"type": "job_failed", "job_id": JOB, "error": 500}, id="failed: an error not a string"),
    pytest.param(step_report("job_preempted", step=21), id="preempted: step past steps"),
    pytest.param(step_report("job_preempted", step=0, steps=0), id="preempted: no steps"),
    pytest.param(step_report("job_preempted", step=0, steps=MAX_STEPS + 1), id="preempted: steps past MAX_STEPS"),
    pytest.param(step_report("job_preempted", step=-1), id="preempted: a negative step"),
    pytest.param(step_report("job_preempted", step="9"), id="preempted: a string step"),
    pytest.param(step_report("job_preempted", step=True), id="preempted: a boolean step"),
    pytest.param(step_report("job_preempted", checkpoint="not base64!"), id="preempted: a checkpoint not base64"),
    pytest.param(step_report("job_preempted", checkpoint=12), id="preempted: a checkpoint not a string"),
    pytest.param(step_report("job_preempted", checkpoint="A" * (MAX_CHECKPOINT_CHARS + 4)),
                 id="preempted: a checkpoint over MAX_CHECKPOINT_CHARS"),
    pytest.param(step_report("job_preempted", job_id="job-1"), id="preempted: a job_id that is not a UUID"),
    pytest.param(step_report("job_checkpoint", checkpoint=None), id="checkpoint: a null checkpoint"),
    pytest.param(step_report("job_checkpoint", step=21), id="checkpoint: step past steps"),
    pytest.param({"type": "rung_changed", "model_id": "tiny-sd", "rung": "turbo"}, id="rung_changed: unknown rung"),
    pytest.param({"type": "session_accepted"}, id="accepted: no session_id"),
    pytest.param({"type": "session_refused", "session_id": SESSION, "reason": 4}, id="refused: a reason not text"),
    pytest.param({"type": "session_refused", "session_id": "s-1"}, id="refused: a session_id not a UUID"),
    pytest.param({"type": "frame_result", "session_id": SESSION, "seq": 1}, id="frame_result: no image"),
    pytest.param({"type": "frame_result", "session_id": SESSION, "seq": 1, "image": ""}, id="frame_result: empty"),
    pytest.param({"type": "frame_result", "session_id": SESSION, "seq": -1, "image": "/9j/"}, id="frame_result: seq<0"),
    pytest.param({"type": "frame_result", "session_id": SESSION, "seq": True, "image": "/9j/"},
                 id="frame_result: a boolean seq"),
    pytest.param({"type": "session_ended", "session_id": "s-1"}, id="session_ended: a session_id not a UUID"),
    pytest.param({"type": "model_load_failed", "model_id": "sd15", "error": 5, "gpu": None}, id="load_failed: error"),
    pytest.param({"type": "model_unloaded", "model_id": "m" * 201, "gpu": None}, id="unloaded: a long model_id"),
])
def test_it_refuses_a_worker_message_off_the_contract(message: dict[str, Any]) -> None:
    with pytest.raises(MessageError):
        parse_worker_message(message)


def frame(**fields: Any) -> dict[str, Any]:
    return {"type": "frame", "session_id": SESSION, "seq": 42, "image": "iVBORw0KGgo=", **fields}


@pytest.mark.parametrize("message", [
    pytest.param({"type": "job", "attempt": 1, "model_id": "tiny-sd"}, id="job: no job_id"),
    pytest.param({"type": "job", "job_id": "", "attempt": 1, "model_id": "tiny-sd"}, id="job: an empty job_id"),
    pytest.param({"type": "job", "job_id": "j" * 201, "model_id": "tiny-sd"}, id="job: a job_id over 200 characters"),
    pytest.param({"type": "job", "job_id": JOB, "attempt": 1}, id="job: no model_id"),
    pytest.param({"type": "cancel"}, id="cancel: no job_id"),
    pytest.param({"type": "preempt", "job_id": 7}, id="preempt: a job_id that is not a string"),
    pytest.param({"type": "job_ack"}, id="job_ack: no job_id"),
    pytest.param({"type": "session_start", "model_id": "tiny-sd"}, id="session_start: no session_id"),
    pytest.param({"type": "session_start", "session_id": SESSION}, id="session_start: no model_id"),
    pytest.param({"type": "session_end", "session_id": "s" * 201}, id="session_end: a session_id over 200"),
    pytest.param(frame(seq=None), id="frame: no seq"),
    pytest.param(frame(seq="42"), id="frame: a string seq"),
    pytest.param(frame(seq=True), id="frame: a boolean seq"),
    pytest.param(frame(image=""), id="frame: an empty image"),
    pytest.param(frame(image=5), id="frame: an image that is not a string"),
    pytest.param(frame(params="strength=0.6"), id="frame: params that are not an object"),
])
def test_it_refuses_an_api_message_off_the_contract(message: dict[str, Any]) -> None:
    with pytest.raises(MessageError):
        parse_api_message(message)


def assert_read_as(parsed: Any, read: Any) -> None:
    """`parsed` is `read`, and writes the same JSON (True == 1 in Python, not on the wire)."""
    assert parsed == read
    assert json.dumps(parsed.to_wire()) == json.dumps(read.to_wire())


def test_it_reads_a_worker_id_of_200_characters_and_a_checkpoint_of_max_checkpoint_chars() -> None:
    assert parse_worker_message(hello(worker_id="w" * 200)).worker_id == "w" * 200  # type: ignore[union-attr]
    longest = "A" * MAX_CHECKPOINT_CHARS
    assert parse_worker_message(step_report("job_checkpoint", checkpoint=longest)) == JobCheckpoint(JOB, 9, 20, longest)


def test_a_worker_s_job_ids_are_read_in_canonical_form_and_a_held_job_listed_twice_once() -> None:
    assert parse_worker_message({"type": "job_started", "job_id": JOB.upper()}) == JobStarted(JOB)
    parsed = parse_worker_message(hello(protocol=2, jobs=[JOB, "{" + OTHER_JOB + "}", JOB.upper()]))
    assert isinstance(parsed, Hello) and parsed.jobs == (JOB, OTHER_JOB)


@pytest.mark.parametrize(("message", "read"), [
    pytest.param({"type": "job_failed", "job_id": JOB, "error": ""}, JobFailed(JOB, "failed"), id="an empty error"),
    pytest.param({"type": "session_refused", "session_id": SESSION}, SessionRefused(SESSION, ""), id="no reason"),
    pytest.param({"type": "session_refused", "session_id": SESSION, "reason": "r" * 900},
                 SessionRefused(SESSION, "r" * REASON_CHARS), id="a reason cut to REASON_CHARS"),
    pytest.param({"type": "job_result", "job_id": JOB, "images": ["iVBO"]}, JobResult(JOB, ["iVBO"], None, ""),
                 id="a result without rung or gpu_ms"),
    *(pytest.param({"type": "frame_result", "session_id": SESSION, "seq": 1, "image": "/9j/", "batch_size": batch},
                   FrameResult(SESSION, 1, "/9j/", None, 1), id=f"batch_size {batch!r} read as 1")
      for batch in (0, True, "2", None)),
])
def test_it_reads_a_worker_s_optional_fields_with_their_defaults(message: dict[str, Any], read: Any) -> None:
    assert_read_as(parse_worker_message(message), read)


def job(**fields: Any) -> dict[str, Any]:
    return {"type": "job", "job_id": JOB, "attempt": 2, "model_id": "tiny-sd", "params": PARAMS, **fields}


@pytest.mark.parametrize(("fields", "read"), [
    ({"attempt": True}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": None}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": 1, "priority": True}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": 1, "priority": "3"}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": 1, "account": ""}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": 1, "account": "a" * 201}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
    ({"attempt": 1, "account": 7}, JobOrder(JOB, 1, "tiny-sd", PARAMS)),
])
def test_a_job_with_an_attempt_priority_or_account_off_the_contract_still_runs(fields: dict[str, Any],
                                                                                read: JobOrder) -> None:
    assert_read_as(parse_api_message(job(**fields)), read)


@pytest.mark.parametrize("resume", [
    "12:UEsDBBQAAAAI",
    {"checkpoint": CHECKPOINT},
    {"step": -1, "checkpoint": CHECKPOINT},
    {"step": True, "checkpoint": CHECKPOINT},
    {"step": "12", "checkpoint": CHECKPOINT},
    {"step": 12},
    {"step": 12, "checkpoint": ""},
    {"step": 12, "checkpoint": 12},
    {"step": 12, "checkpoint": "A" * (MAX_CHECKPOINT_CHARS + 4)},
], ids=lambda resume: repr(resume)[:60])
def test_a_job_whose_resume_is_off_the_contract_runs_from_step_0(resume: Any) -> None:
    parsed = parse_api_message(job(priority=3, account=ALICE_KEY, resume=resume))
    assert parsed == JobOrder(JOB, 2, "tiny-sd", PARAMS, priority=3, account=ALICE_KEY)


def test_a_hello_without_protocol_is_v1_with_no_held_jobs_and_no_installed_models() -> None:
    parsed = parse_worker_message(hello(jobs=[JOB], models=[entry()]))
    assert parsed == Hello("gpu-a:0", GPU, (ModelEntry("sd15", "full"),), protocol=1, jobs=(), installed=None)
    # what v1 never reads cannot make a v1 hello invalid
    assert parse_worker_message(hello(jobs="not a list")) == Hello("gpu-a:0", GPU, ())


def test_a_v1_hello_and_a_v1_welcome_are_written_without_any_v2_field() -> None:
    assert set(Hello("gpu-a:0", GPU, (TINY,)).to_wire()) == {"type", "worker_id", "gpu", "models"}
    v1 = Welcome([], 10.0, 500.0, checkpoint_seconds=10.0).to_wire()
    assert set(v1) == {"type", "unknown_models", "heartbeat_seconds", "frame_budget_ms"}
    v2 = Welcome([], 10.0, 500.0, protocol=2, checkpoint_seconds=10.0).to_wire()
    assert v2["protocol"] == 2 and v2["checkpoint_seconds"] == 10.0


def test_a_protocol_above_v2_is_spoken_as_v2() -> None:
    assert parse_worker_message(hello(protocol=7, jobs=[JOB])) == Hello("gpu-a:0", GPU, (), protocol=2, jobs=(JOB,))
    assert parse_api_message({**Welcome([], 10.0, None).to_wire(), "protocol": 3}).protocol == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "read"), [
    pytest.param({"protocol": "2", "checkpoint_seconds": 10}, Welcome([], 10.0, None), id="an odd protocol is v1"),
    pytest.param({"protocol": True, "checkpoint_seconds": 10}, Welcome([], 10.0, None), id="a boolean protocol"),
    pytest.param({"checkpoint_seconds": 10}, Welcome([], 10.0, None), id="checkpoints in v1 are ignored"),
    pytest.param({"protocol": 2, "checkpoint_seconds": -5}, Welcome([], 10.0, None, 2), id="negative checkpoints"),
    pytest.param({"protocol": 2, "checkpoint_seconds": True}, Welcome([], 10.0, None, 2), id="boolean checkpoints"),
    pytest.param({"heartbeat_seconds": 0}, Welcome([], None, None), id="a zero heartbeat is not usable"),
    pytest.param({"heartbeat_seconds": True}, Welcome([], None, None), id="a boolean heartbeat is not usable"),
    pytest.param({"heartbeat_seconds": "10"}, Welcome([], None, None), id="a string heartbeat is not usable"),
    pytest.param({"frame_budget_ms": True}, Welcome([], 10.0, None), id="a boolean frame budget"),
    pytest.param({"unknown_models": "sdxl"}, Welcome([], 10.0, None), id="unknown_models not a list"),
])
def test_a_welcome_reads_what_is_off_the_contract_as_absent(fields: dict[str, Any], read: Welcome) -> None:
    assert parse_api_message({"type": "welcome", "unknown_models": [], "heartbeat_seconds": 10, **fields}) == read


V1_JOB_FIELDS = {"type", "job_id", "attempt", "model_id", "params"}


@pytest.mark.parametrize(("order", "v2_fields"), [
    (JobOrder(JOB, 1, "tiny-sd", PARAMS), set()),
    (JobOrder(JOB, 1, "tiny-sd", PARAMS, priority=0), {"priority"}),
    (JobOrder(JOB, 1, "tiny-sd", PARAMS, account=ALICE_KEY), {"account"}),
    (JobOrder(JOB, 1, "tiny-sd", PARAMS, resume=Resume(0, CHECKPOINT)), {"resume"}),
    (JobOrder(JOB, 1, "tiny-sd", PARAMS, priority=3, account=ALICE_KEY, resume=Resume(12, CHECKPOINT)),
     {"priority", "account", "resume"}),
])
def test_a_job_is_written_with_each_v2_field_only_when_it_is_set(order: JobOrder, v2_fields: set[str]) -> None:
    # the API leaves all three None for a v1 worker: that is what makes its job a v1 job
    assert set(order.to_wire()) == V1_JOB_FIELDS | v2_fields
