"""The webhook delivery thread (scheduling/webhooks/runner.py) with real receivers on loopback: each
delivery runs on its own, so an account whose receiver hangs holds WEBHOOK_CONCURRENCY of its own
deliveries and none of another account's; an attempt whose record fails is attempted again later."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from scheduling.models import WebhookDelivery
from scheduling.signals import webhook_due
from scheduling.webhooks.delivery import lease_seconds, webhook_attempt_record
from scheduling.webhooks.runner import WebhookRunner
from tests.helpers import api_client, register_model
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.django_db(transaction=True)  # the runner's thread reads what the test wrote


@pytest.fixture
def webhooks(settings, db):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    settings.WEBHOOK_TIMEOUT_SECONDS = 60.0  # a hanging receiver hangs for the whole test
    settings.WEBHOOK_CONCURRENCY = 2
    register_model("draft-a", cost=1.0)


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kwargs) -> Receiver:
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def runner():
    made: list[WebhookRunner] = []

    def start(**kwargs) -> WebhookRunner:
        made.append(WebhookRunner(**kwargs))
        made[-1].start()
        return made[-1]

    yield start
    for each in made:
        each.stop()


class Records:
    """The runner's `record`: the real one, noting whose attempt it recorded (and failing the first
    `failures` records, as a database that went away would)."""

    def __init__(self, *, failures: int = 0) -> None:
        self.failures = failures
        self.accounts: list[str] = []
        self.changed = threading.Condition()

    def __call__(self, *, delivery: WebhookDelivery, **kwargs: object) -> None:
        try:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("the database is away")
            webhook_attempt_record(delivery=delivery, **kwargs)  # type: ignore[arg-type]
        finally:
            with self.changed:
                self.accounts.append(delivery.job.account.username)
                self.changed.notify_all()

    def wait_for(self, predicate: Callable[[list[str]], bool]) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self.accounts), timeout=30)


def ended_with_webhook(account, url: str) -> str:
    """A job of the account submitted with this webhook_url and cancelled: its delivery is due."""
    response = api_client(account).post("/api/v1/jobs/", {"params": {"prompt": "x"}, "webhook_url": url},
                                        format="json")
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    assert api_client(account).post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 200
    return job_id


def webhook_of(account, job_id: str) -> dict:
    return api_client(account).get(f"/api/v1/jobs/{job_id}/").json()["webhook"]


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_alices_hanging_receiver_holds_two_of_her_deliveries_and_none_of_bobs(webhooks, alice, bob, receiver,
                                                                               runner):
    release = threading.Event()
    alices, bobs = receiver(hold=release), receiver()
    alice_jobs = [ended_with_webhook(alice, f"http://127.0.0.1:{alices.port}/") for _ in range(5)]
    clock = Clock(timezone.now())
    bob_job = ended_with_webhook(bob, f"http://127.0.0.1:{bobs.port}/")  # due later than clock.now
    records = Records()
    runner(clock=clock, record=records)
    alices.wait_for(2, timeout=30)  # two of hers under way, hanging
    assert bobs.requests == []

    clock.now = timezone.now()  # bob's falls due (written earlier: this test writes nothing while the runner runs)
    asked = time.monotonic()
    webhook_due.send(sender=WebhookDelivery)
    bobs.wait_for(1, timeout=30)
    assert time.monotonic() - asked < 2.0  # the contract's bound on the delay alice's receiver causes bob
    assert records.wait_for(lambda accounts: "bob" in accounts)
    assert webhook_of(bob, bob_job)["state"] == "delivered"
    assert len(alices.requests) == 2 and "alice" not in records.accounts  # hers still hang, no third began

    release.set()
    alices.wait_for(5, timeout=30)
    assert records.wait_for(lambda accounts: accounts.count("alice") == 5)
    assert [webhook_of(alice, job_id)["state"] for job_id in alice_jobs] == ["delivered"] * 5


def test_an_attempt_whose_record_failed_is_attempted_again_once_its_claim_lapses(
        webhooks, alice, receiver, runner, caplog):
    hook = receiver()
    job_id = ended_with_webhook(alice, f"http://127.0.0.1:{hook.port}/")
    clock, records = Clock(timezone.now()), Records(failures=1)
    runner(clock=clock, record=records)
    hook.wait_for(1, timeout=30)  # a 2xx ...
    assert records.wait_for(lambda accounts: len(accounts) == 1)  # ... whose record failed
    assert webhook_of(alice, job_id)["state"] == "pending"

    clock.now += timedelta(seconds=lease_seconds() + 1)  # its claim lapses
    webhook_due.send(sender=WebhookDelivery)
    first, second = hook.wait_for(2, timeout=30)
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
    assert records.wait_for(lambda accounts: len(accounts) == 2)
    assert webhook_of(alice, job_id)["state"] == "delivered"
    assert "webhook delivery failed" in caplog.text
