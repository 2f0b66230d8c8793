"""The operator UI: staff only, and it shows manifests, jobs in queue order with positions, and workers."""
from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from tests.helpers import register_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(make_account) -> Client:
    root = make_account("root", staff=True)
    root.is_superuser = True  # as `create_account --staff` makes it
    root.save()
    client = Client()
    client.force_login(root)
    return client


def test_it_sends_non_staff_to_the_login_page(alice) -> None:
    client = Client()
    client.force_login(alice)
    response = client.get("/admin/scheduling/job/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.parametrize("path", ["/admin/models_registry/modelmanifest/", "/admin/scheduling/job/",
                                  "/admin/workers/worker/", "/admin/workers/workertoken/"])
def test_it_shows_every_operator_page_to_staff(staff_client: Client, path: str) -> None:
    assert staff_client.get(path).status_code == 200


def test_it_lists_queued_jobs_in_dispatch_order_with_positions(staff_client: Client, alice, bob,
                                                               django_capture_on_commit_callbacks) -> None:
    from scheduling.services import JobRequest, job_submit

    register_model("model-a")
    with django_capture_on_commit_callbacks(execute=True):
        for account, priority in [(alice, 0), (alice, 5), (bob, 0), (alice, 9), (bob, 3), (alice, 0), (bob, 0),
                                  (alice, 1), (bob, 9)]:
            job_submit(account=account, now=timezone.now(),
                       request=JobRequest(params={"prompt": "x"}, model_id="model-a", priority=priority))
    page = staff_client.get("/admin/scheduling/job/?order=queue").content.decode()

    positions = [int(cell) for cell in re.findall(r'<td class="field-position">(\d+)</td>', page)]
    assert positions == list(range(1, 10))


def test_it_cancels_and_requeues_jobs_from_the_admin(staff_client: Client, alice,
                                                     django_capture_on_commit_callbacks) -> None:
    from scheduling.models import Job, JobState
    from scheduling.services import JobRequest, job_submit

    register_model("model-a")
    with django_capture_on_commit_callbacks(execute=True):
        job = job_submit(account=alice, now=timezone.now(),
                         request=JobRequest(params={"prompt": "x"}, model_id="model-a"))
    staff_client.post("/admin/scheduling/job/", {"action": "cancel_jobs", "_selected_action": [str(job.id)]})
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED
    staff_client.post("/admin/scheduling/job/", {"action": "requeue_jobs", "_selected_action": [str(job.id)]})
    assert Job.objects.get(id=job.id).state == JobState.QUEUED


def test_it_shows_each_workers_models_with_their_rungs(staff_client: Client) -> None:
    from workers.models import Worker

    Worker.objects.create(worker_id="host-a:0", connected=True,
                          gpu={"name": "NVIDIA H200", "total_mib": 143771, "free_mib": 140000}, served_models=[
                              {"model_id": "tiny-a", "rung": "full", "realtime": True, "realtime_slots": 3},
                              {"model_id": "big-b", "rung": "group_offload", "realtime": False, "realtime_slots": 0}])

    page = staff_client.get("/admin/workers/worker/").content.decode()

    assert "tiny-a (full, 3 realtime slots)" in page and "big-b (group_offload)" in page
    assert "NVIDIA H200: 140000 of 143771 MiB free" in page


# --- read-only pages: state changes go through the actions and services, never a Save button ----------

def _rows(alice) -> dict[str, tuple[str, object]]:
    """One row of each read-only page: (the page's path, the row)."""
    from realtime.models import RealtimeSession, UsageRecord
    from scheduling.models import Job
    from workers.models import PlacementRecord, Worker

    now = timezone.now()
    register_model("model-a")
    session = RealtimeSession.objects.create(account=alice, model_id="model-a", joined_at=now)
    rows = {
        "worker": Worker.objects.create(worker_id="host-a:0", connected=True, served_models=[]),
        "realtimesession": session,
        "placementrecord": PlacementRecord.objects.create(worker_id="host-a:0", model_id="model-a", action="load",
                                                          reason="queue", sent_at=now),
        "job": Job.objects.create(account=alice, model_id="model-a", params={"prompt": "x"}, created_at=now,
                                  submitted_us=1),
        "usagerecord": UsageRecord.objects.create(account=alice, model_id="model-a", session=session, started_at=now,
                                                  ended_at=now, seconds=1.5),
    }
    apps = {"worker": "workers", "placementrecord": "workers", "job": "scheduling", "realtimesession": "realtime",
            "usagerecord": "realtime"}
    return {name: (f"/admin/{apps[name]}/{name}/{row.pk}/", row) for name, row in rows.items()}


def _fields(row) -> dict:
    return {field.attname: getattr(row, field.attname) for field in row._meta.fields}


@pytest.mark.parametrize("kind", ["worker", "realtimesession", "placementrecord", "job", "usagerecord"])
def test_a_read_only_page_has_no_save_button_and_no_delete(staff_client: Client, alice, kind) -> None:
    path, _ = _rows(alice)[kind]

    page = staff_client.get(path + "change/")

    assert page.status_code == 200
    text = page.content.decode()
    assert not [name for name in ("_save", "_continue", "_addanother") if f'name="{name}"' in text]
    assert f'href="{path}delete/"' not in text and 'value="delete_selected"' not in staff_client.get(
        path.rsplit("/", 2)[0] + "/").content.decode()


@pytest.mark.parametrize("kind", ["worker", "realtimesession", "placementrecord", "job", "usagerecord"])
def test_a_staff_post_to_a_read_only_page_changes_nothing(staff_client: Client, alice, kind) -> None:
    path, row = _rows(alice)[kind]
    before = _fields(row)
    edited = {name: "changed" for name in before if name not in ("id", "account_id", "session_id")}

    assert staff_client.post(path + "change/", {**edited, "_save": "Save"}).status_code == 403
    assert staff_client.post(path + "delete/", {"post": "yes"}).status_code == 403
    changelist = path.rsplit("/", 2)[0] + "/"
    staff_client.post(changelist, {"action": "delete_selected", "_selected_action": [str(row.pk)], "post": "yes"})

    row.refresh_from_db()
    assert _fields(row) == before


def test_the_actions_stay_on_the_read_only_pages(staff_client: Client, alice) -> None:
    from realtime.models import SessionState

    paths = _rows(alice)
    session_path, session = paths["realtimesession"]
    job_path, job = paths["job"]

    for changelist, action in [(job_path.rsplit("/", 2)[0] + "/", "pause_jobs"),
                               (session_path.rsplit("/", 2)[0] + "/", "end_sessions")]:
        assert f'value="{action}"' in staff_client.get(changelist).content.decode()
    staff_client.post(job_path.rsplit("/", 2)[0] + "/", {"action": "pause_jobs", "_selected_action": [str(job.pk)]})
    staff_client.post(session_path.rsplit("/", 2)[0] + "/", {"action": "end_sessions",
                                                             "_selected_action": [str(session.pk)]})

    job.refresh_from_db()
    session.refresh_from_db()
    assert job.state == "paused" and session.state == SessionState.CLOSED
