"""What a worker reports about the jobs it holds (started, progress, result, failure, checkpoint,
preempted), and what other API processes relay about the jobs this process's workers hold (a pause
to preempt, a job gone from its worker). The story: docs/protocol.md, "Worker → API"."""
from __future__ import annotations

import base64
import binascii
import logging
import uuid
from datetime import datetime
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce

from potocolom import metrics
from potocolom.signals import work_ended
from scheduling.checkpoints import checkpoint_discard, checkpoint_save
from scheduling.dispatcher import dispatcher
from scheduling.eta import first_etas
from scheduling.events import batching, job_progressed, jobs_changed
from scheduling.models import HELD_STATES, Job, JobState
from scheduling.services.dispatch import jobs_dispatch, jobs_dispatch_or_wake
from scheduling.services.job_rows import queued_job, send_back, to_microseconds, webhook_outbox
from scheduling.services.requests import job_pause_held

log = logging.getLogger(__name__)
MAX_IMAGE_BYTES = 12 * 1024 * 1024


@batching
def job_started(*, worker_id: str, job_id: str, now: datetime) -> bool:
    dispatcher().started(job_id, worker_id=worker_id)
    started = Job.objects.filter(id=job_id, worker_id=worker_id, state=JobState.DISPATCHED).update(
        state=JobState.RUNNING, started_at=now) == 1
    if started:
        _now_running(job_id, now=now)
    return started


def job_progress(*, worker_id: str, job_id: str, step: int, steps: int, now: datetime,
                 preview: str | None = None) -> bool:
    """A worker's job_progress: stored (step and steps, never the preview) and relayed to the job's
    account with its preview, when this worker holds the job."""
    updated = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES).update(
        progress_step=step, progress_steps=steps)
    # A worker may report progress before job_started arrives; progress means it is running.
    dispatcher().started(job_id, worker_id=worker_id)
    if Job.objects.filter(id=job_id, worker_id=worker_id, state=JobState.DISPATCHED).update(
            state=JobState.RUNNING, started_at=now):
        _now_running(job_id, now=now)
    if updated == 1:
        account = _account_of(job_id, worker_id)
        if account is not None:
            job_progressed(account_id=account, job_id=job_id, step=step, steps=steps, preview=preview)
    return updated == 1


def _now_running(job_id: str, *, now: datetime) -> None:
    """The job began its first step: its account hears of it, and its first estimated wait (if this
    process gave one) is measured against the wait it had."""
    jobs_changed([job_id], now=now)
    ratio = first_etas().started(job_id, at_us=to_microseconds(now))
    if ratio is not None:
        metrics.eta_checked(error_ratio=ratio)


def _account_of(job_id: str, worker_id: str) -> str | None:
    """The account of a job this process's worker holds: the dispatcher's key of it when it has
    one (no database read per step), else the row's."""
    key = dispatcher().key_of(job_id, worker_id=worker_id)
    if key is not None:
        return key.account
    account = Job.objects.filter(id=job_id).values_list("account_id", flat=True).first()
    return None if account is None else str(account)


def decode_image(value: str) -> tuple[bytes, str]:
    """A worker's base64 PNG or JPEG (bare, or a data: URL) as bytes and its extension."""
    if not isinstance(value, str):
        raise ValueError("an image must be a base64 string")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image is not valid base64") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError("an image is too large")
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return data, "png"
    if data.startswith(b"\xff\xd8\xff"):
        return data, "jpg"
    raise ValueError("an image must be a PNG or a JPEG")


@batching
def job_finish(*, worker_id: str, job_id: str, images: list[str], gpu_ms: float | None, rung: str,
               now: datetime) -> bool:
    """Store a job's images and mark it succeeded; frees the worker's place for the next job. (No
    check before storing: a result for a job this worker no longer holds is rare, and its files are
    deleted again when the compare-and-set below finds it so; a check costs every job a round trip.)
    The result of a run the worker was told to cancel (v2) only frees its place."""
    if _let_go(job_id, worker_id, now=now):
        return False
    try:
        decoded = [decode_image(image) for image in images]
    except ValueError as exc:
        return job_fail(worker_id=worker_id, job_id=job_id, error=f"the worker sent a bad image: {exc}", now=now)
    names: list[str] = []
    try:
        for n, (data, extension) in enumerate(decoded):
            names.append(default_storage.save(f"jobs/{job_id}/{n}.{extension}", ContentFile(data)))
        finished = _end_held(job_id, worker_id, now=now, state=JobState.SUCCEEDED, images=names, gpu_ms=gpu_ms,
                             rung=rung[:40], finished_at=now, started_at=Coalesce(F("started_at"), Value(now)))
    except Exception:
        _delete_images(names)  # nothing stored: the caller does not ack, and a v2 worker sends it again
        raise
    if not finished:
        _delete_images(names)
    else:
        jobs_changed([job_id], now=now)  # succeeded
    # A result ends the worker's hold on the job even when it changed nothing: it runs it no more.
    _release_and_dispatch(job_id, worker_id, now=now)
    return finished


def _delete_images(names: list[str]) -> None:
    for name in names:
        try:
            default_storage.delete(name)
        except Exception:  # the storage is failing: a stray file is no reason to lose the answer
            log.exception("could not delete %s", name)


@batching
def job_fail(*, worker_id: str, job_id: str, error: str, now: datetime) -> bool:
    """A failure the worker reports is final. A v2 worker's answer to `cancel` only frees its place."""
    if _let_go(job_id, worker_id, now=now):
        return False
    failed = _end_held(job_id, worker_id, now=now, state=JobState.FAILED, error=str(error)[:2000] or "failed",
                       finished_at=now)
    if failed:
        jobs_changed([job_id], now=now)
    # Also when it changed nothing: the worker runs it no more, whatever the database says.
    _release_and_dispatch(job_id, worker_id, now=now)
    return failed


def _end_held(job_id: str, worker_id: str, *, now: datetime, **fields: Any) -> bool:
    """Compare-and-set a job this worker holds to its end (`fields`); its stored checkpoint goes
    with it, and its webhook's delivery row is written in the same transaction. A job with neither
    (nearly all) costs one statement, as before checkpoints existed."""
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    if held.filter(checkpoint="", webhook_url="").update(**fields):
        return True
    name = held.values_list("checkpoint", flat=True).first()
    if name is None:
        return False
    with transaction.atomic():
        if not held.filter(checkpoint=name).update(checkpoint="", checkpoint_step=None, **fields):
            return False
        webhook_outbox(job_id, now=now)
    if name:
        checkpoint_discard(name)
    return True


def job_checkpoint(*, worker_id: str, job_id: str, step: int, steps: int, checkpoint: bytes, now: datetime) -> bool:
    """A running job's periodic checkpoint (`job_checkpoint`) replaces the stored one: what the job
    resumes from if its worker dies. False, and nothing kept, when this worker no longer holds it."""
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    previous = held.values_list("checkpoint", flat=True).first()
    stored = _store_checkpoint(job_id, step, checkpoint) if previous is not None else ""
    if not stored:
        return False
    try:
        kept = held.filter(checkpoint=previous).update(checkpoint=stored, checkpoint_step=step) == 1
    except Exception:
        checkpoint_discard(stored, keep=previous or "")
        raise
    if kept:
        checkpoint_discard(previous or "", keep=stored)
    else:
        checkpoint_discard(stored, keep=previous or "")
    return kept


@batching
def job_preempted(*, worker_id: str, job_id: str, step: int, steps: int, checkpoint: bytes | None,
                  now: datetime) -> bool:
    """A worker stopped a job at a step boundary (told to by `preempt`, or draining) and no longer
    holds it. Its checkpoint replaces the stored one, and the job goes back to `queued` at its old
    place with the same attempts (the retry rule is for dead workers), or to `paused` when a pause
    was asked. A null checkpoint (not started yet, or a scheduler that cannot be resumed) keeps the
    stored one, if any: it is still the job's exact state at its step. False when the answer
    changed nothing (the job was cancelled or requeued meanwhile, or is another worker's); the
    worker's place frees all the same."""
    if _let_go(job_id, worker_id, now=now):
        return False
    held = Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES)
    job = held.first()
    if job is None:
        _release_and_dispatch(job_id, worker_id, now=now)
        return False
    stored = _store_checkpoint(job_id, step, checkpoint) if checkpoint is not None else ""
    fields: dict[str, Any] = {"preemptions": F("preemptions") + 1}
    if stored:
        fields |= {"checkpoint": stored, "checkpoint_step": step}
    try:
        back = send_back(held, now=now, **fields)
    except Exception:
        checkpoint_discard(stored, keep=job.checkpoint)
        raise
    if back is None:  # cancelled or requeued since the read: this checkpoint is no one's
        checkpoint_discard(stored, keep=job.checkpoint)
        _release_and_dispatch(job_id, worker_id, now=now)
        return False
    checkpoint_discard(job.checkpoint if stored else "", keep=stored)
    log.info("job %s preempted on %s at step %d of %d: now %s", job_id, worker_id, step, steps, back.value)
    current = dispatcher()
    holder = current.connection(worker_id)
    metrics.job_preempted(reason="pause" if back == JobState.PAUSED
                          else "drain" if holder is not None and holder.draining
                          else "move" if current.is_moving(job_id) else "priority")
    current.release(job_id, worker_id=worker_id)
    if back == JobState.QUEUED:
        current.push(queued_job(job))
        jobs_changed([job_id], now=now)  # queued again, at its place
        jobs_dispatch_or_wake(queued=[queued_job(job)], now=now)
    else:
        jobs_changed([job_id], now=now)  # paused
        jobs_dispatch(now=now)
    return True


def _store_checkpoint(job_id: str, step: int, data: bytes) -> str:
    """Store a worker's checkpoint; its storage name, or "" for one over the contract's size (the
    job then resumes from the checkpoint it had, or step 0)."""
    try:
        return checkpoint_save(job_id, step, data)
    except ValueError as exc:
        log.warning("job %s: checkpoint refused: %s", job_id, exc)
        return ""


def _let_go(job_id: str, worker_id: str, *, now: datetime) -> bool:
    """Whether the worker was letting go of this job (told to cancel it); its place frees. The job
    may since have been queued again, even for this worker: the answer must not touch that run."""
    if not dispatcher().let_go(job_id, worker_id=worker_id):
        return False
    jobs_dispatch(now=now)
    return True


def _release_and_dispatch(job_id: str, worker_id: str, *, now: datetime) -> None:
    if dispatcher().release(job_id, worker_id=worker_id):
        jobs_dispatch(now=now)
        work_ended.send(sender=Job, worker_id=worker_id)  # placement: its model may be idle now


def job_preempt_held(*, worker_id: str, job_id: str, now: datetime) -> None:
    """Another API process paused a job held by this process's worker (`worker.preempt`): a v2
    worker gets `preempt`, a v1 one `cancel` (and the job is paused at once), as for a pause here."""
    try:
        uuid.UUID(job_id)
    except ValueError:
        log.warning("a worker.preempt event names no job: %r", job_id)
        return
    if Job.objects.filter(id=job_id, worker_id=worker_id, state__in=HELD_STATES, pause_requested=True).exists():
        job_pause_held(job_id=job_id, worker_id=worker_id, now=now, relayed=True)


def job_left_worker(*, worker_id: str, job_id: str, now: datetime) -> None:
    """Another API process cancelled or requeued a job this process's worker holds: its place frees
    (a v2 worker's once it lets the job go: its job_failed or job_result)."""
    if dispatcher().release(job_id, worker_id=worker_id, until_let_go=True):
        jobs_dispatch(now=now)
