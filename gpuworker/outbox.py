"""What the worker has to say, waiting to leave in order, and its final messages (job_result,
job_failed, job_preempted) kept until the API acknowledges them (v2) or, for a v1 API, until sent:
plain data, bounded, event loop only; docs/protocol.md, "Protocol versions" under "Worker socket", and `job_ack`."""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from gpuworker.jobs import WorkerJob

log = logging.getLogger(__name__)

FINAL_TYPES = frozenset({"job_result", "job_failed", "job_preempted"})
# Kept across a reconnect; progress, heartbeats and anything about sessions (the API sends those
# back to its queue when the connection drops) are stale on the next one, so dropped.
KEPT_WHILE_DOWN = frozenset({"job_started", *FINAL_TYPES})
MAX_UNACKED_FINALS = 64  # final messages kept for the API's job_ack; beyond it the oldest is dropped
MAX_UNACKED_BYTES = 256 * 2**20  # and at most this many bytes of them (a result is at most 16 MiB)


@dataclass(eq=False)
class Outgoing:
    """A message waiting in the outbox, already serialized (off the event loop, for big images).

    A final message (job_id set) is in the queue while `sent_at` is None; once sent to a v2 API it
    waits, out of the queue, for its job_ack, and `sent_at` says when it went.
    """

    kind: str
    text: str
    job: WorkerJob | None
    job_id: str | None = None
    sent_at: float | None = None

    @property
    def final(self) -> bool:
        return self.kind in FINAL_TYPES


class Outbox:
    """The messages to send, in order, and the final messages not yet acknowledged, by job id."""

    def __init__(self, *, max_finals: int = MAX_UNACKED_FINALS, max_final_bytes: int = MAX_UNACKED_BYTES):
        if max_finals < 1 or max_final_bytes < 1:
            raise ValueError("an outbox keeps at least one final message")
        self.max_finals, self.max_final_bytes = max_finals, max_final_bytes
        self._queue: collections.deque[Outgoing] = collections.deque()
        self._finals: collections.OrderedDict[str, Outgoing] = collections.OrderedDict()
        self._final_bytes = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def final_ids(self) -> list[str]:
        """The jobs whose final message is not yet acknowledged (a v2 hello lists them), oldest first."""
        return list(self._finals)

    def holds_final(self, job_id: str) -> bool:
        return job_id in self._finals

    def append(self, out: Outgoing) -> None:
        """Queue a message; a final one is also kept (the oldest dropped past the caps, logged)."""
        if out.final:
            assert out.job_id is not None
            self.forget(out.job_id)
            self._finals[out.job_id] = out
            self._final_bytes += len(out.text)
            while len(self._finals) > 1 and (len(self._finals) > self.max_finals
                                             or self._final_bytes > self.max_final_bytes):
                job_id, dropped = next(iter(self._finals.items()))
                self.forget(job_id)
                log.warning("dropping the unacknowledged %s of job %s: over %d final messages or %d bytes are "
                            "kept; the API sends that job back to its queue when this worker's hello leaves it out",
                            dropped.kind, job_id, self.max_finals, self.max_final_bytes)
        self._queue.append(out)

    def peek(self) -> Outgoing | None:
        return self._queue[0] if self._queue else None

    def popleft(self) -> None:
        self._queue.popleft()

    def wanted(self, out: Outgoing) -> bool:
        """False for a final message that was acknowledged, dropped or forgotten meanwhile, and for
        any other message about a job cancelled since it was queued."""
        if out.final:
            return out.job_id is not None and self._finals.get(out.job_id) is out
        return out.job is None or not out.job.cancelled

    def sent(self, out: Outgoing, *, now: float, await_ack: bool) -> None:
        """A message went out: a final one waits for its job_ack (v2), or is done with (v1)."""
        if not out.final or out.job_id is None:
            return
        if await_ack:
            out.sent_at = now
        else:
            self.forget(out.job_id)

    def ack(self, job_id: str) -> Outgoing | None:
        """The API stored the job's final message: forget it; the message, or None if unknown."""
        out = self._finals.get(job_id)
        self.forget(job_id)
        return out

    def forget(self, job_id: str) -> None:
        out = self._finals.pop(job_id, None)
        if out is not None:
            self._final_bytes -= len(out.text)

    def reconnected(self) -> None:
        """A new connection: the messages that keep (KEPT_WHILE_DOWN) stay queued, and every final
        message not acknowledged goes again, in the order the jobs ended."""
        kept = [out for out in self._queue if out.kind in KEPT_WHILE_DOWN and not out.final]
        for out in self._finals.values():
            out.sent_at = None
        self._queue = collections.deque([*kept, *self._finals.values()])

    def resend_sent_before(self, cutoff: float) -> int:
        """Queue again each final message sent at or before `cutoff` and still not acknowledged
        (v2, at every heartbeat); return how many."""
        due = [out for out in self._finals.values() if out.sent_at is not None and out.sent_at <= cutoff]
        for out in due:
            out.sent_at = None
            self._queue.append(out)
        return len(due)
