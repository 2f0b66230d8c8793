"""Messages between API processes (potocolom/protocol/events.py): what one process builds, another
parses back to the same value, whatever channel layer or bus carried it (JSON or msgpack); an event
off the contract is refused with MessageError, except the waiting jobs of jobs.available, where an
entry an older process wrote differently is left out rather than failing the others."""
from __future__ import annotations

import json

import pytest

from potocolom.protocol.errors import MessageError
from potocolom.protocol.events import (
    JobChanged,
    JobProgressed,
    JobsAvailable,
    SessionBack,
    SessionEnd,
    SessionFrame,
    SessionFrameDue,
    SessionLive,
    SessionLost,
    SessionsMoved,
    WaitingJob,
    WorkerCancel,
    WorkerPlace,
    WorkerPreempt,
    WorkerReplaced,
)

ALICE = "7"
EVENTS = [
    JobsAvailable((WaitingJob("job-1", "tiny-a", 5, 1_000, ALICE), WaitingJob("job-2", "tiny-b", 0, 2_000, "8"))),
    WorkerCancel("host-a:0", "job-1"),
    WorkerPreempt("host-a:0", "job-1"),
    WorkerPlace("host-a:0", "load", "tiny-a", "full", 12),
    WorkerPlace("host-a:0", "unload", "tiny-a", None, 13),
    WorkerReplaced(),
    SessionFrame(3, "aGVsbG8=", 41.5),
    SessionFrame(4, "aGVsbG8=", None),
    SessionFrameDue(),
    SessionLive("worker-channel", {"type": "live", "model_id": "tiny-a", "worker_id": "host-a:0"}),
    SessionLive("worker-channel", {"type": "live"}, "host-a:0", 2),
    SessionBack(2),
    SessionEnd(),
    SessionLost(),
    SessionsMoved(9, left=((1_000, "s1"),), joined=(((2_000, "s2"), 3),)),
    JobChanged(ALICE, {"id": "job-1", "state": "running"}),
    JobProgressed(ALICE, "job-1", 3, 20),
    JobProgressed(ALICE, "job-1", 4, 20, preview="/9j/4AAQ"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_an_event_reads_back_as_the_value_that_was_sent(event):
    carried = json.loads(json.dumps(event.to_event()))  # what any layer hands the receiving consumer

    assert carried["type"] == event.type
    assert type(event).parse(carried) == event


@pytest.mark.parametrize("cls, event", [
    (WorkerCancel, {"type": "worker.cancel", "worker_id": "host-a:0"}),
    (WorkerPreempt, {"type": "worker.preempt", "worker_id": 3, "job_id": "job-1"}),
    (WorkerPlace, {"type": "worker.place", "worker_id": "w", "action": "delete", "model_id": "m", "record": 1}),
    (SessionFrame, {"type": "session.frame", "seq": "3", "image": "x"}),
    (SessionLive, {"type": "session.live", "worker_channel": "c", "message": "live"}),
    (SessionBack, {"type": "session.back"}),
    (SessionsMoved, {"type": "sessions.moved", "seq": 1, "left": [["x"]], "joined": []}),
    (JobChanged, {"type": "jobs.job", "account": ALICE, "job": None}),
    (JobProgressed, {"type": "jobs.progress", "account": ALICE, "job_id": "job-1", "step": True, "steps": 20}),
])
def test_an_event_off_the_contract_is_refused(cls, event):
    with pytest.raises(MessageError):
        cls.parse(event)


def test_a_waiting_job_that_cannot_be_read_is_left_out_and_the_others_kept():
    event = {"type": "jobs.available", "waiting": [["job-1", "tiny-a", 0, 1_000, ALICE], ["job-2", "tiny-a"],
                                                   ["job-3", "tiny-a", "high", 3_000, ALICE]]}

    assert JobsAvailable.parse(event).waiting == (WaitingJob("job-1", "tiny-a", 0, 1_000, ALICE),)
