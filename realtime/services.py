"""Writes of the session path: joining, frames, idleness, the worker's answers and the sweep. Each
goes through this process's admission (one interface, local or shared); pushes leave after the
commit. Synchronous (consumers call them through database_sync_to_async); the clock is `now=`."""
from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from models_registry.selectors import registered_manifests
from potocolom.protocol.browser import Idle
from potocolom.protocol.events import SessionLive, SessionLost
from potocolom.protocol.worker import ModelEntry
from potocolom.signals import work_ended, work_waiting
from potocolom.transport.notify import notify_after_commit, to_socket_after_commit
from realtime import policy
from realtime.admission import admission, board
from realtime.board import LIVE
from realtime.model_choice import pick_session_model
from realtime.models import RealtimeSession, SessionState
from realtime.records import sessions_vouch, usage_close

log = logging.getLogger(__name__)


def session_request(*, query: dict[str, str]) -> tuple[str, dict[str, int]]:
    """The model and params a socket's query asks for (BadQuery, NoModelFits otherwise)."""
    manifest, params = pick_session_model(registered_manifests(), query)
    return manifest.model_id, params


def session_join(*, account: User, model_id: str, params: dict[str, int], channel_name: str,
                 now: datetime) -> RealtimeSession:
    """Open a session in the queue, unless the account already holds ACCOUNT_SESSION_LIMIT open
    sessions (queued ones count): SessionLimitReached. The check and the insert are one step."""
    session = admission().join(account=account, model_id=model_id, params=params, channel_name=channel_name, now=now)
    work_waiting.send(sender=RealtimeSession, model_id=model_id)  # placement may load it where it has no slot
    return session


def session_close(*, session_id: str, now: datetime) -> None:
    """The browser socket closed: the session leaves the queue or frees its slot (its worker gets
    session_end), metering stops, and the slot goes to the next session."""
    admission().close(session_id=session_id, now=now)
    work_ended.send(sender=RealtimeSession, worker_id=None)  # placement: its model may be idle now


def session_forget(*, session_id: str) -> None:
    """The browser socket closed but session_close failed (the database): this process stops
    vouching for the session, so the sweep closes its row and stops its metering (no database here)."""
    admission().forget(session_id=session_id)


def session_end(*, session_id: str, now: datetime) -> bool:
    """Operators: end a session; its browser socket is closed (which frees everything), or the row
    is closed at once when no socket holds it."""
    return admission().end(session_id=session_id, now=now)


def session_accept(*, worker_id: str, session_id: str, channel_name: str, now: datetime) -> bool:
    """The worker took the session: live, metering starts, the browser is told, and the newest
    frame kept while it waited goes to the worker. A stale accept gets session_end."""
    return admission().accept(worker_id=worker_id, session_id=session_id, channel_name=channel_name, now=now)


def session_refuse(*, worker_id: str, session_id: str, reason: str, now: datetime) -> bool:
    """That placement failed only: another worker with room is tried, or the session waits in the
    queue at its old place."""
    log.info("worker %s refused session %s: %s", worker_id, session_id, reason)
    current = admission()
    returned = current.refuse(worker_id=worker_id, session_id=session_id, now=now)
    if returned:
        current.board.unroute_worker(session_id, worker_id=worker_id)
    return returned


# --- routes (the worker's process) ---------------------------------------------------------------

def session_route(*, session_id: str, worker_id: str, worker_channel: str, browser: str) -> None:
    """A session_start is going to a worker of this process: its frame results go to `browser`."""
    board().route_to_worker(session_id, worker_id=worker_id, worker=worker_channel, browser=browser)


def session_unroute(*, session_id: str, worker_id: str) -> None:
    """A session_end is going to its worker: no frame result of it goes anywhere any more."""
    board().unroute_worker(session_id, worker_id=worker_id)


def frame_result_route(*, worker_id: str, session_id: str) -> str | None:
    """The browser channel a worker's frame_result goes to (only from the worker holding it)."""
    return board().browser_for(session_id, worker_id=worker_id)


# --- frames and idleness -------------------------------------------------------------------------

def session_frame(*, session_id: str, now: datetime) -> tuple[str, str | None]:
    """Canvas input (no database on this path). ('live', worker channel) when a frame can go to
    the worker now; otherwise the session's state (its consumer keeps the newest frame)."""
    return board().frame(session_id, now=now)


def session_frame_worker(*, session_id: str) -> str | None:
    """Where the session's next frame goes now: its worker's channel while live (no database)."""
    return board().live_worker(session_id)


def session_wake(*, session_id: str, now: datetime) -> None:
    """A frame on an idle session: it is placed again, or queued at its old place."""
    current = admission()
    if current.board.wake(session_id):
        RealtimeSession.objects.filter(id=session_id, state=SessionState.IDLE).update(state=SessionState.QUEUED)
        current.admit(now=now, joined=[session_id])


def session_idle_check(*, session_id: str, now: datetime) -> float | None:
    """Release the session's slot when it is idle (the pure rule); otherwise the seconds until it
    could be. None once it is not live."""
    entry = admission().board.get(session_id)
    if entry is None or entry.state != LIVE or (start := entry.idle_from()) is None:
        return None
    idle_seconds = settings.SESSION_IDLE_SECONDS
    if not policy.is_idle(start, now, idle_seconds):
        return (policy.idle_at(start, idle_seconds) - now).total_seconds()
    session_release_idle(session_id=session_id, now=now)
    return None


def session_release_idle(*, session_id: str, now: datetime) -> bool:
    """No canvas input for SESSION_IDLE_SECONDS: state idle, metering stops, the slot is freed."""
    current = admission()
    with transaction.atomic():
        released = RealtimeSession.objects.filter(id=session_id, state=SessionState.LIVE).update(
            state=SessionState.IDLE, worker_id=None, live_since=None) == 1
        if released:
            usage_close(session_id=session_id, now=now)
    route = current.board.route(session_id)
    if not released or current.board.go_idle(session_id) is None:
        return False
    current.end_on_worker(route.worker_id, session_id, route.worker)
    if route.browser:
        to_socket_after_commit(route.browser, Idle().to_wire())
    current.admit(now=now)
    work_ended.send(sender=RealtimeSession, worker_id=route.worker_id)  # placement: its model may be idle now
    return True


def sessions_sweep(*, now: datetime) -> None:
    """The periodic sweep (SESSION_SWEEP_SECONDS): this process vouches for the sockets it holds,
    the idle rule runs for its live sessions (it alone sees their input), then the admission's own
    sweep (which closes rows nobody vouched for within the bound)."""
    current = admission()
    sessions_vouch_here(now=now)
    for session_id in current.board.idle_candidates(now=now, idle_seconds=settings.SESSION_IDLE_SECONDS):
        session_release_idle(session_id=session_id, now=now)
    current.sweep(now=now)


def sessions_vouch_here(*, now: datetime) -> None:
    """The rows of the sessions whose browser sockets this process holds are seen now. A socket
    whose row was closed without its say-so (taken for gone) is closed with 4010: its browser joins again."""
    current = admission()
    for session_id in sessions_vouch(session_ids=current.board.own_sessions(), now=now):
        browser = current.board.own_browser(session_id)
        if browser is not None:
            log.warning("session %s was closed while its socket is open here: ending the socket", session_id)
            notify_after_commit(browser, SessionLost().to_event())


def session_live_here(*, session_id: str, live: SessionLive, now: datetime) -> bool:
    """Several API processes, in the browser's process: news of going live; whether it applies
    (then the consumer sends the newest frame it kept meanwhile)."""
    return board().live_here(session_id, worker_id=live.worker_id or "", worker_channel=live.worker_channel,
                             placement=live.placement or 0, now=now) is not None


def session_back_here(*, session_id: str, placement: int) -> bool:
    """Several API processes, in the browser's process: its slot was lost; frames wait again."""
    return board().back_here(session_id, placement=placement)


def sessions_let_go() -> None:
    """The last browser socket of this process closed: it holds no lock of the shared admission."""
    admission().release()


# --- workers (called by fleet.lifecycle) -------------------------------------------------------

def worker_slots_set(*, worker_id: str, channel_name: str, models: list[ModelEntry], previous_channel: str,
                     now: datetime) -> None:
    """A worker's hello: the realtime slots of each model it serves; admission runs."""
    admission().worker_joined(worker_id=worker_id, channel_name=channel_name, models=models,
                              previous_channel=previous_channel, now=now)


def worker_sessions_return(*, worker_id: str, channel_name: str, still_current: bool, now: datetime) -> None:
    """A dead worker: no session is routed to that socket any more, and its sessions go back to the
    queue at their old places."""
    current = admission()
    current.worker_lost(worker_id=worker_id, channel_name=channel_name, still_current=still_current, now=now)
    current.board.unroute_connection(worker_id=worker_id, channel_name=channel_name)


def worker_rung_changed(*, worker_id: str, entry: ModelEntry, channel_name: str, now: datetime) -> None:
    """After a demotion: a model without realtime sends its sessions on that worker back to the
    queue, and the worker gets session_end for each."""
    admission().worker_rung_changed(worker_id=worker_id, entry=entry, channel_name=channel_name, now=now)

