"""Quiet logs in a normal run: `make_tiny_model`, the API under Daphne (the docs page and the schema
served) and `runworker_gpu` on the tiny model through one job and a drain print only log records of
their own: no tqdm progress bar, no torchvision notice, no schema warning ("Logs", docs/operations.md)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import ROOT, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

# settings.LOGGING's format: "2026-12-02 17:17:05,154 INFO gpuworker.loading: ..."
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): ")
ACCESS = re.compile(r'^\S+ - - \[[^\]]+\] "[A-Z]+ \S+" (\d{3}|-) (\d+|-)$')  # Daphne's access log, on stdout
OURS = ("workers.", "scheduling.", "realtime.", "potocolom.", "models_registry.")
NOISE = ("torchvision", "it/s]", "%|", "\r", "Warning", "warn(")


def noise_in(text: str) -> list[str]:
    """Lines that are not a log record, and library records at WARNING or above, and any of NOISE."""
    found = []
    for line in text.replace("\r", "\r\n").splitlines():
        if not line.strip():
            continue
        record = RECORD.match(line)
        if record is None and ACCESS.match(line):
            continue
        if record is None:
            found.append(f"not a log record: {line[:200]!r}")
        elif record.group(1) not in ("DEBUG", "INFO") and not record.group(2).startswith(OURS):
            found.append(f"a library's {record.group(1)}: {line[:200]!r}")
        elif any(word in line for word in NOISE):
            found.append(f"noise: {line[:200]!r}")
    return found


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(workdir=tmp_path) as running:
        yield running


def test_a_normal_run_logs_no_progress_bars_torchvision_notice_or_schema_warning(stack: Stack) -> None:
    account_token, worker_token = stack.prepare()
    models_dir = stack.workdir / "models"
    made = subprocess.run([sys.executable, "manage.py", "make_tiny_model", str(models_dir / "tiny")], cwd=ROOT,
                          env=stack.env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert noise_in(made.stderr) == [], made.stderr[-3000:]
    stack.manage("load_manifests", made.stdout.strip().splitlines()[-1])
    api = stack.start_api()
    worker = stack.start_worker(worker_token, models_dir, "--threads", "1")

    with httpx.Client(base_url=stack.http_url, headers={"Authorization": f"Token {account_token}"}, timeout=30,
                      trust_env=False) as http:
        assert http.get("/api/v1/docs/").status_code == 200
        assert http.get("/api/v1/schema/").status_code == 200
        job = http.post("/api/v1/jobs/", json={"params": {"prompt": "a red circle", "width": 64, "height": 64,
                                                          "steps": 2, "seed": 1}}).json()
        deadline = time.monotonic() + 180
        while (state := http.get(f"/api/v1/jobs/{job['id']}/").json()["state"]) not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, f"job still {state}:\n{worker.log()[-3000:]}"
            time.sleep(0.1)
    assert state == "succeeded", worker.log()[-3000:]
    worker.stop(grace=60)  # SIGTERM: the drain, logged as a normal stop is
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log()[-3000:]

    assert "succeeded" in worker.log() and "drained" in worker.log()  # the run did happen, logged
    assert noise_in(worker.log()) == []
    assert noise_in(api.log()) == []
