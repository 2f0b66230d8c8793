"""Retention's writes: ended jobs purged with their rows' dependents and files, paused jobs'
checkpoints dropped; a batch at a time, each batch one transaction, its files deleted after its
commit (a note in the storage, written before the commit, names them until they are gone: a run
after a crash deletes what the crashed one left). docs/operations.md, "Retention"."""
from __future__ import annotations

import json
import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import F

from scheduling.events import jobs_changed
from scheduling.models import ENDED_STATES, Job, JobState, PurgedJobs, WebhookDelivery
from scheduling.retention import JobFiles, job_files, retention_cutoff

log = logging.getLogger(__name__)
PURGE_BATCH = 500  # jobs per transaction: bounds the memory, the locks held and a crash's orphan files
NOTES = "retention"  # the storage folder of the purge notes: a batch's files, until they are deleted
NOTE_OPEN_FOR = timedelta(hours=1)  # far longer than a batch's transaction can last


@dataclass(frozen=True)
class Purged:
    """What one retention run removed: ended jobs (rows, dependents and files), checkpoints of
    paused jobs, and closed sessions with their usage records."""

    jobs: int = 0
    checkpoints: int = 0
    sessions: int = 0  # closed sessions (realtime), when the run is fleet.retention's


def retention_run(*, now: datetime, job_days: int | None = None, checkpoint_days: int | None = None,
                  batch: int = PURGE_BATCH) -> Purged:
    """Purge what JOB_RETENTION_DAYS and PAUSED_CHECKPOINT_DAYS (or the days given) let go."""
    job_days = settings.JOB_RETENTION_DAYS if job_days is None else job_days
    checkpoint_days = settings.PAUSED_CHECKPOINT_DAYS if checkpoint_days is None else checkpoint_days
    return Purged(jobs=jobs_purge(older_than_days=job_days, now=now, batch=batch),
                  checkpoints=paused_checkpoints_purge(older_than_days=checkpoint_days, now=now, batch=batch))


def jobs_purge(*, older_than_days: int, now: datetime, batch: int = PURGE_BATCH) -> int:
    """Delete the jobs that ended (succeeded, failed, cancelled) more than `older_than_days` ago (0:
    none), oldest first: their rows, their webhook deliveries, then, once that commits, their files
    (images, init_image, any checkpoint, and whatever else is in their folder). A crash between the
    two leaves at most one batch's files with no row, never a row pointing at a missing file, and
    the batch's note: the next run deletes those files first (leftovers_purge). Rows another purge
    holds are skipped (it deletes them). How many jobs went."""
    cutoff = retention_cutoff(now, older_than_days)
    total = 0
    if cutoff is not None:
        leftovers_purge(now=now)
    while cutoff is not None:
        purged, note = _purge_batch(cutoff=cutoff, batch=batch)
        if all([_delete_files(files) for files in purged]):
            _delete_note(note)  # else kept: the next run tries the files again
        total += len(purged)
        if len(purged) < batch:
            break
    if total:
        log.info("purged %d jobs that ended before %s", total, cutoff)
    return total


def _purge_batch(*, cutoff: datetime, batch: int) -> tuple[list[JobFiles], str]:
    """One transaction: lock the oldest `batch` ended jobs before `cutoff` (skipping rows locked by
    another purge), note their files in the storage, delete the rows and their dependents, and
    count them as purged for /metrics. The files to delete, and the note's name ("" for none)."""
    with transaction.atomic():
        rows = list(Job.objects.select_for_update(skip_locked=True)
                    .filter(state__in=ENDED_STATES, finished_at__lt=cutoff).order_by("finished_at", "id")
                    .values_list("id", "model_id", "state", "images", "checkpoint", "init_image")[:batch])
        if not rows:
            return [], ""
        files = [job_files(str(job_id), images=images if isinstance(images, list) else [], checkpoint=checkpoint,
                           init_image=init_image) for job_id, _, _, images, checkpoint, init_image in rows]
        note = _write_note(files)  # before the commit: a crash after it leaves the note to finish with
        ids = [row[0] for row in rows]
        WebhookDelivery.objects.filter(job_id__in=ids).delete()
        Job.objects.filter(id__in=ids).only("id").delete()  # and any dependent a later model adds
        _count_purged(Counter((model_id, state) for _, model_id, state, *_ in rows))
    return files, note


def _write_note(files: list[JobFiles]) -> str:
    """A purge note: the batch's jobs and the files their rows named, saved in the storage."""
    body = json.dumps([{"job_id": f.job_id, "names": list(f.names)} for f in files])
    return default_storage.save(f"{NOTES}/purge-{uuid.uuid4().hex}.json", ContentFile(body.encode()))


def _older_than(name: str, age: timedelta, *, now: datetime) -> bool:
    try:
        return bool(default_storage.get_modified_time(name) < now - age)
    except (OSError, NotImplementedError):
        return True


def _delete_note(note: str) -> None:
    if note:
        _delete_names([note], job_id="(a purge note)")


def leftovers_purge(*, now: datetime) -> int:
    """Finish the batches a crashed purge left: for each note, the files of its jobs whose rows are
    gone (a note whose transaction rolled back names rows that are still there: their files stay),
    then the note (one naming rows still there only once it is NOTE_OPEN_FOR old: until then its
    purge may still be running). How many jobs' files went."""
    try:
        _, notes = default_storage.listdir(NOTES)
    except (OSError, NotImplementedError):  # no note was ever written, or a storage without listing
        return 0
    finished = 0
    for name in sorted(notes):
        note = f"{NOTES}/{name}"
        try:
            with default_storage.open(note) as handle:
                entries = json.loads(handle.read())
            noted = [JobFiles(str(entry["job_id"]), tuple(str(n) for n in entry["names"])) for entry in entries]
        except FileNotFoundError:
            continue  # another purge finished it meanwhile
        except (OSError, ValueError, KeyError, TypeError):
            log.exception("could not read the purge note %s; left for an operator", note)
            continue
        still = {str(job_id) for job_id in Job.objects.filter(id__in=[f.job_id for f in noted])
                 .values_list("id", flat=True)}
        deleted = True
        for files in noted:
            if files.job_id not in still:
                deleted = _delete_files(files) and deleted
                finished += 1
        if not deleted or (still and not _older_than(note, NOTE_OPEN_FOR, now=now)):
            continue  # the storage failed again, or another purge's transaction may still be open
        _delete_note(note)
    if finished:
        log.info("deleted the files of %d jobs a crashed purge had left", finished)
    return finished


def _count_purged(counts: Counter[tuple[str, str]]) -> None:
    """Inside the purge's transaction: add the purged jobs to their (model, state) tallies."""
    for (model_id, state), n in sorted(counts.items()):
        tally = PurgedJobs.objects.filter(model_id=model_id, state=state)
        if not tally.update(count=F("count") + n):
            PurgedJobs.objects.get_or_create(model_id=model_id, state=state)  # (another purge may make it first)
            tally.update(count=F("count") + n)


def _delete_files(files: JobFiles) -> bool:
    """A purged job's files, then its folder's leftovers and the folder itself; False when the
    storage failed on one."""
    names = list(files.names)
    try:
        _, found = default_storage.listdir(files.folder)
        names += [f"{files.folder}/{name}" for name in found if f"{files.folder}/{name}" not in names]
    except (OSError, NotImplementedError):  # no folder (no file was stored), or a storage without listing
        pass
    return _delete_names([*names, files.folder], job_id=files.job_id)  # a file system storage removes an empty folder


def _delete_names(names: list[str], *, job_id: str) -> bool:
    """Delete stored files (a missing one is no error); False when the storage failed on one (logged:
    the rows no longer point at it, and a purge's note keeps it for the next run)."""
    deleted = True
    for name in names:
        try:
            default_storage.delete(name)
        except Exception:
            log.exception("could not delete %s of job %s", name, job_id)
            deleted = False
    return deleted


def paused_checkpoints_purge(*, older_than_days: int, now: datetime, batch: int = PURGE_BATCH) -> int:
    """Drop the checkpoints of jobs paused more than `older_than_days` ago (0: none): the job stays
    paused, its row forgets the checkpoint (compare-and-set), its blob is deleted after the commit,
    and a resume starts it from step 0. Its account's sockets hear the job (checkpoint_step null).
    How many checkpoints went."""
    cutoff = retention_cutoff(now, older_than_days)
    total = 0
    while cutoff is not None:
        with transaction.atomic():
            rows = list(Job.objects.select_for_update(skip_locked=True)
                        .filter(state=JobState.PAUSED, paused_at__lt=cutoff).exclude(checkpoint="")
                        .order_by("paused_at", "id").values_list("id", "checkpoint")[:batch])
            dropped = [(str(job_id), name) for job_id, name in rows
                       if Job.objects.filter(id=job_id, state=JobState.PAUSED, checkpoint=name)
                       .update(checkpoint="", checkpoint_step=None)]
            jobs_changed([job_id for job_id, _ in dropped], now=now)
        for job_id, name in dropped:
            _delete_names([name], job_id=job_id)  # the paused job's other files (its init_image) stay
        total += len(dropped)
        if len(rows) < batch:
            break
    if total:
        log.info("dropped the checkpoints of %d jobs paused before %s", total, cutoff)
    return total
