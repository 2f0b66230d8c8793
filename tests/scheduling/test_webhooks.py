"""Webhooks end to end on this machine: a real HTTP receiver on loopback, deliveries signed and
verified as a receiver would (the standardwebhooks library), retries with backoff on the injected
clock, the SSRF and port refusals, each account's lookups, errors in our words, and the secret."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from django.utils import timezone
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from potocolom.runtime import runtime
from scheduling import services
from scheduling.models import Job, JobState, WebhookDelivery
from scheduling.webhooks.delivery import (
    lease_seconds,
    webhook_attempt_prepare,
    webhook_attempt_send,
    webhooks_deliver,
)
from scheduling.webhooks.resolving import (
    LOOKUPS,
    MAX_LOOKUPS_IN_FLIGHT,
    WebhookLookupsThrottled,
    WebhookRefused,
    resolve_within,
)
from scheduling.webhooks.services import webhook_deliveries_claim, webhook_deliveries_due
from tests.helpers import api_client, register_model
from tests.support.webhook_receiver import Banner, Receiver

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
                                 "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/",
                                 # the special-purpose blocks that are not globally reachable
                                 "http://192.0.0.8/hook", "http://198.18.0.1/hook", "http://[fec0::1]/hook",
                                 "http://192.88.99.1/", "http://100.64.0.1/", "http://[2001:db8::1]/",
                                 "http://[64:ff9b:1::1]/", "http://[2002:7f00:1::]/", "http://[5f00::1]/",
                                 "http://[3fff::1]/", "http://240.0.0.1/", "http://255.255.255.255/",
                                 # every spelling of an address
                                 "http://167772161/hook", "http://0177.0.0.1/", "http://0x7f.1/",
                                 "http://127.1/", "http://[::ffff:7f00:1]/", "http://[::127.0.0.1]/"])
def test_a_url_whose_host_is_not_globally_reachable_is_refused_at_submission(
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
                                           ("http://user:pw@hooks.example.com/", "user name or password"),
                                           ("http://[fe80::1%25eth0]/", "zone id"),
                                           ("http://08.0.0.1/", "not a valid IPv4 address")])
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


def test_a_public_host_may_use_ports_80_and_443_and_those_of_webhook_ports_only(
        model, alice, settings, django_capture_on_commit_callbacks):
    looked_up: list[str] = []
    settings.WEBHOOK_RESOLVER = lambda host, port: looked_up.append(host) or ["93.184.216.34"]
    for url in ("https://hooks.example:8443/", "http://hooks.example:22/", "http://93.184.216.34:6379/"):
        response = submit(alice, {"params": PROMPT, "webhook_url": url}, django_capture_on_commit_callbacks)
        assert response.status_code == 400, url
        assert response.json()["error"] == "invalid_request"
        assert "may not use port" in response.json()["detail"]["webhook_url"][0]
    assert looked_up == []  # refused before any lookup
    for url in ("https://hooks.example/", "http://hooks.example:80/", "https://hooks.example:443/"):
        response = submit(alice, {"params": PROMPT, "webhook_url": url}, django_capture_on_commit_callbacks)
        assert response.status_code == 201, url
    settings.WEBHOOK_PORTS = [8443]
    response = submit(alice, {"params": PROMPT, "webhook_url": "https://hooks.example:8443/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 201


# --- lookups: each account's own -----------------------------------------------------------------

@pytest.fixture
def slow_hosts(settings):
    """A resolver under which every host named slow... hangs until released (then, like any other
    host, resolves to a public address)."""
    release = threading.Event()

    def resolve(host: str, port: int) -> list[str]:
        if host.startswith("slow"):
            release.wait(30)
        return ["93.184.216.34"]

    settings.WEBHOOK_RESOLVER = resolve
    yield resolve
    release.set()
    assert runtime.get(LOOKUPS).wait_at_most(0, timeout=30)


def hang_lookups(resolve, account_id: int, count: int) -> tuple[int, int]:
    """Start `count` lookups of slow hosts for the account (each given up on at once); how many
    were given up on (their threads go on) and how many were throttled."""
    given_up = throttled = 0
    for n in range(count):
        try:
            resolve_within(f"slow{n}.example", 443, resolve=resolve, account_id=account_id, seconds=0.001)
        except WebhookRefused:
            given_up += 1
        except WebhookLookupsThrottled:
            throttled += 1
    return given_up, throttled


def test_forty_slow_hosts_of_alice_hold_four_lookups_and_never_bobs(
        model, alice, bob, slow_hosts, django_capture_on_commit_callbacks):
    assert hang_lookups(slow_hosts, alice.id, 40) == (4, 36)
    assert runtime.get(LOOKUPS).under_way(alice.id) == 4

    response = submit(alice, {"params": PROMPT, "webhook_url": "https://hooks.example/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 429
    assert response.json()["error"] == "throttled" and response["Retry-After"] == "2"
    response = submit(bob, {"params": PROMPT, "webhook_url": "https://hooks.example/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 201, response.content


def test_an_accounts_lookups_count_until_their_threads_end_then_it_may_look_up_again(
        model, alice, settings, django_capture_on_commit_callbacks):
    release = threading.Event()

    def resolve(host: str, port: int) -> list[str]:
        if host.startswith("slow"):
            release.wait(30)
        return ["93.184.216.34"]

    settings.WEBHOOK_RESOLVER = resolve
    assert hang_lookups(resolve, alice.id, 5) == (4, 1)
    release.set()
    assert runtime.get(LOOKUPS).wait_at_most(0, account_id=alice.id, timeout=30)
    response = submit(alice, {"params": PROMPT, "webhook_url": "https://hooks.example/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 201


def test_when_every_lookup_thread_of_the_process_is_stuck_a_submission_answers_503_not_400(
        model, bob, slow_hosts, django_capture_on_commit_callbacks):
    for account_id in range(1000, 1000 + MAX_LOOKUPS_IN_FLIGHT // 4):  # other accounts, 4 each
        assert hang_lookups(slow_hosts, account_id, 4) == (4, 0)
    response = submit(bob, {"params": PROMPT, "webhook_url": "https://hooks.example/"},
                      django_capture_on_commit_callbacks)
    assert response.status_code == 503  # the process is short of lookups: bob's URL is not at fault
    assert response.json()["error"] == "unavailable" and response["Retry-After"] == "2"
    assert not Job.objects.exists()


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
    assert [attempt["error"] for attempt in webhook["attempts"]] == ["status 500", "status 503", None]
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
    assert attempt["status_code"] is None and attempt["error"] == "connection_refused"


def test_a_receiver_that_answers_no_http_is_a_bad_response_and_none_of_its_bytes_are_kept(
        private_allowed, alice, job_with_webhook):
    ssh = Banner(b"SSH-2.0-OpenSSH_9.6 secret-of-the-receiver\r\n")
    try:
        job_id = job_with_webhook(alice, f"http://127.0.0.1:{ssh.port}/")
        cancel(alice, job_id)
        webhooks_deliver(now=timezone.now())
    finally:
        ssh.close()
    webhook = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]
    [attempt] = webhook["attempts"]
    assert attempt["status_code"] is None and attempt["error"] == "bad_response"
    assert "SSH" not in json.dumps(webhook) and "secret-of-the-receiver" not in json.dumps(webhook)


def test_a_2xx_lost_before_its_record_is_sent_once_more_with_the_same_webhook_id_then_never(
        private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    cancel(alice, job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/"))
    now = timezone.now()
    [delivery] = webhook_deliveries_claim(due=webhook_deliveries_due(now=now, per_account=2, limit=10), now=now,
                                          lease_seconds=lease_seconds())
    sent = webhook_attempt_send(webhook_attempt_prepare(delivery=delivery, now=now))
    assert sent.status_code == 200  # ... and the database fails before it is recorded
    assert webhooks_deliver(now=now + timedelta(seconds=lease_seconds() - 1)) == 0  # still claimed
    later = now + timedelta(seconds=lease_seconds() + 1)
    assert webhooks_deliver(now=later) == 1  # the claim lapsed: once more
    assert webhooks_deliver(now=later + timedelta(hours=1)) == 0  # its 2xx recorded: never again
    first, second = hook.requests
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
    assert first["body"] == second["body"]
    assert WebhookDelivery.objects.get().state == "delivered"


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
    settings.WEBHOOK_PORTS = [hook.port]
    job_id = job_with_webhook(alice, f"http://hooks.example:{hook.port}/")
    answers["hooks.example"] = ["93.184.216.34", "127.0.0.1"]  # ... rebound to loopback by delivery time
    cancel(alice, job_id)
    start = timezone.now()
    for seconds in (0, 1, 3):
        webhooks_deliver(now=start + timedelta(seconds=seconds))
    assert hook.requests == []
    attempts = api_client(alice).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]["attempts"]
    assert len(attempts) == 3
    assert all(a["status_code"] is None and a["error"].startswith("refused: ")
               and "127.0.0.1 is a loopback address" in a["error"] for a in attempts)


def test_a_due_delivery_is_claimed_by_one_process_only(private_allowed, alice, receiver, job_with_webhook):
    hook = receiver()
    cancel(alice, job_with_webhook(alice, f"http://127.0.0.1:{hook.port}/"))
    now = timezone.now()
    due = webhook_deliveries_due(now=now, per_account=2, limit=10)
    assert len(webhook_deliveries_claim(due=due, now=now, lease_seconds=60)) == 1
    assert webhook_deliveries_claim(due=due, now=now, lease_seconds=60) == []  # another process: nothing
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
            resolve_within("slow.example", 443, resolve=hanging, account_id=1, seconds=0.05)
    finally:
        release.set()
