"""Retention (scheduling/services/retention.py, `manage.py purge_jobs`, the periodic runner): ended
jobs made by the services a worker's answers call are purged with their dependent rows and their
files on disk, while recent and unfinished ones stay, in batches, idempotently; a job paused too
long loses its checkpoint, stays paused and starts from step 0 when resumed; one process a period."""
from __future__ import annotations

import base64
import io
from datetime import timedelta
from pathlib import Path

import pytest
from channels.db import database_sync_to_async
from django.core.management import CommandError, call_command
from django.utils import timezone

from scheduling.models import Job, WebhookDelivery
from scheduling.retention import job_files, retention_cutoff
from scheduling.retention_runner import RetentionRunner
from scheduling.selectors import jobs_per_model_and_state
from scheduling.services.retention import Purged, retention_run
from tests.helpers import api_client, eventually, job_row, tiny_png

pytestmark = pytest.mark.django_db(transaction=True)

PNG_B64 = base64.b64encode(tiny_png(2, 2)).decode()
INIT_IMAGE = "data:image/png;base64," + base64.b64encode(tiny_png(8, 8)).decode()
LONG_AGO = timedelta(days=40)


def files_of(settings, job_id: str) -> list[str]:
    """The files in a job's folder under MEDIA_ROOT (none when the folder is gone)."""
    folder = Path(settings.MEDIA_ROOT) / "jobs" / job_id
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@database_sync_to_async
def submit(account, **params) -> str:
    response = api_client(account).post("/api/v1/jobs/", {"params": {"prompt": "a cat", **params}}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


@database_sync_to_async
def post(account, job_id: str, verb: str) -> dict:
    response = api_client(account).post(f"/api/v1/jobs/{job_id}/{verb}/")
    assert response.status_code == 200, response.content
    return response.json()


@database_sync_to_async
def backdate(job_ids: list[str], **ago: timedelta) -> None:
    """Move the jobs' finish (or pause) back in time, as if days had passed since."""
    now = timezone.now()
    Job.objects.filter(id__in=job_ids).update(**{field: now - delta for field, delta in ago.items()})


@database_sync_to_async
def purge_jobs(*args: str) -> str:
    out = io.StringIO()
    call_command("purge_jobs", *args, stdout=out)
    return out.getvalue().strip()


@database_sync_to_async
def rows_left(job_ids: list[str]) -> list[str]:
    return sorted(str(i) for i in Job.objects.filter(id__in=job_ids).values_list("id", flat=True))


async def ended_jobs(alice, workers, settings) -> dict[str, str]:
    """alice's jobs, made through REST and a worker's answers: `old` succeeded with one image and a
    webhook delivery, `old_init` succeeded with two images and its init_image (and a file a crash left
    in its folder), `cancelled` was cancelled before it ran (its init_image kept), `recent` succeeded
    just now, `held` still runs. Their ids by name."""
    ids = {"old": await submit(alice), "old_init": await submit(alice, init_image=INIT_IMAGE),
           "cancelled": await submit(alice, init_image=INIT_IMAGE), "recent": await submit(alice),
           "held": await submit(alice)}
    await post(alice, ids["cancelled"], "cancel")
    worker = workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(2)] == [ids["old"], ids["old_init"]]
    await worker.result(ids["old"], [PNG_B64])
    await worker.result(ids["old_init"], [PNG_B64, PNG_B64])
    assert [m["job_id"] for m in await worker.jobs(2)] == [ids["recent"], ids["held"]]
    await worker.result(ids["recent"], [PNG_B64])

    async def recent_succeeded() -> bool:  # the worker's report is stored on its socket's own thread
        return (await job_row(ids["recent"]))["state"] == "succeeded"

    await eventually(recent_succeeded)
    await database_sync_to_async(WebhookDelivery.objects.create)(job_id=ids["old"], url="https://example.com/hook",
                                                                 created_at=timezone.now())
    (Path(settings.MEDIA_ROOT) / "jobs" / ids["old_init"] / "checkpoint-3.bin").write_bytes(b"left by a crash")
    await backdate([ids["old"], ids["old_init"], ids["cancelled"]], finished_at=LONG_AGO)
    return ids


# --- ended jobs ----------------------------------------------------------------------------------

async def test_purge_jobs_deletes_old_ended_jobs_with_their_rows_and_files_and_nothing_else(alice, workers,
                                                                                            settings):
    ids = await ended_jobs(alice, workers, settings)
    assert files_of(settings, ids["old"]) == ["0.png"]
    assert files_of(settings, ids["old_init"]) == ["0.png", "1.png", "checkpoint-3.bin", "init_image.txt"]
    assert files_of(settings, ids["cancelled"]) == ["init_image.txt"]  # ~10 MB a job at most, kept until purged

    said = await purge_jobs("--older-than", "30", "--batch", "2")  # two batches

    assert said.startswith("purged 3 jobs that ended more than 30 days ago")
    assert await rows_left(list(ids.values())) == sorted([ids["recent"], ids["held"]])
    assert await database_sync_to_async(WebhookDelivery.objects.count)() == 0
    for name in ("old", "old_init", "cancelled"):
        assert not (Path(settings.MEDIA_ROOT) / "jobs" / ids[name]).exists(), name
    assert files_of(settings, ids["recent"]) == ["0.png"]
    # /metrics still counts them: an ended state's count never goes down
    counts = await database_sync_to_async(jobs_per_model_and_state)()
    assert counts[("tiny-a", "succeeded")] == 3 and counts[("tiny-a", "cancelled")] == 1
    assert counts[("tiny-a", "dispatched")] == 1

    assert (await purge_jobs("--older-than", "30")).startswith("purged 0 jobs")  # idempotent
    assert (await database_sync_to_async(jobs_per_model_and_state)())[("tiny-a", "succeeded")] == 3


async def test_a_purged_jobs_image_and_representation_answer_404(alice, workers, settings):
    ids = await ended_jobs(alice, workers, settings)
    await purge_jobs("--older-than", "30")

    def status(path: str) -> int:
        return api_client(alice, raise_request_exception=False).get(path).status_code

    assert await database_sync_to_async(status)(f"/api/v1/jobs/{ids['old']}/") == 404
    assert await database_sync_to_async(status)(f"/api/v1/jobs/{ids['old']}/images/0/") == 404


def test_the_command_wants_a_retention_of_a_day_or_more(settings):
    settings.JOB_RETENTION_DAYS = 0
    for args in ([], ["--older-than", "0"], ["--older-than", "-3"], ["--older-than", "30", "--batch", "0"],
                 ["--older-than", "30", "--paused-checkpoints", "-1"]):
        with pytest.raises(CommandError):
            call_command("purge_jobs", *args, stdout=io.StringIO())


# --- paused jobs' checkpoints ----------------------------------------------------------------------

async def paused_with_checkpoint(alice, v2_workers, **params) -> tuple[str, object]:
    """A job a v2 worker ran to step 4 and that was paused there with its checkpoint; and the worker."""
    from scheduling import services

    job_id = await submit(alice, **params)
    worker = v2_workers()
    await worker.join(["tiny-a"])
    assert [m["job_id"] for m in await worker.jobs(1)] == [job_id]
    await worker.started(job_id)
    await post(alice, job_id, "pause")
    assert await worker.receive() == {"type": "preempt", "job_id": job_id}
    assert await database_sync_to_async(services.job_preempted)(
        worker_id="host-a:0", job_id=job_id, step=4, steps=10, checkpoint=b"latents after step 4", now=timezone.now())
    return job_id, worker


async def test_a_job_paused_too_long_loses_its_checkpoint_stays_paused_and_restarts_from_step_0(
        alice, v2_workers, settings):
    job_id, worker = await paused_with_checkpoint(alice, v2_workers, init_image=INIT_IMAGE)
    row = await job_row(job_id)
    assert row["state"] == "paused" and row["checkpoint_step"] == 4 and row["paused_at"] is not None
    assert files_of(settings, job_id) == ["checkpoint-4.bin", "init_image.txt"]
    await backdate([job_id], paused_at=timedelta(days=6))

    assert await database_sync_to_async(retention_run)(now=timezone.now(), job_days=0, checkpoint_days=7) == Purged()
    assert files_of(settings, job_id) == ["checkpoint-4.bin", "init_image.txt"]  # paused 6 days: kept

    await backdate([job_id], paused_at=timedelta(days=8))
    said = await purge_jobs("--older-than", "30", "--paused-checkpoints", "7")

    assert said.endswith("dropped 1 paused jobs' checkpoints")
    row = await job_row(job_id)
    assert (row["state"], row["checkpoint"], row["checkpoint_step"]) == ("paused", "", None)
    assert files_of(settings, job_id) == ["init_image.txt"]  # the job's other files stay with it
    assert (await post(alice, job_id, "resume"))["checkpoint_step"] is None
    (order,) = await worker.jobs(1)
    assert order["job_id"] == job_id and order.get("resume") is None  # from step 0
    assert order["params"]["init_image"] == INIT_IMAGE


async def test_checkpoints_are_kept_while_paused_with_paused_checkpoint_days_0(alice, v2_workers, settings):
    settings.PAUSED_CHECKPOINT_DAYS = 0
    job_id, _ = await paused_with_checkpoint(alice, v2_workers)
    await backdate([job_id], paused_at=timedelta(days=400))

    assert (await purge_jobs("--older-than", "30")).endswith("dropped 0 paused jobs' checkpoints")
    assert (await job_row(job_id))["checkpoint_step"] == 4


async def test_pausing_a_queued_job_records_when(alice, workers):
    job_id = await submit(alice)
    before = timezone.now()

    await post(alice, job_id, "pause")

    assert (await job_row(job_id))["paused_at"] >= before


# --- the periodic run ------------------------------------------------------------------------------

async def test_the_periodic_run_purges_with_the_settings_in_one_process_a_period(alice, workers, settings):
    settings.JOB_RETENTION_DAYS = 30
    ids = await ended_jobs(alice, workers, settings)
    mine, another_process = RetentionRunner(period=lambda: 3600), RetentionRunner(period=lambda: 3600)
    assert mine.enabled()

    assert await database_sync_to_async(mine.tick)() == Purged(jobs=3, checkpoints=0)
    assert await database_sync_to_async(another_process.tick)() is None  # the period is claimed
    assert await database_sync_to_async(mine.tick)() is None
    assert await rows_left(list(ids.values())) == sorted([ids["recent"], ids["held"]])


def test_the_periodic_run_is_off_when_both_retentions_are_0(settings):
    settings.JOB_RETENTION_DAYS = settings.PAUSED_CHECKPOINT_DAYS = 0
    assert not RetentionRunner().enabled()
    assert RetentionRunner(first=0).start() is False


# --- the rules -------------------------------------------------------------------------------------

def test_the_cutoff_is_days_before_now_and_none_for_0():
    now = timezone.now()
    assert retention_cutoff(now, 30) == now - timedelta(days=30)
    assert retention_cutoff(now, 0) is None
    with pytest.raises(ValueError):
        retention_cutoff(now, -1)


def test_a_rows_files_are_the_names_it_holds():
    files = job_files("j1", images=["jobs/j1/0.png", "", 3], checkpoint="", init_image="jobs/j1/init_image.txt")
    assert files.names == ("jobs/j1/0.png", "jobs/j1/init_image.txt") and files.folder == "jobs/j1"


async def test_files_the_storage_failed_to_delete_are_deleted_by_the_next_run(alice, workers, settings, monkeypatch):
    from django.core.files.storage import FileSystemStorage

    ids = await ended_jobs(alice, workers, settings)
    delete = FileSystemStorage.delete

    def failing(storage, name):  # the storage is away for one job's files
        if ids["old_init"] in name:
            raise OSError("storage unavailable")
        return delete(storage, name)

    monkeypatch.setattr(FileSystemStorage, "delete", failing)
    assert (await purge_jobs("--older-than", "30")).startswith("purged 3 jobs")
    assert await rows_left([ids["old"], ids["old_init"], ids["cancelled"]]) == []
    assert files_of(settings, ids["old_init"]) == ["0.png", "1.png", "checkpoint-3.bin", "init_image.txt"]
    assert not (Path(settings.MEDIA_ROOT) / "jobs" / ids["old"]).exists()

    monkeypatch.setattr(FileSystemStorage, "delete", delete)
    assert (await purge_jobs("--older-than", "30")).startswith("purged 0 jobs")  # no row left to purge...

    assert not (Path(settings.MEDIA_ROOT) / "jobs" / ids["old_init"]).exists()  # ...and the files went
    assert list((Path(settings.MEDIA_ROOT) / "retention").iterdir()) == []  # the note with them
