"""For the people who use it, measured on a real stack: Daphne, two CPU workers (`runworker_gpu`)
on two tiny SD models, and a webhook receiver on loopback.

In one run:
  (1) webhook delivery: from a job's `finished_at` to its signed POST reaching the receiver, p50
      and p99 (every delivery's signature checked as a receiver would, with the account's secret);
  (2) previews' cost as a share of a step: bench/previews.py's figures (the latent-to-RGB map and
      JPEG encoding at SD-1.5, SDXL and SD3 latent sizes, on this CPU) against the H200's SD-1.5 step
      and the step measured here on the tiny model; goal <= 5 %;
  (3) ETA accuracy over a mixed run (bursts of jobs of 2-16 steps on both models): for jobs that
      waited >= 10 s, p50 and p90 of |eta - actual| / actual, with `eta_seconds` as the API
      answered the submission, beside AI Horde's formula in the same run (the steps queued ahead of
      the job divided by the fleet's average speed, from the jobs finished before it came); goal:
      the API's p90 <= 20 %.

    .venv/bin/python bench/users.py [--bursts 4] [--burst-jobs 60] [--gap 30] [--seed 1]
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import http.server
import json
import random
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.stack import Stack, free_port  # noqa: E402

MODELS = ("tiny-a", "tiny-b")
WAITED_SECONDS = 10.0  # ETA accuracy counts jobs that waited at least this long
H200_SD15_STEP_MS = 27.0  # docs/design/memory-ladder.md


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def moment(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Receiver(http.server.ThreadingHTTPServer):
    """A webhook receiver on loopback: records when each POST arrived, its headers and body."""

    def __init__(self) -> None:
        self.received: list[tuple[float, dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", free_port()), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        arrived = time.time()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server: Receiver = self.server  # type: ignore[assignment]
        with server.lock:
            server.received.append((arrived, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return


def verified(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """Standard Webhooks: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}"> with the key after whsec_."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(sig.split(",", 1)[-1], expected) for sig in headers["webhook-signature"].split())


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(self.base + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


@dataclass
class Submitted:
    job_id: str
    model_id: str
    steps: int
    at: float
    eta: float | None


def install(stack: Stack) -> Path:
    models_dir = stack.workdir / "models"
    stack.manage("make_tiny_model", str(models_dir / MODELS[0]))
    for model_id in MODELS:
        if model_id != MODELS[0]:
            shutil.copytree(models_dir / MODELS[0], models_dir / model_id)
        path = models_dir / model_id / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["model_id"] = model_id
        path.write_text(json.dumps(manifest))
        stack.manage("load_manifests", str(path))
    return models_dir


def wait_for_hooks(receiver: Receiver, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(receiver.received) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(receiver.received)} of {count} webhooks came within {timeout:.0f} s")
        time.sleep(0.2)


def horde_eta(job: Submitted, jobs: dict[str, dict[str, Any]], submitted: list[Submitted]) -> float | None:
    """AI Horde's estimate for `job` when it came: the steps of the jobs queued ahead of it (of any
    model: Horde counts the queue's whole work) over the fleet's average speed, from the jobs
    finished before it came (steps a second of each worker, summed over the workers)."""
    ahead = sum(s.steps for s in submitted if s.at < job.at
                and (moment(jobs[s.job_id]["started_at"]) or float("inf")) > job.at)
    per_worker: dict[str, tuple[int, float]] = {}
    for s in submitted:
        row = jobs[s.job_id]
        started, finished = moment(row["started_at"]), moment(row["finished_at"])
        if started is None or finished is None or finished > job.at or not row.get("worker_id"):
            continue
        steps, seconds = per_worker.get(row["worker_id"], (0, 0.0))
        per_worker[row["worker_id"]] = (steps + s.steps, seconds + finished - started)
    speed = sum(steps / seconds for steps, seconds in per_worker.values() if seconds > 0)
    return None if speed == 0 else ahead / speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst-jobs", type=int, default=60)
    parser.add_argument("--gap", type=float, default=30.0, help="seconds between bursts")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    with Stack(WEBHOOK_ALLOW_PRIVATE="true", PREVIEW_STEPS="4", ACCOUNT_JOB_LIMIT="100000",
               JOB_SUBMIT_RATE="100000/minute") as stack:
        stack.manage("migrate", "--noinput")
        token = stack.manage("create_account", "alice")
        worker_token = stack.manage("create_worker_token", "bench-users")
        models_dir = install(stack)
        stack.start_api()
        for n in range(2):
            stack.start_worker(worker_token, models_dir, "--worker-id", f"cpu-{n}", "--threads", "1",
                               "--no-realtime", log_name=f"worker-{n}.log")
        api = Api(stack.http_url, token)
        secret = api.call("GET", "/api/v1/account/webhook-secret/")["secret"]

        def submit(model_id: str, steps: int) -> Submitted:
            at = time.time()
            job = api.call("POST", "/api/v1/jobs/", {"model_id": model_id, "webhook_url": receiver.url, "params": {
                "prompt": "a lighthouse", "width": 64, "height": 64, "steps": steps, "seed": rng.randrange(1000)}})
            return Submitted(job["id"], model_id, steps, at, job.get("eta_seconds"))

        # Warm-up: one job per model on each worker (loading, first-run costs), not counted.
        warm = [submit(m, 4) for m in MODELS for _ in range(2)]
        wait_for_hooks(receiver, len(warm), 300)
        warm_hooks = len(receiver.received)

        submitted: list[Submitted] = []
        started = time.monotonic()
        for burst in range(args.bursts):
            for _ in range(args.burst_jobs):
                submitted.append(submit(rng.choice(MODELS), rng.randint(2, 16)))
            if burst < args.bursts - 1:
                time.sleep(max(0.0, started + (burst + 1) * args.gap - time.monotonic()))
        wait_for_hooks(receiver, warm_hooks + len(submitted), 1800)
        jobs = {s.job_id: api.call("GET", f"/api/v1/jobs/{s.job_id}/") for s in submitted}

    hooks = receiver.received[warm_hooks:]
    bodies = [(arrived, headers, json.loads(body), verified(secret, headers, body)) for arrived, headers, body in hooks]
    delays = [arrived - (moment(job["finished_at"]) or arrived) for arrived, _, job, _ in bodies]
    bad = sum(1 for *_, ok in bodies if not ok)
    run_seconds = [moment(j["finished_at"]) - moment(j["started_at"]) for j in jobs.values()  # type: ignore[operator]
                   if j["started_at"] and j["finished_at"]]
    step_ms = statistics.median(
        1000 * (moment(j["finished_at"]) - moment(j["started_at"])) / s.steps  # type: ignore[operator]
        for s in submitted if (j := jobs[s.job_id])["started_at"] and j["finished_at"])
    print(f"run: {len(submitted)} jobs in {args.bursts} bursts of {args.burst_jobs} every {args.gap:g} s, "
          f"2 CPU workers, models {', '.join(MODELS)}; job runs p50 {statistics.median(run_seconds):.2f} s, "
          f"a step ~{step_ms:.0f} ms (median of run / steps)")
    print(f"(1) webhooks: {len(hooks)} delivered, {bad} failing the signature check; finished_at -> received "
          f"p50 {1000 * percentile(delays, 50):.0f} ms, p99 {1000 * percentile(delays, 99):.0f} ms, "
          f"max {1000 * max(delays):.0f} ms")
    previews(step_ms)
    ours, horde, waited = [], [], 0
    for s in submitted:
        row = jobs[s.job_id]
        actual = (moment(row["started_at"]) or s.at) - s.at
        if actual < WAITED_SECONDS:
            continue
        waited += 1
        if s.eta is not None:
            ours.append(abs(s.eta - actual) / actual)
        if (theirs := horde_eta(s, jobs, submitted)) is not None:
            horde.append(abs(theirs - actual) / actual)
    print(f"(3) ETA over {waited} jobs that waited >= {WAITED_SECONDS:g} s "
          f"({len(ours)} with an eta_seconds at submission):")
    for name, errors in (("eta_seconds (the API)", ours), ("AI Horde's formula", horde)):
        if errors:
            print(f"    {name:<22} |eta - actual| / actual: p50 {percentile(errors, 50):.1%}, "
                  f"p90 {percentile(errors, 90):.1%}")
    if ours:
        p90 = percentile(ours, 90)
        print(f"goal: ETA p90 {p90:.1%} (<= 20%): {'PASS' if p90 <= 0.20 else 'MISSED'}")


def previews(step_ms: float) -> None:
    """(2): the preview's cost (bench/previews.py: the map and the JPEG, median of 50) as a share of
    a step: the H200's SD-1.5 step for the real latent sizes, and this run's tiny step."""
    from bench.previews import preview_costs

    worst = 0.0
    for row in preview_costs(tiny=False):
        worst = max(worst, row.share)
        print(f"(2) preview of {row.name} latents {row.shape}: {row.preview_ms:.2f} ms, {row.share:.1%} of the "
              f"{row.step_of} ({row.step_ms:g} ms), {row.preview_ms / step_ms:.1%} of this run's tiny step "
              f"({step_ms:.0f} ms); at PREVIEW_STEPS=4 a quarter of that over a job")
    print(f"goal: previews <= 5% of a step: {worst:.1%}: {'PASS' if worst <= 0.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
