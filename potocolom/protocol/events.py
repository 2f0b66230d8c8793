"""Messages between API processes and to their consumers (relay, bus or channel layer), typed: one
builder (`to_event()`) and one parser (`parse()`) each, so a sender and its handler cannot drift.
Their `type` names the consumer's handler (channels' rule). docs/design/bus.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

from potocolom.protocol.errors import MessageError

MAX_WAITING_NAMED = 1000  # waiting jobs read from one jobs.available


def _text(event: dict[str, Any], name: str) -> str:
    value = event.get(name)
    if not isinstance(value, str):
        raise MessageError(f"{event.get('type')}: {name} must be a string")
    return value


def _integer(event: dict[str, Any], name: str) -> int:
    value = event.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageError(f"{event.get('type')}: {name} must be an integer")
    return value


class Event:
    """A message between API processes: `type` beside the fields of its dataclass."""

    type: ClassVar[str]

    def to_event(self) -> dict[str, Any]:
        return {"type": self.type, **self.__dict__}


# --- to a worker's consumer -----------------------------------------------------------------------

class WaitingJob(NamedTuple):
    """A queued job's queue key as another process names it (scheduling.policy.QueuedJob's first five)."""

    job_id: str
    model_id: str
    priority: int
    submitted_us: int
    account: str


@dataclass(frozen=True)
class JobsAvailable(Event):
    """Jobs wait that the process that queued them could not place: every process with a worker
    looks at the shared queue again, and makes room for these by the priority preemption."""

    type = "jobs.available"
    waiting: tuple[WaitingJob, ...]

    def to_event(self) -> dict[str, Any]:
        return {"type": self.type, "waiting": [list(job) for job in self.waiting]}

    @classmethod
    def parse(cls, event: dict[str, Any]) -> JobsAvailable:
        """The waiting jobs named; an entry this process cannot read is left out (an older sender)."""
        waiting = []
        for entry in list(event.get("waiting") or ())[:MAX_WAITING_NAMED]:
            try:
                job_id, model_id, priority, submitted_us, account = entry
                waiting.append(WaitingJob(str(job_id), str(model_id), int(priority), int(submitted_us), str(account)))
            except (TypeError, ValueError):
                continue
        return cls(tuple(waiting))


@dataclass(frozen=True)
class _JobOfWorker(Event):
    """An event for the consumer of the worker holding a job."""

    worker_id: str
    job_id: str

    @classmethod
    def parse(cls, event: dict[str, Any]) -> Self:
        return cls(_text(event, "worker_id"), _text(event, "job_id"))


@dataclass(frozen=True)
class WorkerCancel(_JobOfWorker):
    """Another process cancelled (or requeued) a job this worker holds: tell it, free its place."""

    type = "worker.cancel"


@dataclass(frozen=True)
class WorkerPreempt(_JobOfWorker):
    """Another process paused a job this worker holds: preempt it here (cancel it on v1)."""

    type = "worker.preempt"


@dataclass(frozen=True)
class WorkerPlace(Event):
    """Placement's action for a worker: `load` (on `rung`, None: the worker's choice) or `unload`;
    `record` is the placement log's row."""

    type = "worker.place"
    worker_id: str
    action: str
    model_id: str
    rung: str | None
    record: int

    @classmethod
    def parse(cls, event: dict[str, Any]) -> WorkerPlace:
        action = _text(event, "action")
        if action not in ("load", "unload"):
            raise MessageError(f"worker.place: action must be load or unload, got {action!r}")
        rung = event.get("rung")
        return cls(_text(event, "worker_id"), action, _text(event, "model_id"),
                   rung if isinstance(rung, str) else None, _integer(event, "record"))


@dataclass(frozen=True)
class WorkerReplaced(Event):
    """A newer connection of the worker took over: the old one leaves without sending jobs back."""

    type = "worker.replaced"

    @classmethod
    def parse(cls, event: dict[str, Any]) -> WorkerReplaced:
        return cls()


# --- to a browser's session consumer --------------------------------------------------------------

@dataclass(frozen=True)
class SessionFrame(Event):
    """A worker's frame result, relayed to the session's browser (no database on this path)."""

    type = "session.frame"
    seq: int
    image: str
    gpu_ms: float | None

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionFrame:
        gpu_ms = event.get("gpu_ms")
        return cls(_integer(event, "seq"), _text(event, "image"),
                   float(gpu_ms) if isinstance(gpu_ms, (int, float)) and not isinstance(gpu_ms, bool) else None)


@dataclass(frozen=True)
class SessionFrameDue(Event):
    """The consumer's own timer: the frame in flight went unanswered too long."""

    type = "session.frame_due"

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionFrameDue:
        return cls()


@dataclass(frozen=True)
class SessionLive(Event):
    """The session went live on a worker: `message` is the browser's `live`; `worker_channel` gets
    its frames. With several API processes, `worker_id` and `placement` (the session's placement
    count) let the browser's process tell a stale news from a fresh one."""

    type = "session.live"
    worker_channel: str
    message: dict[str, Any]
    worker_id: str | None = None
    placement: int | None = None

    def to_event(self) -> dict[str, Any]:
        event: dict[str, Any] = {"type": self.type, "worker_channel": self.worker_channel, "message": self.message}
        if self.placement is not None:
            event.update(worker_id=self.worker_id, placement=self.placement)
        return event

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionLive:
        message = event.get("message")
        if not isinstance(message, dict):
            raise MessageError("session.live: message must be an object")
        if "placement" not in event:
            return cls(_text(event, "worker_channel"), message)
        return cls(_text(event, "worker_channel"), message, _text(event, "worker_id"), _integer(event, "placement"))


@dataclass(frozen=True)
class SessionBack(Event):
    """Several API processes: the session's slot was lost (its worker died or was demoted)."""

    type = "session.back"
    placement: int

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionBack:
        return cls(_integer(event, "placement"))


@dataclass(frozen=True)
class SessionEnd(Event):
    """An operator ended the session: its consumer closes the browser's socket."""

    type = "session.end"

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionEnd:
        return cls()


@dataclass(frozen=True)
class SessionLost(Event):
    """The session's row was closed while its socket was open (taken for gone): its consumer closes
    the browser's socket with 4010, and the page joins again."""

    type = "session.lost"

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionLost:
        return cls()


# --- to every process (relay.notify_all_sync) -----------------------------------------------------

QueueKeyWire = tuple[int, str]  # (joined_at in microseconds, session_id)


@dataclass(frozen=True)
class SessionsMoved(Event):
    """One admission's moves of the shared session queue, numbered by `seq`: the keys of the
    sessions that left it, and each that joined with its position."""

    type = "sessions.moved"
    seq: int
    left: tuple[QueueKeyWire, ...]
    joined: tuple[tuple[QueueKeyWire, int], ...]

    def to_event(self) -> dict[str, Any]:
        return {"type": self.type, "seq": self.seq, "left": [list(key) for key in self.left],
                "joined": [[list(key), position] for key, position in self.joined]}

    @classmethod
    def parse(cls, event: dict[str, Any]) -> SessionsMoved:
        try:
            left = tuple((int(us), str(session_id)) for us, session_id in event.get("left") or ())
            joined = tuple(((int(key[0]), str(key[1])), int(position)) for key, position in event.get("joined") or ())
        except (TypeError, ValueError, IndexError):
            raise MessageError("sessions.moved: left and joined must be lists of queue keys") from None
        return cls(_integer(event, "seq"), left, joined)


# --- to an account's job sockets ------------------------------------------------------------------

@dataclass(frozen=True)
class JobChanged(Event):
    """A job of `account` changed state: `job` is its snapshot (scheduling.events.snapshot_of)."""

    type = "jobs.job"
    account: str
    job: dict[str, Any]

    @classmethod
    def parse(cls, event: dict[str, Any]) -> JobChanged:
        job = event.get("job")
        if not isinstance(job, dict):
            raise MessageError("jobs.job: job must be an object")
        return cls(_text(event, "account"), job)


@dataclass(frozen=True)
class JobProgressed(Event):
    """A worker's job_progress for a job of `account`, its preview (base64 JPEG) as sent."""

    type = "jobs.progress"
    account: str
    job_id: str
    step: int
    steps: int
    preview: str | None = None

    def to_event(self) -> dict[str, Any]:
        event: dict[str, Any] = {"type": self.type, "account": self.account, "job_id": self.job_id,
                                 "step": self.step, "steps": self.steps}
        if self.preview is not None:
            event["preview"] = self.preview
        return event

    @classmethod
    def parse(cls, event: dict[str, Any]) -> JobProgressed:
        preview = event.get("preview")
        return cls(_text(event, "account"), _text(event, "job_id"), _integer(event, "step"),
                   _integer(event, "steps"), preview if isinstance(preview, str) else None)
