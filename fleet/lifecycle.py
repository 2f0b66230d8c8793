"""A worker's life as the API sees it: hello, demotion, death, and the per-process dead-worker sweep.
The one place that fans out to both scheduling (held jobs, dispatch) and realtime (slots,
admission); the worker consumer only translates. Also what operators see of both (`queues_snapshot`)."""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet.placement.runner import placement_wake
from models_registry.selectors import registered_ids
from potocolom import metrics
from potocolom.protocol.worker import PROTOCOL_V2, Hello, ModelEntry
from potocolom.runtime import Slot, runtime
from realtime import selectors as session_reads
from realtime import services as sessions
from scheduling import selectors as job_reads
from scheduling import services as jobs
from scheduling.policy import QueuedJob
from workers import selectors, services
from workers.models import WorkerToken
from workers.services import HelloRecord


def worker_arrives(*, hello: Hello, token: WorkerToken, channel_name: str, now: datetime) -> HelloRecord:
    """Record a hello (before the welcome goes out)."""
    return services.worker_hello(worker_id=hello.worker_id, token=token, gpu=hello.gpu, models=hello.models,
                                 channel_name=channel_name, now=now, installed=hello.installed,
                                 protocol=hello.protocol)


def worker_connected(*, hello: Hello, channel_name: str, arrival: HelloRecord, now: datetime) -> str | None:
    """After the welcome: the worker keeps the jobs it held (a v2 worker: those its hello lists) and
    gets work, and its realtime slots join admission. The channel of an older connection it
    replaced (to be closed), if any."""
    worker_id = hello.worker_id
    replaced = jobs.worker_jobs_connect(worker_id=worker_id, channel_name=channel_name,
                                        models=[m.model_id for m in arrival.served], now=now,
                                        protocol=hello.protocol,
                                        listed=hello.jobs if hello.protocol >= PROTOCOL_V2 else None,
                                        rungs={m.model_id: m.rung for m in arrival.served})
    sessions.worker_slots_set(worker_id=worker_id, channel_name=channel_name, models=arrival.served,
                              previous_channel=arrival.previous_channel, now=now)
    placement_soon()  # what it has installed may be what waiting work wants
    return replaced


def dead_workers_sweep(*, now: datetime) -> None:
    """Every heartbeat period of each API process (fleet.sweeper), whatever is connected to it:
    workers that held jobs before this process started and did not come back lose them, and so
    (with a shared queue) do workers no process has heard for the dead-worker window; their rows
    stop reading as connected."""
    jobs.orphans_sweep(now=now)
    services.workers_silent_forget(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS, now=now)


def worker_lost(*, worker_id: str, channel_name: str, now: datetime) -> None:
    """The connection is over (closed, or silent for 3 periods): its jobs follow the retry rule and
    its sessions go back to the queue, unless a newer connection of the worker took over."""
    current = jobs.worker_jobs_disconnect(worker_id=worker_id, channel_name=channel_name, now=now)
    if current:
        services.worker_gone(worker_id=worker_id, now=now)
    still_current = services.worker_channel_clear(worker_id=worker_id, channel_name=channel_name)
    sessions.worker_sessions_return(worker_id=worker_id, channel_name=channel_name, still_current=still_current,
                                    now=now)
    if still_current:
        services.placement_records_lost(worker_id=worker_id, now=now)
        placement_soon()  # its models may be wanted elsewhere now


def worker_draining(*, worker_id: str, channel_name: str, now: datetime) -> None:
    """The worker said `draining` (it is shutting down): dispatch skips it, its row says so (the
    shared admission gives it no slot), and each of its models has no realtime slot here any more,
    so its live sessions go back to the queue at their old places and are placed again elsewhere.
    Its held jobs come back as job_preempted (queued again at their old places)."""
    jobs.worker_jobs_drain(worker_id=worker_id, channel_name=channel_name)
    for entry in services.worker_draining_set(worker_id=worker_id, channel_name=channel_name):
        closed = ModelEntry(entry.model_id, entry.rung)  # no realtime: no slot, sessions sent back
        sessions.worker_rung_changed(worker_id=worker_id, entry=closed, channel_name=channel_name, now=now)
    placement_soon()  # its models may be wanted elsewhere now


def worker_rung_changed(*, worker_id: str, entry: ModelEntry, channel_name: str, now: datetime) -> None:
    """After an out-of-memory demotion: the row shows the new rung, and sessions that lost their
    slot go back to the queue."""
    services.worker_rung_set(worker_id=worker_id, entry=entry)
    jobs.worker_model_rung(worker_id=worker_id, channel_name=channel_name, model_id=entry.model_id, rung=entry.rung)
    sessions.worker_rung_changed(worker_id=worker_id, entry=entry, channel_name=channel_name, now=now)


# --- placement (fleet.placement.driver decides; these apply the workers' answers) -------------------------

def placement_soon() -> None:
    """Plan placement again soon, on this process's placement thread (fleet.placement.runner),
    once the current transaction commits (the planner reads what it wrote)."""
    transaction.on_commit(placement_wake)


def worker_model_loaded(*, worker_id: str, entry: ModelEntry, gpu: Any, channel_name: str, now: datetime) -> None:
    """model_loaded: the worker serves the model from now on: its jobs are dispatched there and its
    realtime slots join admission."""
    registered, seconds = services.worker_model_loaded(worker_id=worker_id, entry=entry, gpu=gpu, now=now)
    metrics.model_load_finished(model_id=entry.model_id, registered=registered, outcome="loaded", seconds=seconds)
    if registered:
        jobs.worker_model_serve(worker_id=worker_id, channel_name=channel_name, model_id=entry.model_id, now=now,
                                rung=entry.rung)
        sessions.worker_rung_changed(worker_id=worker_id, entry=entry, channel_name=channel_name, now=now)
    placement_soon()


def worker_model_load_failed(*, worker_id: str, model_id: str, error: str, gpu: Any, now: datetime) -> None:
    """model_load_failed: nothing was sent there for it; placement tries another worker."""
    seconds = services.worker_model_load_failed(worker_id=worker_id, model_id=model_id, error=error, gpu=gpu, now=now)
    metrics.model_load_finished(model_id=model_id, registered=bool(registered_ids([model_id])), outcome="failed",
                                seconds=seconds)
    placement_soon()


def worker_model_unload_begins(*, worker_id: str, model_id: str, channel_name: str, now: datetime) -> bool:
    """Before unload_model goes out: the model takes no new job or session there. False (the unload
    is not sent, and the model keeps serving) when the worker holds a job of it or a session on it."""
    if not jobs.worker_model_withdraw(worker_id=worker_id, channel_name=channel_name, model_id=model_id):
        services.worker_unload_kept(worker_id=worker_id, model_id=model_id, why="it held a job by then", now=now)
        return False
    if (worker_id, model_id) in session_reads.holding_sessions([worker_id]):
        jobs.worker_model_serve(worker_id=worker_id, channel_name=channel_name, model_id=model_id, now=now)
        services.worker_unload_kept(worker_id=worker_id, model_id=model_id, why="it held a session by then", now=now)
        return False
    entry = services.worker_model_withdrawn(worker_id=worker_id, model_id=model_id)
    if entry is not None:
        closed = ModelEntry(entry.model_id, entry.rung)  # no slot: admission places nothing there
        sessions.worker_rung_changed(worker_id=worker_id, entry=closed, channel_name=channel_name, now=now)
    return True


def worker_model_unloaded(*, worker_id: str, model_id: str, gpu: Any, now: datetime) -> None:
    """model_unloaded: its memory is free for what placement planned with it."""
    services.worker_model_unloaded(worker_id=worker_id, model_id=model_id, gpu=gpu, now=now)
    placement_soon()


class DispatchSoon:
    """Runs the dispatch once for this process however many of its worker sockets are woken at once:
    a wake-up during a run makes one more run after it, not one per socket. The waiting jobs a
    wake-up names (another process could not place them) are gathered for that run, which makes
    room for them by the priority preemption; at most `MAX_WAITING` are kept (the rest wait for
    the next wake-up: only a burst of submissions names that many)."""

    MAX_WAITING = 1000

    def __init__(self) -> None:
        self.running = False
        self.again = False
        self.waiting: dict[str, QueuedJob] = {}

    async def __call__(self, *, waiting: Iterable[QueuedJob] = ()) -> None:
        for job in waiting:
            if len(self.waiting) < self.MAX_WAITING:
                self.waiting[job.job_id] = job
        if self.running:
            self.again = True
            return
        self.running = True
        try:
            while True:
                self.again = False
                named, self.waiting = list(self.waiting.values()), {}
                await database_sync_to_async(jobs.jobs_dispatch_for)(waiting=named, now=timezone.now())
                if not self.again:
                    return
        finally:
            self.running = False


DISPATCH_SOON = Slot("fleet.dispatch_soon", make=DispatchSoon)


async def dispatch_soon(*, waiting: Iterable[QueuedJob] = ()) -> None:
    """Run this process's dispatch soon (see DispatchSoon)."""
    await runtime.get(DISPATCH_SOON)(waiting=waiting)


def queues_snapshot() -> dict[str, Any]:
    """What operators see: queued jobs per model, queued sessions in order, and the connected
    workers with the jobs they hold, their free realtime slots per model and their live sessions."""
    queued, held = job_reads.queue_snapshot()
    sessions_now = session_reads.sessions_snapshot()
    realtime = sessions_now["workers"]
    now = timezone.now()
    connected = {w.worker_id for w in selectors.connected_workers(seconds=4 * settings.WORKER_HEARTBEAT_SECONDS,
                                                                  now=now)}
    workers = [{"worker_id": w.worker_id, "gpu": w.gpu, "models": w.served_models, "installed": w.installed,
                "draining": w.draining, "jobs": held.get(w.worker_id, []),
                "slots": realtime.get(w.worker_id, {}).get("slots", []),
                "sessions": realtime.get(w.worker_id, {}).get("sessions", [])}
               for w in selectors.workers_by_id(list(held.keys() | realtime.keys() | connected))]
    return {"jobs": queued, "sessions": sessions_now["sessions"], "workers": workers,
            "placement": selectors.placement_log(now=now)}
