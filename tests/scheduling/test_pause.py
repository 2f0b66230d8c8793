"""Pausing and resuming jobs through REST and the admin, with no worker connected: a queued job
leaves the queue and comes back at its old place (the contract's fair-share example), the 409s,
another account's 404, the job limit counting paused jobs, and the checkpoint a cancel deletes."""
from __future__ import annotations

import json

import pytest
from django.core.files.storage import default_storage
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from scheduling import services
from scheduling.checkpoints import checkpoint_save
from scheduling.models import Job, JobState
from tests.helpers import api_client, register_model

pytestmark = pytest.mark.django_db

PROMPT = {"prompt": "a red circle"}


@pytest.fixture
def models(db):
    register_model("tiny-a")


@pytest.fixture
def submit(models, django_capture_on_commit_callbacks):
    """Submit a job through REST as `account`; its id."""
    def submit(account, **body):
        with django_capture_on_commit_callbacks(execute=True):
            response = api_client(account).post("/api/v1/jobs/", {"params": PROMPT, **body}, format="json")
        assert response.status_code == 201, response.content
        return response.json()["id"]

    return submit


@pytest.fixture
def post(django_capture_on_commit_callbacks):
    """POST /api/v1/jobs/{id}/{verb}/ as `account`, running what the service queues after commit."""
    def post(account, job_id, verb):
        with django_capture_on_commit_callbacks(execute=True):
            return api_client(account, raise_request_exception=False).post(f"/api/v1/jobs/{job_id}/{verb}/")

    return post


def shown(account, job_id):
    return api_client(account).get(f"/api/v1/jobs/{job_id}/").json()


def positions(account_of, ids):
    return {name: shown(account_of[name], job_id)["position"] for name, job_id in ids.items()}


def contract_example(alice, bob, submit):
    """alice submits a1..a6, then bob b1, b2 (priority 0, one model, no worker); their ids by name."""
    ids = {f"a{n}": submit(alice) for n in range(1, 7)}
    ids |= {f"b{n}": submit(bob) for n in range(1, 3)}
    return ids, {name: alice if name.startswith("a") else bob for name in ids}


# --- a queued job --------------------------------------------------------------------------------

def test_pausing_a_queued_job_takes_it_out_of_the_queue_and_resuming_puts_it_back_at_its_old_place(
        alice, bob, submit, post):
    ids, account_of = contract_example(alice, bob, submit)
    before = positions(account_of, ids)
    assert before == {"a1": 1, "b1": 2, "a2": 3, "b2": 4, "a3": 5, "a4": 6, "a5": 7, "a6": 8}

    paused = post(alice, ids["a2"], "pause")

    assert paused.status_code == 200
    assert paused.json()["state"] == "paused" and paused.json()["position"] is None
    assert positions(account_of, ids) == {"a1": 1, "b1": 2, "a2": None, "b2": 4, "a3": 3, "a4": 5, "a5": 6,
                                          "a6": 7}

    resumed = post(alice, ids["a2"], "resume")

    assert resumed.status_code == 200
    assert resumed.json()["state"] == "queued" and resumed.json()["position"] == 3
    assert positions(account_of, ids) == before


def test_a_paused_job_shows_its_new_fields_and_is_listed_by_state(alice, submit, post):
    queued, paused = submit(alice), submit(alice)
    post(alice, paused, "pause")

    listed = api_client(alice).get("/api/v1/jobs/", {"state": "paused"}).json()

    assert [job["id"] for job in listed["results"]] == [paused]
    job = listed["results"][0]
    assert job["state"] == "paused" and job["position"] is None and job["worker_id"] is None
    assert (job["preemptions"], job["checkpoint_step"], job["progress"]) == (0, None, None)
    assert [j["id"] for j in api_client(alice).get("/api/v1/jobs/", {"state": "queued"}).json()["results"]] == [queued]


def test_pausing_a_paused_job_changes_nothing(alice, submit, post):
    job_id = submit(alice)
    post(alice, job_id, "pause")

    again = post(alice, job_id, "pause")

    assert again.status_code == 200 and again.json()["state"] == "paused"


def test_a_paused_job_is_not_queued_again_by_a_restarted_api(alice, submit, post):
    from potocolom.runtime import runtime
    from scheduling.dispatcher import DISPATCHER, dispatcher

    kept, paused = submit(alice), submit(alice)
    post(alice, paused, "pause")

    runtime.reset(DISPATCHER)  # what a restarted API process has: only the database

    assert [job.job_id for job in dispatcher().queues.queued("tiny-a")] == [kept]
    assert shown(alice, paused)["position"] is None


# --- the answers that refuse --------------------------------------------------------------------

@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.DISPATCHED, JobState.RUNNING])
def test_resuming_a_job_that_is_not_paused_answers_409_job_not_paused(alice, submit, post, state):
    job_id = submit(alice)
    Job.objects.filter(id=job_id).update(state=state)

    response = post(alice, job_id, "resume")

    assert response.status_code == 409
    assert response.json()["error"] == "job_not_paused" and response.json()["detail"]
    assert Job.objects.get(id=job_id).state == state


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_pausing_or_resuming_an_ended_job_answers_409_job_already_ended(alice, submit, post, state, verb):
    job_id = submit(alice)
    Job.objects.filter(id=job_id).update(state=state, finished_at=timezone.now())

    response = post(alice, job_id, verb)

    assert response.status_code == 409
    assert response.json()["error"] == "job_already_ended"
    assert Job.objects.get(id=job_id).state == state


@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_bob_can_neither_pause_nor_resume_alices_job(alice, bob, submit, post, verb):
    job_id = submit(alice)
    if verb == "resume":
        post(alice, job_id, "pause")
    state = Job.objects.get(id=job_id).state

    assert post(bob, job_id, verb).status_code == 404
    assert post(alice, "not-a-uuid", verb).status_code == 404
    assert Job.objects.get(id=job_id).state == state


def test_pauses_and_resumes_over_the_submission_rate_answer_429_with_retry_after(settings, alice, bob, submit, post):
    job_id, bobs = submit(alice), submit(bob)
    settings.JOB_SUBMIT_RATE = "3/minute"

    answers = [post(alice, job_id, verb) for verb in ("pause", "resume", "pause", "resume")]

    assert [answer.status_code for answer in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert refused.json()["error"] == "throttled" and 1 <= int(refused["Retry-After"]) <= 60
    assert Job.objects.get(id=job_id).state == JobState.PAUSED
    # per account, on a counter of their own: bob pauses, alice still submits, reads and cancels
    assert post(bob, bobs, "pause").status_code == 200
    submit(alice)
    assert api_client(alice).get(f"/api/v1/jobs/{job_id}/").status_code == 200
    assert post(alice, job_id, "cancel").status_code == 200


def test_submissions_do_not_use_up_the_pauses(settings, alice, submit, post):
    settings.JOB_SUBMIT_RATE = "2/minute"
    first, _ = submit(alice), submit(alice)

    assert post(alice, first, "pause").status_code == 200
    assert post(alice, first, "resume").status_code == 200


def test_the_job_limit_counts_paused_jobs(settings, alice, submit, post, django_capture_on_commit_callbacks):
    settings.ACCOUNT_JOB_LIMIT = 2
    first = submit(alice)
    post(alice, first, "pause")
    submit(alice)

    with django_capture_on_commit_callbacks(execute=True):
        refused = api_client(alice).post("/api/v1/jobs/", {"params": PROMPT}, format="json")

    assert refused.status_code == 429 and refused.json()["error"] == "too_many_jobs"
    assert post(alice, first, "cancel").status_code == 200  # a cancelled paused job no longer counts
    submit(alice)


def test_the_job_limits_count_reads_only_the_partial_index_of_unfinished_jobs(alice, models):
    with CaptureQueriesContext(connection) as queries:
        services.job_submit(account=alice, request=services.JobRequest(params=PROMPT, model_id="tiny-a"),
                            now=timezone.now())
    count, = [q["sql"] for q in queries.captured_queries if "COUNT(*)" in q["sql"]]

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # a table this small would be read whole otherwise
            cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {count}" if connection.vendor == "postgresql" else f"EXPLAIN QUERY PLAN {count}")
        plan = " ".join(str(row[-1]) for row in cursor.fetchall())

    # the planner could prove the count's WHERE implies the index's condition (the same states)
    assert "job_account_unfinished" in plan, plan


# --- cancelling a paused job --------------------------------------------------------------------

def test_cancelling_a_paused_job_ends_it_and_deletes_its_checkpoint(alice, submit, post):
    job_id = submit(alice)
    post(alice, job_id, "pause")
    name = checkpoint_save(job_id, 7, b"latents at step 7")
    Job.objects.filter(id=job_id).update(checkpoint=name, checkpoint_step=7)
    assert shown(alice, job_id)["checkpoint_step"] == 7

    response = post(alice, job_id, "cancel")

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled" and response.json()["checkpoint_step"] is None
    assert not default_storage.exists(name)
    assert Job.objects.get(id=job_id).checkpoint == ""


# --- the admin ----------------------------------------------------------------------------------

def test_staff_pause_and_resume_jobs_from_the_admin(alice, submit, make_account, client,
                                                     django_capture_on_commit_callbacks):
    first, second = submit(alice), submit(alice)
    root = make_account("root", staff=True)
    root.is_superuser = True  # as `create_account --staff` makes it
    root.save()
    client.force_login(root)

    def act(action, *ids):
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post("/admin/scheduling/job/", {"action": action, "_selected_action": list(ids)})
        assert response.status_code == 302

    act("pause_jobs", first)
    assert [shown(alice, i)["state"] for i in (first, second)] == ["paused", "queued"]
    assert shown(alice, second)["position"] == 1

    act("resume_jobs", first, second)  # the queued one is left as it is
    assert [shown(alice, i)["position"] for i in (first, second)] == [1, 2]


def test_the_admin_actions_are_for_staff_only(alice, submit, client):
    job_id = submit(alice)
    client.force_login(alice)

    response = client.post("/admin/scheduling/job/", {"action": "pause_jobs", "_selected_action": [job_id]})

    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert Job.objects.get(id=job_id).state == JobState.QUEUED


# --- the schema ---------------------------------------------------------------------------------

def test_the_openapi_schema_validates_and_has_pause_resume_and_the_new_fields(tmp_path):
    target = tmp_path / "schema.json"

    call_command("spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json", "--file", str(target))

    schema = json.loads(target.read_text())
    assert {"/api/v1/jobs/{id}/pause/", "/api/v1/jobs/{id}/resume/"} <= set(schema["paths"])
    job = schema["components"]["schemas"]["Job"]["properties"]
    assert {"preemptions", "checkpoint_step", "progress"} <= set(job)
    assert "paused" in json.dumps(schema["components"]["schemas"])
