"""REST limits on jobs: the submission rate, init_image checks and the representation that never
carries an image, size caps for open schemas, and HTTPS image URLs."""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from scheduling.images import init_image_text
from scheduling.models import Job
from tests.helpers import api_client, register_model, tiny_png

pytestmark = pytest.mark.django_db

PROMPT = {"prompt": "a red circle"}


@pytest.fixture
def models(db):
    register_model("draft-a", cost=1.0)


@pytest.fixture
def submit(django_capture_on_commit_callbacks):
    def submit(account, body, **extra):
        with django_capture_on_commit_callbacks(execute=True):
            return api_client(account).post("/api/v1/jobs/", body, format="json", **extra)

    return submit


def image_of(kind: str, width: int = 8, height: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format=kind)
    return out.getvalue()


# --- JOB_SUBMIT_RATE --------------------------------------------------------------------------

def test_submissions_over_the_rate_answer_429_with_retry_after(models, alice, bob, submit, settings):
    settings.JOB_SUBMIT_RATE = "3/minute"

    answers = [submit(alice, {"params": PROMPT}) for _ in range(4)]

    assert [a.status_code for a in answers] == [201, 201, 201, 429]
    refused = answers[-1]
    assert refused.json()["error"] == "throttled" and refused.json()["detail"]
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert Job.objects.filter(account=alice).count() == 3
    # per account, and only submission: bob submits, alice still reads and cancels
    assert submit(bob, {"params": PROMPT}).status_code == 201
    job_id = answers[0].json()["id"]
    assert api_client(alice).get("/api/v1/jobs/").status_code == 200
    assert api_client(alice).post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 200


def test_the_rate_is_the_setting_s_default(models, alice, submit, settings):
    from scheduling.throttles import JobSubmitThrottle

    assert settings.JOB_SUBMIT_RATE == "600/minute"
    assert JobSubmitThrottle().parse_rate(JobSubmitThrottle().get_rate()) == (600, 60)


# --- init_image -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("as_data_url", [False, True])
def test_an_accepted_init_image_is_kept_as_sent_and_shown_as_a_url(models, alice, submit, kind, as_data_url):
    data = image_of(kind)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[kind]
    sent = (f"data:{mime};base64," if as_data_url else "") + base64.b64encode(data).decode()

    answer = submit(alice, {"params": {**PROMPT, "init_image": sent}})

    assert answer.status_code == 201, answer.json()
    job = Job.objects.get()
    assert "init_image" not in job.params and init_image_text(job.init_image) == sent  # in the storage, as sent
    url = f"http://testserver/api/v1/jobs/{job.id}/init_image/"
    assert answer.json()["params"] == {**PROMPT, "init_image": url}
    assert api_client(alice).get(f"/api/v1/jobs/{job.id}/").json()["params"]["init_image"] == url
    served = api_client(alice).get(url)
    assert served.status_code == 200 and served["Content-Type"] == mime and served.content == data


def test_another_account_cannot_read_the_init_image(models, alice, bob, submit):
    job_id = submit(alice, {"params": {**PROMPT, "init_image": base64.b64encode(tiny_png()).decode()}}).json()["id"]

    assert api_client(bob).get(f"/api/v1/jobs/{job_id}/init_image/").status_code == 404
    assert api_client(None).get(f"/api/v1/jobs/{job_id}/init_image/").status_code in (401, 403)


def test_a_job_without_init_image_has_none_to_serve(models, alice, submit):
    job_id = submit(alice, {"params": PROMPT}).json()["id"]

    assert api_client(alice).get(f"/api/v1/jobs/{job_id}/init_image/").status_code == 404


def gif() -> str:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="GIF")
    return base64.b64encode(out.getvalue()).decode()


def bomb_png(width: int, height: int) -> str:
    """A PNG header declaring width x height (the pixels themselves are never decoded)."""
    return base64.b64encode(tiny_png(width, height)).decode()


@pytest.mark.parametrize(("value", "says"), [
    pytest.param(gif(), "PNG, JPEG or WebP", id="a GIF"),
    pytest.param(base64.b64encode(b"not an image at all").decode(), "PNG, JPEG or WebP", id="not an image"),
    pytest.param("%%% not base64 %%%", "base64", id="not base64"),
    pytest.param("data:image/png,rawbytes", "base64", id="a data: URL that is not base64"),
    pytest.param(None, "base64", id="null"),
    pytest.param(12, "base64", id="a number"),
    pytest.param(bomb_png(2049, 2049), "pixels", id="more pixels than MAX_IMAGE_PIXELS"),
])
def test_a_refused_init_image_answers_400_invalid_params(models, alice, submit, value, says):
    answer = submit(alice, {"params": {**PROMPT, "init_image": value}})

    assert answer.status_code == 400
    body = answer.json()
    assert body["error"] == "invalid_params"
    assert list(body["detail"]) == ["params"] and list(body["detail"]["params"]) == ["init_image"]
    assert says in body["detail"]["params"]["init_image"][0]
    assert not Job.objects.exists()


def test_the_pixel_cap_is_the_setting(models, alice, submit, settings):
    settings.MAX_IMAGE_PIXELS = 64 * 64
    assert submit(alice, {"params": {**PROMPT, "init_image": bomb_png(64, 64)}}).status_code == 201
    assert submit(alice, {"params": {**PROMPT, "init_image": bomb_png(65, 64)}}).status_code == 400


def test_no_job_row_holds_an_image_so_no_query_reads_one(models, alice, submit):
    big = base64.b64encode(image_of("PNG", 512, 512)).decode()
    for _ in range(3):
        submit(alice, {"params": {**PROMPT, "init_image": big}})
    submit(alice, {"params": {**PROMPT, "steps": 7, "width": 128}})

    page = api_client(alice).get("/api/v1/jobs/")

    assert page.status_code == 200
    listed = page.json()["results"]
    assert sorted(str(job["params"].get("init_image", ""))[-12:] for job in listed) == [
        "", "/init_image/", "/init_image/", "/init_image/"]
    assert all(job["params"]["prompt"] == PROMPT["prompt"] for job in listed)
    assert big not in page.content.decode()
    rows = list(Job.objects.values("params", "init_image", "steps", "width", "height"))
    assert all("init_image" not in row["params"] for row in rows)  # whatever a query reads, no image
    assert sorted(bool(row["init_image"]) for row in rows) == [False, True, True, True]
    assert sorted((row["steps"] or 0, row["width"] or 0, row["height"]) for row in rows) == [
        (0, 0, None), (0, 0, None), (0, 0, None), (7, 128, None)]  # what the queue's queries read


# --- MAX_IMAGE_SIDE / MAX_STEPS for a schema without a maximum ---------------------------------

OPEN = {"type": "object", "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}, "width": {"type": "integer"}, "height": {"type": "integer"},
                       "steps": {"type": "integer"}}}


@pytest.mark.parametrize(("params", "status"), [
    ({"width": 2048, "height": 2048, "steps": 150}, 201),
    ({"width": 2056}, 400),
    ({"height": 4096}, 400),
    ({"steps": 151}, 400),
])
def test_an_open_schema_gets_the_size_and_steps_caps(alice, submit, params, status):
    register_model("open-sd", params_schema=OPEN)

    answer = submit(alice, {"model_id": "open-sd", "params": {**PROMPT, **params}})

    assert answer.status_code == status
    if status == 400:
        assert answer.json()["error"] == "invalid_params"
        assert any(m.startswith(f"{next(iter(params))}:") for m in answer.json()["detail"]["params"])


def test_the_caps_are_the_settings(alice, submit, settings):
    register_model("open-sd", params_schema=OPEN)
    settings.MAX_IMAGE_SIDE, settings.MAX_STEPS = 512, 10

    assert submit(alice, {"model_id": "open-sd", "params": {**PROMPT, "width": 513}}).status_code == 400
    assert submit(alice, {"model_id": "open-sd", "params": {**PROMPT, "steps": 11}}).status_code == 400
    assert submit(alice, {"model_id": "open-sd", "params": {**PROMPT, "width": 512, "steps": 10}}).status_code == 201


def test_without_model_id_the_refusal_names_each_candidate_s_problems(alice, submit):
    register_model("open-sd", params_schema=OPEN)
    register_model("draft-a", cost=2.0)  # widths from a list up to 512
    register_model("big-xl", tier="premium", params_schema=OPEN)

    answer = submit(alice, {"tier": "draft", "params": {**PROMPT, "width": 4096}})

    assert answer.status_code == 400
    body = answer.json()
    assert body["error"] == "no_matching_model"
    assert body["detail"]["message"]
    assert set(body["detail"]["candidates"]) == {"open-sd", "draft-a"}
    assert body["detail"]["candidates"]["open-sd"] == {"width": ["4096 is greater than the maximum of 2048"]}
    assert list(body["detail"]["candidates"]["draft-a"]) == ["width"]


# --- HTTPS ------------------------------------------------------------------------------------

def test_behind_https_the_urls_of_a_job_are_https(models, alice, submit, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_SSL_REDIRECT = True
    png = base64.b64encode(tiny_png()).decode()

    # as a TLS proxy passes it on: the client's Host, and the scheme it was reached by
    answer = submit(alice, {"params": {**PROMPT, "init_image": png}}, HTTP_HOST="localhost",
                    HTTP_X_FORWARDED_PROTO="https")

    assert answer.status_code == 201
    assert answer.json()["params"]["init_image"].startswith("https://localhost/api/v1/jobs/")
    assert submit(alice, {"params": PROMPT}).status_code == 301  # plain http is sent to https
