"""End to end: a job running on worker A when A gets SIGTERM is given back at a step boundary with
its checkpoint, resumes on worker B and ends with the same PNG bytes as an uninterrupted run of the
same seed; A exits with status 0 within --drain-seconds. Real Daphne, real runworker_gpu processes."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_job_path import Client
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

DRAIN_SECONDS = 60


def test_a_sigterm_drains_the_running_job_to_another_worker_which_ends_it_with_the_same_png(tmp_path: Path) -> None:
    with Stack(workdir=tmp_path) as stack:
        account_token, worker_token = stack.prepare()
        models_dir = stack.workdir / "models"
        manifest = Path(stack.manage("make_tiny_model", str(models_dir / "tiny")))
        assert stack.manage("load_manifests", str(manifest)) == "loaded 1"
        stack.start_api()
        options = ("--threads", "1", "--no-realtime", "--drain-seconds", str(DRAIN_SECONDS))
        first = stack.start_worker(worker_token, models_dir, "--worker-id", "drain-a", *options)
        client = Client(stack, account_token)
        params = {"prompt": "a long job", "width": 64, "height": 64, "steps": 50, "seed": 31}
        job = client.submit(model_id="tiny-sd", params=params)
        deadline = time.monotonic() + 180
        while not (client.job(job["id"]).get("progress") or {}).get("step"):
            assert time.monotonic() < deadline, client.job(job["id"])
            time.sleep(0.05)

        assert first.proc is not None
        os.killpg(first.proc.pid, signal.SIGTERM)
        stack.start_worker(worker_token, models_dir, "--worker-id", "drain-b", *options)

        assert first.proc.wait(DRAIN_SECONDS + 30) == 0, first.log()
        done = client.wait(job["id"], "succeeded")
        assert done["state"] == "succeeded", done
        assert (done["attempts"], done["preemptions"]) == (1, 1), done
        again = client.wait(client.submit(model_id="tiny-sd", params=params)["id"], "succeeded")  # on B, whole
        assert again["state"] == "succeeded", again
        drained = client.http.get(done["images"][0]).content
        assert drained[:8] == b"\x89PNG\r\n\x1a\n"
        assert drained == client.http.get(again["images"][0]).content
        assert "drained: every job given back and acknowledged" in first.log()
        assert re.search(rf"job {job['id']} .*, from step [1-9]", first.log()), "B did not resume it mid-run"
