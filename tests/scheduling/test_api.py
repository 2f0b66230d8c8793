"""REST for jobs (/api/v1/jobs/), the staff queue view and the OpenAPI schema, with token auth."""
from __future__ import annotations

import json
import uuid

import pytest
from django.utils import timezone

from scheduling import services
from scheduling.models import Job, JobState
from tests.helpers import api_client, register_model

pytestmark = pytest.mark.django_db

PROMPT = {"prompt": "a red circle"}
JOB_FIELDS = {"id", "state", "model_id", "params", "priority", "attempts", "position", "worker_id", "created_at",
              "started_at", "finished_at", "images", "error"}


@pytest.fixture
def models(db):
    """Two draft models of equal cost (draft-a wins the tie), a standard and a txt2img-only premium one."""
    register_model("draft-b", cost=1.0)
    register_model("draft-a", cost=1.0)
    register_model("standard-sd", tier="standard", cost=2.0)
    register_model("premium-xl", tier="premium", cost=5.0, capabilities=("txt2img",))


@pytest.fixture
def submit(django_capture_on_commit_callbacks):
    """POST /api/v1/jobs/ as an account, running what job_submit queues after the commit."""
    def submit(account, body, **extra):
        with django_capture_on_commit_callbacks(execute=True):
            if isinstance(body, (str, bytes)):
                return api_client(account).post("/api/v1/jobs/", body, content_type="application/json", **extra)
            return api_client(account).post("/api/v1/jobs/", body, format="json", **extra)

    return submit


@pytest.fixture
def job_of(submit):
    """Submit a job and return its REST body (201 checked)."""
    def job_of(account, params=PROMPT, **body):
        response = submit(account, {"params": params, **body})
        assert response.status_code == 201, response.content
        return response.json()

    return job_of


def get(account, path: str, **query):
    return api_client(account).get(path, query)


# --- submitting ---------------------------------------------------------------------------------

def test_it_routes_a_job_without_model_id_to_the_cheapest_match(models, alice, submit):
    response = submit(alice, {"params": PROMPT})

    assert response.status_code == 201
    job = response.json()
    assert JOB_FIELDS <= set(job)
    assert job["model_id"] == "draft-a"
    assert job["state"] == "queued" and job["attempts"] == 1 and job["priority"] == 0
    assert job["params"] == PROMPT
    assert job["worker_id"] is None and job["images"] == [] and job["error"] is None
    assert job["started_at"] is None and job["finished_at"] is None and job["created_at"]
    assert str(uuid.UUID(job["id"])) == job["id"]
    stored = Job.objects.get(id=job["id"])
    assert stored.account == alice and stored.model_id == "draft-a"


@pytest.mark.parametrize(("body", "model_id"), [
    pytest.param({"tier": "standard"}, "standard-sd", id="tier"),
    pytest.param({"tier": "premium", "capabilities": ["txt2img"]}, "premium-xl", id="tier and capability"),
    pytest.param({"capabilities": ["txt2img", "img2img"]}, "draft-a", id="all capabilities"),
    pytest.param({"capabilities": []}, "draft-a", id="no capabilities asked"),
    pytest.param({"model_id": "premium-xl"}, "premium-xl", id="a named model"),
    pytest.param({"model_id": "standard-sd", "tier": "draft"}, "standard-sd", id="model_id wins over tier"),
])
def test_it_routes_by_tier_capabilities_and_model_id(models, alice, job_of, body, model_id):
    assert job_of(alice, **body)["model_id"] == model_id


def test_it_routes_to_a_model_as_soon_as_it_is_registered(models, alice, job_of):
    register_model("cheaper-still", cost=0.5)

    assert job_of(alice)["model_id"] == "cheaper-still"


@pytest.mark.django_db(transaction=True)
def test_it_answers_a_submitted_job_with_its_queue_position(models, alice, bob):
    first = api_client(alice).post("/api/v1/jobs/", {"params": PROMPT}, format="json").json()
    second = api_client(bob).post("/api/v1/jobs/", {"params": PROMPT}, format="json").json()

    assert (first["position"], second["position"]) == (1, 2)


ROUTING_ERRORS = [
    pytest.param({"model_id": "nope", "params": PROMPT}, "unknown_model", "model_id", id="unknown model"),
    pytest.param({"model_id": "draft-a", "params": {"prompt": "x", "width": 4096}}, "invalid_params", "params",
                 id="params the named model rejects"),
    pytest.param({"model_id": "draft-a", "params": {}}, "invalid_params", "params", id="params without prompt"),
    pytest.param({"params": {"prompt": "x", "width": 4096}}, "no_matching_model", None,
                 id="no model takes these params"),
    pytest.param({"tier": "premium", "capabilities": ["img2img"], "params": PROMPT}, "no_matching_model", None,
                 id="no model of that tier has that capability"),
]


@pytest.mark.parametrize(("body", "code", "field"), ROUTING_ERRORS)
def test_it_refuses_a_job_it_cannot_route(models, alice, submit, body, code, field):
    response = submit(alice, body)

    assert response.status_code == 400
    answer = response.json()
    assert set(answer) == {"error", "detail"}
    assert answer["error"] == code
    assert answer["detail"]
    if field:
        assert list(answer["detail"]) == [field]
    assert not Job.objects.exists()


def body_with(**fields):
    return json.dumps({"params": PROMPT, **fields})


BAD_BODIES = [
    # (raw JSON body, the field `detail` must name)
    pytest.param("{}", "params", id="no params"),
    pytest.param('{"params": "draw"}', "params", id="params a string"),
    pytest.param('{"params": [1, 2]}', "params", id="params a list"),
    pytest.param('{"params": null}', "params", id="params null"),
    pytest.param(body_with(priority=10), "priority", id="priority 10"),
    pytest.param(body_with(priority=-1), "priority", id="priority -1"),
    pytest.param(body_with(priority="high"), "priority", id="priority a word"),
    pytest.param(body_with(priority=1.5), "priority", id="priority a fraction"),
    pytest.param(body_with(priority=True), "priority", id="priority a boolean"),
    pytest.param(body_with(priority=None), "priority", id="priority null"),
    pytest.param(body_with(priority=10**30), "priority", id="priority huge"),
    pytest.param(body_with(tier="ultra"), "tier", id="tier outside the three"),
    pytest.param(body_with(tier="Draft"), "tier", id="tier in capitals"),
    pytest.param(body_with(tier=""), "tier", id="tier empty"),
    pytest.param(body_with(tier=["draft"]), "tier", id="tier a list"),
    pytest.param(body_with(capabilities="txt2img"), "capabilities", id="capabilities a string"),
    pytest.param(body_with(capabilities=["realtime"]), "capabilities", id="capability realtime"),
    pytest.param(body_with(capabilities=[1]), "capabilities", id="capability a number"),
    pytest.param(body_with(capabilities={"txt2img": True}), "capabilities", id="capabilities an object"),
    pytest.param(body_with(model_id=["draft-a"]), "model_id", id="model_id a list"),
    pytest.param(body_with(model_id={"id": "draft-a"}), "model_id", id="model_id an object"),
    pytest.param(body_with(model_id=""), "model_id", id="model_id empty"),
    pytest.param(body_with(model_id="m" * 201), "model_id", id="model_id too long"),
    pytest.param(body_with(model_id="draft\u0000a"), "model_id", id="model_id with a NUL"),
    pytest.param(body_with(modelid="draft-a"), "modelid", id="unknown field"),
    pytest.param(body_with(state="succeeded"), "state", id="a read-only field"),
    pytest.param(body_with(attempts=0, worker_id="w"), "attempts", id="two unknown fields"),
    pytest.param(json.dumps([{"params": PROMPT}]), "non_field_errors", id="a JSON list body"),
    pytest.param('"draw me a cat"', "non_field_errors", id="a JSON string body"),
    pytest.param("42", "non_field_errors", id="a JSON number body"),
    pytest.param("null", "non_field_errors", id="a JSON null body"),
    pytest.param("true", "non_field_errors", id="a JSON boolean body"),
    pytest.param('{"params": ', "non_field_errors", id="malformed JSON"),
    pytest.param("{'params': {}}", "non_field_errors", id="single quotes"),
    pytest.param('{"params": {"prompt": "x", "seed": NaN}}', "non_field_errors", id="NaN"),
    pytest.param('{"params": {"prompt": "x"}, "priority": Infinity}', "non_field_errors", id="Infinity"),
    pytest.param("\xff\xfe{", "non_field_errors", id="not UTF-8"),
    pytest.param('{"params": {"prompt": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}}", "non_field_errors",
                 id="nested past the recursion limit"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_it_answers_a_bad_body_with_invalid_request_never_a_500(models, alice, body, field):
    client = api_client(alice, raise_request_exception=False)

    response = client.post("/api/v1/jobs/", body.encode("latin-1") if body.startswith("\xff") else body,
                           content_type="application/json")

    assert response.status_code == 400, (response.status_code, response.content[:300])
    answer = response.json()
    assert answer["error"] == "invalid_request"
    assert isinstance(answer["detail"], dict), answer
    assert field in answer["detail"], answer
    assert not Job.objects.exists()


HOSTILE_PARAMS = [
    # Well-formed JSON whose values a database or the JSON renderer may choke on.
    pytest.param({"prompt": "x", "guidance": 1e999}, id="a number too big for a float (inf)"),
    pytest.param({"prompt": "nul \u0000 inside"}, id="a NUL character"),
    pytest.param({"prompt": "lone \ud800 surrogate"}, id="a lone surrogate"),
    pytest.param({"prompt": "x", "seed": 10**40}, id="a huge integer"),
    pytest.param({"prompt": "x" * 1001}, id="over the schema's maxLength"),
]


@pytest.mark.parametrize("params", HOSTILE_PARAMS)
def test_it_never_answers_hostile_params_with_a_500(models, alice, params, django_capture_on_commit_callbacks):
    client = api_client(alice, raise_request_exception=False)
    body = json.dumps({"params": params}, allow_nan=True).replace("Infinity", "1e999")

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post("/api/v1/jobs/", body, content_type="application/json")

    assert response.status_code in (201, 400), (response.status_code, response.content[:300])
    if response.status_code == 201:
        job_id = response.json()["id"]
        again = client.get(f"/api/v1/jobs/{job_id}/")
        assert again.status_code == 200
        assert client.get("/api/v1/jobs/").status_code == 200
    else:
        assert response.json()["error"] in ("invalid_request", "invalid_params", "no_matching_model")


def test_it_answers_a_form_body_without_a_500(models, alice):
    client = api_client(alice, raise_request_exception=False)

    response = client.post("/api/v1/jobs/", {"params": "prompt"})

    assert response.status_code == 400
    assert response.json()["error"] in ("invalid_request", "no_matching_model")


# --- reading ------------------------------------------------------------------------------------

def test_it_shows_an_account_its_own_job(models, alice, job_of):
    job = job_of(alice, priority=3)

    response = get(alice, f"/api/v1/jobs/{job['id']}/")

    assert response.status_code == 200
    assert response.json() == {**job, "position": 1}


@pytest.mark.parametrize("job_id", ["not-a-uuid", "123", "00000000-0000-0000-0000-00000000000g",
                                    str(uuid.uuid4()), uuid.uuid4().hex])
def test_it_answers_404_for_a_malformed_or_unknown_id(models, alice, job_of, job_id):
    job_of(alice)
    client = api_client(alice, raise_request_exception=False)

    assert client.get(f"/api/v1/jobs/{job_id}/").status_code == 404
    assert client.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 404
    assert client.get(f"/api/v1/jobs/{job_id}/images/0/").status_code == 404


def test_it_hides_alices_job_from_bob(models, alice, bob, job_of):
    job = job_of(alice)

    assert get(bob, f"/api/v1/jobs/{job['id']}/").status_code == 404
    assert get(bob, f"/api/v1/jobs/{job['id']}/images/0/").status_code == 404
    assert get(bob, "/api/v1/jobs/").json()["count"] == 0


def test_it_lists_an_accounts_jobs_newest_first_in_drf_pages(models, alice, bob, job_of):
    ids = [job_of(alice, params={"prompt": f"job {n}"})["id"] for n in range(3)]
    job_of(bob)

    body = get(alice, "/api/v1/jobs/").json()

    assert set(body) == {"count", "next", "previous", "results"}
    assert body["count"] == 3 and body["next"] is None and body["previous"] is None
    assert [job["id"] for job in body["results"]] == ids[::-1]
    assert [job["position"] for job in body["results"]] == [4, 3, 1]  # bob's job takes the second turn


def test_it_pages_a_long_list(models, alice):
    now = timezone.now()
    Job.objects.bulk_create([Job(account=alice, model_id="draft-a", params=PROMPT, created_at=now,
                                 submitted_us=services.to_microseconds(now) + n) for n in range(51)])

    first = get(alice, "/api/v1/jobs/").json()
    second = get(alice, "/api/v1/jobs/", page=2).json()

    assert first["count"] == 51 and len(first["results"]) == 50
    assert first["next"].endswith("/api/v1/jobs/?page=2")
    assert len(second["results"]) == 1 and second["next"] is None and second["previous"]
    assert get(alice, "/api/v1/jobs/", page=3).status_code == 404


def test_it_filters_the_list_by_state(models, alice, job_of):
    queued, cancelled = job_of(alice)["id"], job_of(alice)["id"]
    api_client(alice).post(f"/api/v1/jobs/{cancelled}/cancel/")

    def listed(state):
        return [job["id"] for job in get(alice, "/api/v1/jobs/", state=state).json()["results"]]

    assert listed("queued") == [queued]
    assert listed("cancelled") == [cancelled]
    assert listed("succeeded") == []


@pytest.mark.parametrize("state", ["bogus", "QUEUED", "", "queued,running"])
def test_it_refuses_a_bad_state_filter(models, alice, state):
    response = api_client(alice).get(f"/api/v1/jobs/?state={state}")

    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"
    assert "state" in response.json()["detail"]


def test_it_answers_404_for_an_image_a_job_does_not_have(models, alice, job_of):
    job = job_of(alice)

    assert get(alice, f"/api/v1/jobs/{job['id']}/images/0/").status_code == 404


@pytest.mark.parametrize("index", ["9" * 5000, "0" * 5000, "1" + "0" * 18, "4294967296"])
def test_it_answers_404_not_500_for_a_huge_image_index(models, alice, job_of, index):
    job = job_of(alice)
    Job.objects.filter(id=job["id"]).update(state="succeeded", images=["jobs/x/0.png"])
    client = api_client(alice, raise_request_exception=False)

    assert client.get(f"/api/v1/jobs/{job['id']}/images/{index}/").status_code == 404


# --- cancelling ---------------------------------------------------------------------------------

def test_it_cancels_a_queued_job(models, alice, job_of):
    job = job_of(alice)

    response = api_client(alice).post(f"/api/v1/jobs/{job['id']}/cancel/")

    assert response.status_code == 200
    body = response.json()
    assert body["id"] == job["id"] and body["state"] == "cancelled"
    assert body["position"] is None and body["finished_at"]
    assert Job.objects.get(id=job["id"]).state == JobState.CANCELLED


def test_it_answers_409_when_the_job_already_ended(models, alice, job_of):
    cancelled, succeeded, failed = job_of(alice)["id"], job_of(alice)["id"], job_of(alice)["id"]
    api_client(alice).post(f"/api/v1/jobs/{cancelled}/cancel/")
    Job.objects.filter(id=succeeded).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    Job.objects.filter(id=failed).update(state=JobState.FAILED, error="boom", finished_at=timezone.now())

    for job_id, state in [(cancelled, "cancelled"), (succeeded, "succeeded"), (failed, "failed")]:
        response = api_client(alice).post(f"/api/v1/jobs/{job_id}/cancel/")
        assert response.status_code == 409, job_id
        assert response.json()["error"] == "job_already_ended"
        assert Job.objects.get(id=job_id).state == state


def test_it_does_not_let_bob_cancel_alices_job(models, alice, bob, job_of):
    job = job_of(alice)

    response = api_client(bob).post(f"/api/v1/jobs/{job['id']}/cancel/")

    assert response.status_code == 404
    assert Job.objects.get(id=job["id"]).state == JobState.QUEUED


def test_it_closes_the_gap_a_cancelled_job_leaves_in_the_queue(models, alice, job_of):
    ids = [job_of(alice)["id"] for _ in range(3)]

    api_client(alice).post(f"/api/v1/jobs/{ids[0]}/cancel/")

    assert [get(alice, f"/api/v1/jobs/{job_id}/").json()["position"] for job_id in ids] == [None, 1, 2]


# --- positions ----------------------------------------------------------------------------------

def test_it_places_queued_jobs_by_turns_between_accounts_then_each_accounts_priority(models, alice, bob, job_of):
    submitted = [("a-low", alice, 0), ("b-mid", bob, 5), ("a-low-2", alice, 0), ("b-top", bob, 9),
                 ("a-mid", alice, 5)]
    ids = {name: job_of(account, priority=priority)["id"] for name, account, priority in submitted}
    other_model = job_of(alice, model_id="standard-sd", priority=0)["id"]

    def position(name_or_id, account):
        job_id = ids.get(name_or_id, name_or_id)
        return get(account, f"/api/v1/jobs/{job_id}/").json()["position"]

    # alice's oldest job gives her the first turn: a-mid, b-top, a-low, b-mid, a-low-2
    assert [position(name, account) for name, account, _ in submitted] == [3, 4, 5, 2, 1]
    assert position(other_model, alice) == 1


def test_an_account_at_its_job_limit_is_refused_until_one_ends(settings, models, alice, bob, submit, job_of):
    settings.ACCOUNT_JOB_LIMIT = 2
    first = job_of(alice)
    job_of(alice)

    refused = submit(alice, {"params": PROMPT})
    assert refused.status_code == 429
    assert refused.json()["error"] == "too_many_jobs" and "ACCOUNT_JOB_LIMIT" in refused.json()["detail"]
    assert get(alice, "/api/v1/jobs/").json()["count"] == 2  # nothing was created
    assert submit(bob, {"params": PROMPT}).status_code == 201  # another account's limit is its own

    assert api_client(alice).post(f"/api/v1/jobs/{first['id']}/cancel/").status_code == 200
    assert submit(alice, {"params": PROMPT}).status_code == 201  # an ended job no longer counts


def test_it_shows_no_position_once_a_job_left_the_queue(models, alice, job_of):
    job_id = job_of(alice)["id"]
    Job.objects.filter(id=job_id).update(state=JobState.DISPATCHED, worker_id="host-a:0")

    assert get(alice, f"/api/v1/jobs/{job_id}/").json()["position"] is None


# --- authentication, staff, schema --------------------------------------------------------------

ENDPOINTS = [("get", "/api/v1/jobs/"), ("post", "/api/v1/jobs/"), ("get", "/api/v1/jobs/{id}/"),
             ("post", "/api/v1/jobs/{id}/cancel/"), ("get", "/api/v1/jobs/{id}/images/0/"),
             ("get", "/api/v1/models/"), ("get", "/api/v1/queues/")]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("token", [None, "not-a-token", ""])
def test_it_wants_a_valid_token(models, alice, job_of, method, path, token):
    job = job_of(alice)
    client = api_client()
    if token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")

    response = getattr(client, method)(path.format(id=job["id"]), {"params": PROMPT}
                                       if method == "post" else None, format="json")

    assert response.status_code == 401
    assert Job.objects.count() == 1
    assert Job.objects.get().state == JobState.QUEUED


def test_it_shows_the_queues_to_staff_only(models, alice, make_account, job_of):
    root = make_account("root", staff=True)
    job_of(alice)
    job_of(alice)
    job_of(alice, model_id="standard-sd")

    assert api_client(alice).get("/api/v1/queues/").status_code == 403
    response = api_client(root).get("/api/v1/queues/")

    assert response.status_code == 200
    body = response.json()
    assert body["jobs"] == [{"model_id": "draft-a", "queued": 2}, {"model_id": "standard-sd", "queued": 1}]
    assert body["sessions"] == [] and body["workers"] == []


def test_it_serves_the_openapi_schema(alice):
    response = api_client().get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")

    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["openapi"].startswith("3.")
    assert {"/api/v1/jobs/", "/api/v1/jobs/{id}/", "/api/v1/jobs/{id}/cancel/", "/api/v1/models/"} <= set(
        schema["paths"])
