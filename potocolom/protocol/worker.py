"""The worker socket's messages as typed values, both ways: `parse_worker_message` and
`parse_api_message` read them (MessageError on anything off the contract), `to_wire()` writes them.
The API parses what workers send and builds what it sends them; the worker program does the reverse."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from potocolom.protocol.entries import InstalledEntry as InstalledEntry
from potocolom.protocol.entries import ModelEntry as ModelEntry
from potocolom.protocol.errors import MessageError
from potocolom.protocol.fields import MAX_CHECKPOINT_CHARS as MAX_CHECKPOINT_CHARS
from potocolom.protocol.fields import MAX_PREVIEW_CHARS as MAX_PREVIEW_CHARS
from potocolom.protocol.fields import MAX_STEPS as MAX_STEPS
from potocolom.protocol.fields import (
    Message,
    checkpoint_field,
    int_field,
    number_or_none,
    object_or_none,
    step_fields,
    string_field,
    uuid_field,
)
from potocolom.protocol.fields import checkpoint_bytes as checkpoint_bytes
from potocolom.protocol.rungs import RUNGS

MAX_MODELS = 1000  # model entries in one hello
MAX_HELD_JOBS = 1000  # job ids in a v2 hello's `jobs`
PROTOCOL_V1 = 1  # a hello or welcome without `protocol`
PROTOCOL_V2 = 2  # the highest protocol this code speaks
REASON_CHARS = 500  # session_refused.reason is a short message


# --- worker -> API ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello(Message):
    """The worker's first message. `protocol` 2 (v2) adds `jobs`: the job ids it holds (running,
    waiting, or ended with a final message not yet acknowledged), and `installed`: every model it
    could load (None: a v2 worker that does not say, which the API takes as its loaded models only);
    a v1 hello says neither."""

    type = "hello"
    worker_id: str
    gpu: dict[str, Any] | None
    models: tuple[ModelEntry, ...]
    protocol: int = PROTOCOL_V1
    jobs: tuple[str, ...] = ()
    installed: tuple[InstalledEntry, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "worker_id": self.worker_id, "gpu": self.gpu,
                                "models": [m.to_wire() for m in self.models]}
        if self.protocol >= PROTOCOL_V2:
            wire.update(protocol=self.protocol, jobs=list(self.jobs))
            if self.installed is not None:
                wire["installed"] = [entry.to_wire() for entry in self.installed]
        return wire


@dataclass(frozen=True)
class JobStarted(Message):
    type = "job_started"
    job_id: str


@dataclass(frozen=True)
class JobProgress(Message):
    """Denoising step `step` of `steps`; v2 may add `preview`, a base64 JPEG of the latents (at most
    256 px on the long side, at most every `preview_steps`), relayed to the owner and never stored."""

    type = "job_progress"
    job_id: str
    step: int
    steps: int
    preview: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "job_id": self.job_id, "step": self.step, "steps": self.steps}
        if self.preview is not None:
            wire["preview"] = self.preview
        return wire


@dataclass(frozen=True)
class JobResult(Message):
    type = "job_result"
    job_id: str
    images: list[str]  # base64 PNG or JPEG
    gpu_ms: float | None
    rung: str


@dataclass(frozen=True)
class JobFailed(Message):
    type = "job_failed"
    job_id: str
    error: str


@dataclass(frozen=True)
class JobPreempted(Message):
    """v2: the worker stopped the job at the boundary after `step` of `steps` (0 and no checkpoint
    when it had not started; the answer to `preempt`, or a drain) and no longer holds it.
    `checkpoint`: base64 (at most MAX_CHECKPOINT_CHARS), or None when it could not be captured."""

    type = "job_preempted"
    job_id: str
    step: int
    steps: int
    checkpoint: str | None


@dataclass(frozen=True)
class JobCheckpoint(Message):
    """v2: a running job's state at the boundary after `step`, every `checkpoint_seconds`; what the
    job resumes from if its worker dies."""

    type = "job_checkpoint"
    job_id: str
    step: int
    steps: int
    checkpoint: str


@dataclass(frozen=True)
class RungChanged(Message):
    """After an out-of-memory demotion: the model's whole hello entry on its new rung."""

    type = "rung_changed"
    entry: ModelEntry

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **self.entry.to_wire()}


@dataclass(frozen=True)
class SessionAccepted(Message):
    type = "session_accepted"
    session_id: str


@dataclass(frozen=True)
class SessionRefused(Message):
    type = "session_refused"
    session_id: str
    reason: str


@dataclass(frozen=True)
class FrameResult(Message):
    type = "frame_result"
    session_id: str
    seq: int
    image: str  # bare base64 (or a data: URL), PNG or JPEG
    gpu_ms: float | None
    batch_size: int = 1


@dataclass(frozen=True)
class Heartbeat(Message):
    type = "heartbeat"


@dataclass(frozen=True)
class Draining(Message):
    """v2: the worker is shutting down (SIGTERM): the API sends it no new job and no session; its
    held jobs come back as job_preempted and its sessions as session_ended."""

    type = "draining"


@dataclass(frozen=True)
class SessionEnded(Message):
    """v2: the worker ended a live session itself (a drain): the API sends it back to its queue at
    its old place."""

    type = "session_ended"
    session_id: str


@dataclass(frozen=True)
class ModelLoaded(Message):
    """v2: the answer to load_model: the model's entry as in a hello, and the worker's `gpu` now
    (the API plans with its free memory from then on)."""

    type = "model_loaded"
    entry: ModelEntry
    gpu: dict[str, Any] | None

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, **self.entry.to_wire(), "gpu": self.gpu}


@dataclass(frozen=True)
class ModelLoadFailed(Message):
    """v2: a load_model that did not load (not installed, out of memory, unreadable): why, and the
    worker's `gpu` now."""

    type = "model_load_failed"
    model_id: str
    error: str
    gpu: dict[str, Any] | None


@dataclass(frozen=True)
class ModelUnloaded(Message):
    """v2: the answer to unload_model: the model is freed, and the worker's `gpu` now."""

    type = "model_unloaded"
    model_id: str
    gpu: dict[str, Any] | None


WorkerMessage = (Hello | JobStarted | JobProgress | JobResult | JobFailed | JobPreempted | JobCheckpoint
                 | RungChanged | SessionAccepted | SessionRefused | FrameResult | Heartbeat | Draining
                 | SessionEnded | ModelLoaded | ModelLoadFailed | ModelUnloaded)


def _hello(message: dict[str, Any]) -> Hello:
    gpu = object_or_none(message, "gpu")
    models = message.get("models")
    if not isinstance(models, list) or len(models) > MAX_MODELS:
        raise MessageError("models must be a list")
    entries = tuple(ModelEntry.parse(entry) for entry in models)
    if len({e.model_id for e in entries}) != len(entries):
        raise MessageError("a model_id appears twice in models")
    protocol = _protocol(message)
    jobs: tuple[str, ...] = ()
    if protocol >= PROTOCOL_V2:
        held = message.get("jobs", [])
        if not isinstance(held, list) or len(held) > MAX_HELD_JOBS:
            raise MessageError(f"jobs must be a list of at most {MAX_HELD_JOBS} job ids")
        jobs = tuple(dict.fromkeys(uuid_field({"job_id": job_id}, "job_id") for job_id in held))
    return Hello(string_field(message, "worker_id"), gpu, entries, protocol, jobs,
                 _installed(message) if protocol >= PROTOCOL_V2 else None)


def _installed(message: dict[str, Any]) -> tuple[InstalledEntry, ...] | None:
    """A v2 hello's `installed` (None when it has none); each model once."""
    if message.get("installed") is None:
        return None
    installed = message["installed"]
    if not isinstance(installed, list) or len(installed) > MAX_MODELS:
        raise MessageError(f"installed must be a list of at most {MAX_MODELS} entries")
    entries = tuple(InstalledEntry.parse(entry) for entry in installed)
    if len({entry.model_id for entry in entries}) != len(entries):
        raise MessageError("a model_id appears twice in installed")
    return entries


def _error_text(message: dict[str, Any]) -> str:
    error = message.get("error")
    if not isinstance(error, str):
        raise MessageError("error must be a string")
    return error[:REASON_CHARS]


def _protocol(message: dict[str, Any]) -> int:
    """The protocol a hello or welcome says: 1 without the field, else at most the one spoken here
    (a later version talks to this code in the highest one both know)."""
    value = message.get("protocol", PROTOCOL_V1)
    if isinstance(value, bool) or not isinstance(value, int) or value < PROTOCOL_V1:
        raise MessageError("protocol must be an integer of at least 1")
    return min(value, PROTOCOL_V2)


def _job_result(message: dict[str, Any]) -> JobResult:
    images = message.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
        raise MessageError("images must be a non-empty list of base64 strings")
    rung = message.get("rung", "")
    if not isinstance(rung, str):
        raise MessageError("rung must be a string")
    return JobResult(uuid_field(message, "job_id"), images, number_or_none(message, "gpu_ms"), rung)


def _job_failed(message: dict[str, Any]) -> JobFailed:
    error = message.get("error")
    if not isinstance(error, str):
        raise MessageError("error must be a string")
    return JobFailed(uuid_field(message, "job_id"), error or "failed")


def _job_preempted(message: dict[str, Any]) -> JobPreempted:
    step, steps = step_fields(message)
    return JobPreempted(uuid_field(message, "job_id"), step, steps, checkpoint_field(message, nullable=True))


def _job_checkpoint(message: dict[str, Any]) -> JobCheckpoint:
    step, steps = step_fields(message)
    checkpoint = checkpoint_field(message, nullable=False)
    assert checkpoint is not None
    return JobCheckpoint(uuid_field(message, "job_id"), step, steps, checkpoint)


def _session_refused(message: dict[str, Any]) -> SessionRefused:
    reason = message.get("reason", "")
    if not isinstance(reason, str):
        raise MessageError("reason must be a string")
    return SessionRefused(uuid_field(message, "session_id"), reason[:REASON_CHARS])


def _job_progress(message: dict[str, Any]) -> JobProgress:
    preview = message.get("preview")
    if preview is not None and (not isinstance(preview, str) or not preview or len(preview) > MAX_PREVIEW_CHARS):
        preview = None  # a preview is a nicety: a bad one is dropped, the progress kept
    return JobProgress(uuid_field(message, "job_id"), int_field(message, "step"), int_field(message, "steps"),
                       preview)


def _frame_result(message: dict[str, Any]) -> FrameResult:
    image = message.get("image")
    if not isinstance(image, str) or not image:
        raise MessageError("image must be a base64 string")
    batch = message.get("batch_size", 1)
    batch = batch if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1 else 1
    return FrameResult(uuid_field(message, "session_id"), int_field(message, "seq"), image,
                       number_or_none(message, "gpu_ms"), batch)


_WORKER_PARSERS: dict[str, Callable[[dict[str, Any]], WorkerMessage]] = {
    "hello": _hello,
    "job_started": lambda m: JobStarted(uuid_field(m, "job_id")),
    "job_progress": _job_progress,
    "job_result": _job_result,
    "job_failed": _job_failed,
    "job_preempted": _job_preempted,
    "job_checkpoint": _job_checkpoint,
    "rung_changed": lambda m: RungChanged(ModelEntry.parse(m)),
    "session_accepted": lambda m: SessionAccepted(uuid_field(m, "session_id")),
    "session_refused": _session_refused,
    "frame_result": _frame_result,
    "heartbeat": lambda m: Heartbeat(),
    "model_loaded": lambda m: ModelLoaded(ModelEntry.parse(m), object_or_none(m, "gpu")),
    "model_load_failed": lambda m: ModelLoadFailed(string_field(m, "model_id"), _error_text(m),
                                                   object_or_none(m, "gpu")),
    "model_unloaded": lambda m: ModelUnloaded(string_field(m, "model_id"), object_or_none(m, "gpu")),
    "draining": lambda m: Draining(),
    "session_ended": lambda m: SessionEnded(uuid_field(m, "session_id")),
}


class UnknownMessage(MessageError):
    """A message of a type this side does not handle (logged, never fatal)."""


def parse_worker_message(message: Any) -> WorkerMessage:
    """What a worker sent (the JSON object of one text frame); MessageError when it is off the
    contract, UnknownMessage for a type the API does not handle."""
    if not isinstance(message, dict):
        raise MessageError("a message must be a JSON object")
    parser = _WORKER_PARSERS.get(str(message.get("type")))
    if parser is None:
        raise UnknownMessage(f"unknown message type {str(message.get('type'))[:100]!r}")
    return parser(message)


# --- API -> worker ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Welcome(Message):
    """The answer to a hello; `protocol` 2 only in answer to a v2 hello (a v1 welcome has none)."""

    type = "welcome"
    unknown_models: list[str]
    heartbeat_seconds: float | None  # None: not usable (the worker then uses its own default)
    frame_budget_ms: float | None = None
    protocol: int = PROTOCOL_V1
    checkpoint_seconds: float = 0.0  # v2: JOB_CHECKPOINT_SECONDS, 0 = no periodic job_checkpoint
    preview_steps: int = 0  # v2: PREVIEW_STEPS, a job_progress preview at most every this many steps (0 = none)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "unknown_models": self.unknown_models,
                                "heartbeat_seconds": self.heartbeat_seconds, "frame_budget_ms": self.frame_budget_ms}
        if self.protocol >= PROTOCOL_V2:
            wire.update(protocol=self.protocol, checkpoint_seconds=self.checkpoint_seconds,
                        preview_steps=self.preview_steps)
        return wire


@dataclass(frozen=True)
class JobAck(Message):
    """v2: the API stored a job's `job_result` or `job_failed` (or had nothing to change): the worker
    may forget it."""

    type = "job_ack"
    job_id: str


@dataclass(frozen=True)
class Resume:
    """v2 `job.resume`: the job's stored checkpoint, taken at the boundary after `step`."""

    step: int
    checkpoint: str  # base64, given back as the worker sent it


@dataclass(frozen=True)
class JobOrder(Message):
    """`job`: a job for the worker to run. v2 adds `priority`, `account` (an opaque key, the same
    for all jobs of one account) and, for a job with a stored checkpoint, `resume`; a v1 `job`
    (all three None) has none of them."""

    type = "job"
    job_id: str
    attempt: int
    model_id: str
    params: Any = field(default_factory=dict)  # checked by the pipeline that runs it
    priority: int | None = None
    account: str | None = None
    resume: Resume | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "job_id": self.job_id, "attempt": self.attempt,
                                "model_id": self.model_id, "params": self.params}
        if self.priority is not None:
            wire["priority"] = self.priority
        if self.account is not None:
            wire["account"] = self.account
        if self.resume is not None:
            wire["resume"] = {"step": self.resume.step, "checkpoint": self.resume.checkpoint}
        return wire


@dataclass(frozen=True)
class Cancel(Message):
    type = "cancel"
    job_id: str


@dataclass(frozen=True)
class Preempt(Message):
    """v2: stop the job at its next step boundary (at once if not started) and answer
    `job_preempted` with its checkpoint; the worker then no longer holds it."""

    type = "preempt"
    job_id: str


@dataclass(frozen=True)
class SessionStart(Message):
    type = "session_start"
    session_id: str
    model_id: str
    params: Any = field(default_factory=dict)  # width, height, steps as integers (checked by the worker)


@dataclass(frozen=True)
class SessionEnd(Message):
    type = "session_end"
    session_id: str


@dataclass(frozen=True)
class FrameOrder(Message):
    """`frame`: a browser's frame for a live session (image bare base64, params the browser's own)."""

    type = "frame"
    session_id: str
    seq: int
    image: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadModel(Message):
    """v2: load an installed model, on `rung` (None: the highest that fits); answered by
    model_loaded or model_load_failed."""

    type = "load_model"
    model_id: str
    rung: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.type, "model_id": self.model_id}
        if self.rung is not None:
            wire["rung"] = self.rung
        return wire


@dataclass(frozen=True)
class UnloadModel(Message):
    """v2: free a loaded model (the API asks only when the worker holds no job of it and no live
    session on it); answered by model_unloaded."""

    type = "unload_model"
    model_id: str


ApiMessage = (Welcome | JobOrder | Cancel | Preempt | SessionStart | SessionEnd | FrameOrder | JobAck | LoadModel
              | UnloadModel)


def _id(message: dict[str, Any], name: str) -> str:
    """An id the worker echoes as received: any non-empty string."""
    return string_field(message, name, max_length=200)


def _rung_or_none(message: dict[str, Any]) -> str | None:
    rung = message.get("rung")
    if rung is not None and rung not in RUNGS:
        raise MessageError(f"rung must be one of {', '.join(RUNGS)}, or left out")
    return rung  # type: ignore[no-any-return]


def _attempt(message: dict[str, Any]) -> int:
    value = message.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def _job_order(message: dict[str, Any]) -> JobOrder:
    """A `job`; v2 fields that are off the contract are read as absent (a bad `resume` only means
    the job starts from step 0, a bad `priority` that it is 0), never a reason to drop the job."""
    priority = message.get("priority")
    account = message.get("account")
    return JobOrder(_id(message, "job_id"), _attempt(message), _id(message, "model_id"), message.get("params", {}),
                    priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
                    account if isinstance(account, str) and 0 < len(account) <= 200 else None,
                    _resume(message.get("resume")))


def _resume(value: Any) -> Resume | None:
    if not isinstance(value, dict):
        return None
    step, checkpoint = value.get("step"), value.get("checkpoint")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if not isinstance(checkpoint, str) or not checkpoint or len(checkpoint) > MAX_CHECKPOINT_CHARS:
        return None
    return Resume(step, checkpoint)


def _welcome(message: dict[str, Any]) -> Welcome:
    period = message.get("heartbeat_seconds")
    usable = not isinstance(period, bool) and isinstance(period, (int, float)) and period > 0
    unknown = message.get("unknown_models") or []
    budget = message.get("frame_budget_ms")
    try:
        protocol = _protocol(message)
    except MessageError:
        protocol = PROTOCOL_V1  # an API that says something odd gets v1
    every = message.get("checkpoint_seconds")
    every = float(every) if not isinstance(every, bool) and isinstance(every, (int, float)) and every > 0 else 0.0
    previews = message.get("preview_steps")
    previews = previews if isinstance(previews, int) and not isinstance(previews, bool) and previews > 0 else 0
    v2 = protocol >= PROTOCOL_V2
    return Welcome([str(m) for m in unknown] if isinstance(unknown, list) else [],
                   float(period) if usable else None,  # type: ignore[arg-type]
                   float(budget) if isinstance(budget, (int, float)) and not isinstance(budget, bool) else None,
                   protocol, every if v2 else 0.0, previews if v2 else 0)


def _frame_order(message: dict[str, Any]) -> FrameOrder:
    seq = message.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise MessageError(f"seq must be an integer, got {seq!r}"[:200])
    image = message.get("image")
    if not isinstance(image, str) or not image:
        raise MessageError("image must be a non-empty base64 string")
    params = message.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise MessageError(f"params must be a JSON object, got {type(params).__name__}")
    return FrameOrder(_id(message, "session_id"), seq, image, params)


_API_PARSERS: dict[str, Callable[[dict[str, Any]], ApiMessage]] = {
    "welcome": _welcome,
    "job": _job_order,
    "cancel": lambda m: Cancel(_id(m, "job_id")),
    "preempt": lambda m: Preempt(_id(m, "job_id")),
    "session_start": lambda m: SessionStart(_id(m, "session_id"), _id(m, "model_id"), m.get("params")),
    "session_end": lambda m: SessionEnd(_id(m, "session_id")),
    "frame": _frame_order,
    "job_ack": lambda m: JobAck(_id(m, "job_id")),
    "load_model": lambda m: LoadModel(_id(m, "model_id"), _rung_or_none(m)),
    "unload_model": lambda m: UnloadModel(_id(m, "model_id")),
}


def parse_api_message(message: Any) -> ApiMessage:
    """What the API sent a worker; MessageError when it is off the contract, UnknownMessage for a
    type the worker does not handle."""
    if not isinstance(message, dict):
        raise MessageError("a message must be a JSON object")
    parser = _API_PARSERS.get(str(message.get("type")))
    if parser is None:
        raise UnknownMessage(f"unknown message type {str(message.get('type'))[:100]!r}")
    return parser(message)
