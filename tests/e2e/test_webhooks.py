"""End to end: a job run by a real `runworker_gpu` on the tiny model, its end POSTed by the served
API's own delivery thread to a receiver on loopback, retried after a 500, and verified there with
the standardwebhooks library as any receiver would."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from tests.support.stack import Stack
from tests.support.webhook_receiver import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver([500])  # the first attempt fails: the second, 1 s later, delivers
    yield made
    made.close()


def test_a_finished_job_is_posted_by_the_api_process_and_verifies(tmp_path: Path, receiver: Receiver) -> None:
    with Stack(workdir=tmp_path, WEBHOOK_ALLOW_PRIVATE="true") as stack:
        account_token, worker_token = stack.prepare()
        models_dir = stack.workdir / "models"
        manifest = Path(stack.manage("make_tiny_model", str(models_dir / "tiny")))
        assert stack.manage("load_manifests", str(manifest)) == "loaded 1"
        stack.start_api()
        stack.start_worker(worker_token, models_dir, "--threads", "1")
        http = httpx.Client(base_url=stack.http_url, headers={"Authorization": f"Token {account_token}"},
                            timeout=30, trust_env=False)
        secret = http.get("/api/v1/account/webhook-secret/").json()["secret"]
        submitted = http.post("/api/v1/jobs/", json={
            "model_id": "tiny-sd", "params": {"prompt": "a red circle", "width": 64, "height": 64, "steps": 2,
                                              "seed": 7},
            "webhook_url": f"http://localhost:{receiver.port}/hooks"})
        assert submitted.status_code == 201, submitted.text

        first, second = receiver.wait_for(2, timeout=240)
        assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
        payload = Webhook(secret).verify(second["body"], second["headers"])
        assert payload["id"] == submitted.json()["id"] and payload["state"] == "succeeded"
        assert payload["images"][0].startswith(stack.http_url)  # absolute, on the host it was submitted to
        assert httpx.get(payload["images"][0], headers={"Authorization": f"Token {account_token}"},
                         trust_env=False).status_code == 200
        webhook = http.get(f"/api/v1/jobs/{payload['id']}/").json()["webhook"]
        assert webhook["state"] == "delivered"
        assert [attempt["status_code"] for attempt in webhook["attempts"]] == [500, 200]
