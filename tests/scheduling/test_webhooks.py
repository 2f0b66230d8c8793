"""Webhooks end to end on this machine: a real HTTP receiver on loopback, deliveries signed and
verified as a receiver would (the standardwebhooks library), retries with backoff on the injected
clock, the SSRF refusals at submission and at delivery, and the account's secret."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from django.utils import timezone
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from scheduling import services
from scheduling.models import Job, JobState, WebhookDelivery
from scheduling.webhooks.delivery import webhooks_deliver
from scheduling.webhooks.resolving import WebhookRefused, resolve_within
from scheduling.webhooks.services import webhook_deliveries_claim
from tests.helpers import api_client, register_model
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db
PROMPT = {"prompt": "a red circle"}


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(statuses: list[int] | None = None, **kwargs) -> Receiver:
        made.append(Receiver(statuses, **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def model(db):
    register_model("draft-a", cost=1.0)


@pytest.fixture
def private_allowed(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True


def submit(account, body, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        return api_client(account).post("/api/v1/jobs/", body, format="json")


@pytest.fixture
def job_with_webhook(model, django_capture_on_commit_callbacks):
    """Submit a job with this webhook_url (201 checked) and return its id."""
    def make(account, url: str) -> str:
        response = submit(account, {"params": PROMPT, "webhook_url": url}, django_capture_on_commit_callbacks)
        assert response.status_code == 201, response.content
        return response.json()["id"]

    return make


def cancel(account, job_id: str) -> dict:
    response = api_client(account).post(f"/api/v1/jobs/{job_id}/cancel/")
    assert response.status_code == 200, response.content
    return response.json()


def secret_of(account) -> str:
    response = api_client(account).get("/api/v1/account/webhook-secret/")
    assert response.status_code == 200
    return response.json()["secret"]


def verified(secret: str, request: dict) -> dict:
    """What a receiver reads once the library verified the delivery (raises when it does not)."""
    return Webhook(secret).verify(request["body"], request["headers"])


# --- submission ---------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/hook", "http://10.0.0.1/",
                                 "http://[::1]:8080/", "http://169.254.169.254/latest/meta-data/",
                                 "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/"])
def test_a_url_whose_host_is_loopback_private_or_link_local_is_refused_at_submission(
        model, alice, url, django_capture_on_commit_callbacks):
    response = submit(alice, {"params": PROMPT, "webhook_url": url}, django_capture_on_commit_callbacks)
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "invalid_request" and list(body["detail"]) == ["webhook_url"]
    assert "address" in body["detail"]["webhook_url"][0]
    assert not Job.objects.exists()


@pytest.mark.parametrize(("url", "says"), [("ftp://hooks.example.com/", "http or https"),
                                           ("http://", "must name a host"),
                                           ("https://hooks.example.com/" + "a" * 2000, "2000"),
                                           ("http://user:pw@hooks.example.com/", "user name or password")])
def test_a_url_that_is_not_an_http_url_of_bounded_length_is_refused_with_its_reason(
        model, alice, url, says, django_capture_on_commit_callbacks):
    response = submit(alice, {"params": PROMPT, "webhook_url": url}, django_capture_on_commit_callbacks)
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"
    assert says in response.json()["detail"]["webhook_url"][0]


def test_a_host_that_does_not_resolve_is_refused(model, alice, settings, django_capture_on_commit_callbacks):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # not even then

    def nowhere(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    settings.WEBHOOK_RESOLVER = nowhere
    response = submit(alice, {"params": PROMPT, "webhook_url": "https://nowhere.example/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 400
    assert response.json()["detail"] == {"webhook_url": ["its host does not resolve"]}


def test_a_job_without_a_webhook_says_null_and_writes_no_delivery(model, alice, django_capture_on_commit_callbacks):
    job = submit(alice, {"params": PROMPT}, django_capture_on_commit_callbacks).json()
    assert job["webhook"] is None
    cancel(alice, job["id"])
    assert not WebhookDelivery.objects.exists()


# --- delivery -----------------------------------------------------------------------------------

def test_the_ended_job_is_posted_signed_once_and_its_receiver_verifies_it(
        private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    job_id = job_with_webhook(alice, f"http://localhost:{hook.port}/hooks/potocolom?from=test")
    assert api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]["state"] == "waiting"
    cancel(alice, job_id)
    assert WebhookDelivery.objects.filter(job_id=job_id, state="pending").count() == 1  # the outbox row

    assert webhooks_deliver(now=timezone.now()) == 1
    [request] = hook.requests
    assert request["path"] == "/hooks/potocolom?from=test"
    assert request["headers"]["Host"] == f"localhost:{hook.port}"  # connected to the address, named by host
    assert request["headers"]["Content-Type"] == "application/json"
    payload = verified(secret_of(alice), request)
    shown = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()
    assert payload == {name: value for name, value in shown.items() if name != "webhook"}
    assert payload["state"] == JobState.CANCELLED
    assert shown["webhook"]["state"] == "delivered"
    assert shown["webhook"]["webhook_id"] == request["headers"]["webhook-id"]
    [attempt] = shown["webhook"]["attempts"]
    assert attempt["status_code"] == 200 and attempt["error"] is None and attempt["duration_ms"] >= 0

    assert webhooks_deliver(now=timezone.now() + timedelta(hours=1)) == 0  # never again after a 2xx
    assert len(hook.requests) == 1


def test_a_failed_job_is_posted_too(private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    Job.objects.filter(id=job_id).update(state=JobState.DISPATCHED, worker_id="host-a:0")
    assert services.job_fail(worker_id="host-a:0", job_id=job_id, error="out of memory", now=timezone.now())
    webhooks_deliver(now=timezone.now())
    payload = verified(secret_of(alice), hook.requests[0])
    assert (payload["state"], payload["error"]) == (JobState.FAILED, "out of memory")


def test_it_retries_with_backoff_until_a_2xx_with_the_same_webhook_id(
        private_allowed, alice, bob, receiver, job_with_webhook):
    hook = receiver([500, 503])
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    cancel(alice, job_id)
    start = timezone.now()
    schedule = [(0.0, 1), (0.9, 0), (1.0, 1), (2.9, 0), (3.0, 1), (100.0, 0)]  # 1 s, then 2 s, then delivered
    for seconds, attempted in schedule:
        assert webhooks_deliver(now=start + timedelta(seconds=seconds)) == attempted, seconds
    assert len(hook.requests) == 3
    secret = secret_of(alice)
    for request in hook.requests:
        verified(secret, request)
    assert len({request["headers"]["webhook-id"] for request in hook.requests}) == 1
    assert [int(request["headers"]["webhook-timestamp"]) for request in hook.requests] == [
        int((start + timedelta(seconds=s)).timestamp()) for s in (0.0, 1.0, 3.0)]
    assert len({request["body"] for request in hook.requests}) == 1  # the same body on every retry

    webhook = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]
    assert webhook["state"] == "delivered"
    assert [attempt["status_code"] for attempt in webhook["attempts"]] == [500, 503, 200]
    listed = api_client(alice).get("/api/v1/jobs/").json()["results"][0]["webhook"]
    assert listed == webhook
    assert api_client(bob).get(f"/api/v1/jobs/{job_id}/").status_code == 404  # the owner's only
    assert api_client(bob).get("/api/v1/jobs/").json()["results"] == []


def test_it_gives_up_after_webhook_attempts(private_allowed, settings, alice, receiver, job_with_webhook):
    settings.WEBHOOK_ATTEMPTS = 3
    hook = receiver([500] * 10)
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    cancel(alice, job_id)
    start = timezone.now()
    for seconds in (0, 1, 3, 7, 15, 60):
        webhooks_deliver(now=start + timedelta(seconds=seconds))
    assert len(hook.requests) == 3
    webhook = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]
    assert webhook["state"] == "failed" and len(webhook["attempts"]) == 3


def test_a_redirect_is_not_followed(private_allowed, alice, receiver, job_with_webhook):
    target = receiver()
    hook = receiver([302], headers={"Location": f"http://127.0.0.1:{target.port}/elsewhere"})
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    cancel(alice, job_id)
    webhooks_deliver(now=timezone.now())
    assert len(hook.requests) == 1 and target.requests == []
    webhook = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]
    assert webhook["state"] == "pending" and webhook["attempts"][0]["status_code"] == 302


def test_an_unreachable_receiver_is_a_failed_attempt_with_its_error(private_allowed, alice, receiver,
                                                                    job_with_webhook):
    hook = receiver()
    port = hook.port
    hook.close()  # nothing listens there any more
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{port}/")
    cancel(alice, job_id)
    webhooks_deliver(now=timezone.now())
    [attempt] = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]["attempts"]
    assert attempt["status_code"] is None and "Connection" in attempt["error"]


def test_it_connects_to_the_address_it_checked_naming_the_host(settings, alice, receiver, job_with_webhook):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    settings.WEBHOOK_RESOLVER = lambda host, port: {"hooks.example": ["127.0.0.1"]}[host]
    hook = receiver()
    job_id = job_with_webhook(alice, f"http://hooks.example:{hook.port}/in")
    cancel(alice, job_id)
    webhooks_deliver(now=timezone.now())
    [request] = hook.requests
    assert request["headers"]["Host"] == f"hooks.example:{hook.port}"
    verified(secret_of(alice), request)


def test_a_host_that_resolves_to_a_private_address_at_delivery_is_never_connected_to(
        settings, alice, receiver, job_with_webhook):
    hook = receiver()  # listening on 127.0.0.1: connecting there would reach it
    answers = {"hooks.example": ["93.184.216.34"]}  # public when submitted ...
    settings.WEBHOOK_RESOLVER = lambda host, port: answers[host]
    job_id = job_with_webhook(alice, f"http://hooks.example:{hook.port}/")
    answers["hooks.example"] = ["93.184.216.34", "127.0.0.1"]  # ... rebound to loopback by delivery time
    cancel(alice, job_id)
    start = timezone.now()
    for seconds in (0, 1, 3):
        webhooks_deliver(now=start + timedelta(seconds=seconds))
    assert hook.requests == []
    attempts = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]["attempts"]
    assert len(attempts) == 3
    assert all(a["status_code"] is None and "127.0.0.1 is a loopback address" in a["error"] for a in attempts)


def test_a_due_delivery_is_claimed_by_one_process_only(private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    cancel(alice, job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/"))
    now = timezone.now()
    assert len(webhook_deliveries_claim(now=now, limit=10, lease_seconds=60)) == 1
    assert webhook_deliveries_claim(now=now, limit=10, lease_seconds=60) == []  # another process: nothing
    assert webhooks_deliver(now=now + timedelta(seconds=30)) == 0  # still claimed
    assert webhooks_deliver(now=now + timedelta(seconds=61)) == 1  # the claim lapsed (its process died)
    assert len(hook.requests) == 1


# --- the account's secret -----------------------------------------------------------------------

def test_the_secret_is_made_on_first_use_and_kept(alice, bob):
    first = secret_of(alice)
    assert first.startswith("whsec_") and secret_of(alice) == first
    assert secret_of(bob) != first
    assert api_client().get("/api/v1/account/webhook-secret/").status_code in (401, 403)


def test_after_rotation_deliveries_verify_with_the_new_secret_only(private_allowed, alice, receiver,
                                                                   job_with_webhook):
    hook = receiver()
    old = secret_of(alice)
    response = api_client(alice).post("/api/v1/account/webhook-secret/")
    assert response.status_code == 200
    new = response.json()["secret"]
    assert new.startswith("whsec_") and new != old and secret_of(alice) == new
    cancel(alice, job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/"))
    webhooks_deliver(now=timezone.now())
    [request] = hook.requests
    verified(new, request)
    with pytest.raises(WebhookVerificationError):
        verified(old, request)
    assert json.loads(request["body"])["state"] == JobState.CANCELLED


def test_a_job_failed_by_its_dead_worker_is_posted_too(private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    job_id = job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    Job.objects.filter(id=job_id).update(state=JobState.RUNNING, worker_id="host-a:0", attempts=2)
    services.jobs_return(job_ids={job_id}, now=timezone.now())  # its second worker died: worker_lost
    assert WebhookDelivery.objects.filter(job_id=job_id).count() == 1
    webhooks_deliver(now=timezone.now())
    payload = verified(secret_of(alice), hook.requests[0])
    assert (payload["state"], payload["error"]) == (JobState.FAILED, "worker_lost")


def test_a_lookup_that_takes_longer_than_its_bound_is_refused():
    release = threading.Event()

    def hanging(host: str, port: int) -> list[str]:
        release.wait(30)
        return ["93.184.216.34"]

    try:
        with pytest.raises(WebhookRefused, match="did not resolve within"):
            resolve_within("slow.example", 443, resolve=hanging, seconds=0.05)
    finally:
        release.set()
