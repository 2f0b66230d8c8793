"""Step-boundary scheduling on the worker, measured (issue 11). Each part is a function in PARTS.

(a) checkpoints: per scheduler, the seconds of one denoising step beside what a checkpoint costs:
    its size (blob bytes and the wire's base64 characters), the save (capture at the boundary: the
    copy of latents, history and generator state to the CPU, then safetensors and base64) and the
    resume (base64 and safetensors read back, the fingerprint checked, the state put on a scheduler
    freshly set for the job's schedule, the latents moved to the device). Goal: save + resume under
    one step. Two models: the tiny pipeline through the worker's own generate (64x64 by default),
    and a random-weight UNet of SD 1.5's config at 512x512 (latents 4x64x64, guidance batch 2)
    driven step by step by the same scheduler and checkpoint code, since the whole SD-1.5-sized
    pipeline (its VAE and text encoder) changes nothing in a checkpoint's cost. No downloads.

(b) work lost when a worker dies mid-job, checkpoints every 10 s (--every) against none. Measured: the
    tiny pipeline's step seconds (a plain 40-step run through generate, on a thread as the worker's
    denoising thread, not the main one) and its save seconds (capture at each boundary inside
    generate, then the wire's base64, as DenoiseLoop sends job_checkpoint); with
    part (a) in the same run, also (a)'s SD-1.5-sized UNet steps and saves (the scheduler with the
    costliest save). Computed, not a real death: for jobs of 30, 60, 120 and 300 s (--job-seconds), the
    measured steps over and over, a save at the first step boundary after each 10 s as
    steps.CheckpointTimer counts them (from the run's start, then from the boundary of the last), and
    the work lost at a death time uniform over the job, integrated exactly: none, the job restarts, so
    it loses all it ran (mean: half the job); with checkpoints, the step-seconds since the last saved
    checkpoint (dying mid-save saves nothing); the saves' own time is the overhead. A checkpoint counts
    as saved once posted: its trip to the API and the API's storage are not in it. Then one real 50-step
    job through DenoiseLoop with checkpoint_seconds 0.5 (--real-every; 10 s would make a long run): its real
    timeline, from its job_progress and job_checkpoint posts, integrated the same way beside the
    simulation on its own steps, which checks the timer rule the table assumes.
(c) mixed load on one worker: DenoiseLoop with its FrameRunner on the tiny pipeline in this process,
    wired as worker.GpuWorker wires them (frames queued as SessionDesk queues them: FrameQueue.put and
    a wake). N sessions (--sessions 3), each sending its next frame as soon as its previous frame_result
    is posted (closed loop, so frames always wait: the heaviest realtime load N sessions make), 64x64,
    2 steps at strength 0.6, batched up to N per call; a stream of 20-step 64x64 jobs kept 3 held
    (one running, 1-2 waiting: the next is submitted at each job_result). Four phases of 15 s (after
    2 s of warm-up) each: frames alone, jobs alone, frames + jobs, and the baseline: frames + jobs on
    the worker WITHOUT yielding, the same DenoiseLoop whose _run_frames does nothing when a job's progress
    hook calls it (gather=False), so frames run only before a job and between jobs. Frame latency: the frame
    queued -> its frame_result posted. jobs/s: job_progress posts in the window / steps per job. Step:
    between two job_progress posts of one job (under load, frames run at that boundary count in it).
    Busy: the union of the thread's pipeline calls (jobs' generate, frames' generate_frames) over the
    window; frames share: the frame calls' part; per batch: frames per frame call. Goals: frame p95
    under load <= frame p95 alone + one job step p95 (jobs alone) + 10 ms; (jobs/s under load / jobs/s
    alone) + frames share >= 0.9; busy >= 95% (work always waits under load).
(d) an urgent job while long jobs run: an in-process DenoiseLoop with two 50-step jobs of one account
    held (one running, one waiting, kept so), the urgent 4-step job of that account at priority 9,
    submitted a random moment into a step of the running one, 10 times; its delay: submit -> its
    job_started post, against one long-job step p95 (measured in the same run) + 50 ms. Baseline in
    the same run: the urgent job at priority 0, which waits for the long jobs ahead of it (3 times).

(e) the same through the API: real Daphne (tests.support.stack) and the real worker built as
    runworker_gpu builds it (gpuworker.main.build_worker) in this process, so its JobTiming is read
    directly. One account's 50-step job runs; once it is 2 steps further on, and a random moment into
    a step later, the account submits a 2-step job at priority 9 over REST; its delay: the POST's
    start -> the worker's denoising start of it, 5 times (--urgent-rounds). Two cases:
    JOB_DISPATCH_DEPTH 1, where the worker is full, so only the API's priority preemption (preempt,
    job_preempted at the step boundary, the job sent to the freed place) can start it; and depth 2,
    where the job is dispatched at once and the worker's turn book lets it overtake at the next
    step. Goal: one step (of an uninterrupted job of that size, measured in the same run) + 50 ms.

Every figure is wall time on this machine's CPU, shared with whatever else runs: each part prints the
load average it started at.

    .venv/bin/python bench/steps.py                    # all parts
    .venv/bin/python bench/steps.py --parts a --sd15-steps 2 --threads 2
    .venv/bin/python bench/steps.py --parts bcd --seconds 10 --sessions 4 --repeats 20
"""
from __future__ import annotations

import argparse
import io
import itertools
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULERS = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler")
# (a)'s SD-1.5-sized UNet per scheduler: (the seconds of each step, the seconds of each save)
SD15_MEASURED: dict[str, tuple[list[float], list[float]]] = {}
HEADER = f"{'model':<14}{'size':>6}{'scheduler':>34}{'step s':>9}{'blob KiB':>10}{'b64 KiB':>9}" \
         f"{'save ms':>9}{'resume ms':>11}{'(save+resume)/step':>20}"


def _row(model: str, size: int, scheduler: str, step_s: float, blob: int, text: int, save_s: float,
         resume_s: float) -> None:
    ratio = (save_s + resume_s) / step_s
    print(f"{model:<14}{size:>6}{scheduler:>34}{step_s:>9.3f}{blob / 1024:>10.1f}{text / 1024:>9.1f}"
          f"{save_s * 1000:>9.2f}{resume_s * 1000:>11.2f}{ratio:>20.4f}", flush=True)


def _resume_seconds(text: str, scheduler: Any, steps: int, device: str, fingerprint: Any) -> float:
    """What resuming adds to a job's call: read the text back and put its state where the steps read it."""
    from gpuworker.checkpoints import Checkpoint, restore_scheduler

    started = time.perf_counter()
    checkpoint = Checkpoint.from_base64(text)
    checkpoint.check_fits(fingerprint)
    scheduler.set_timesteps(steps)  # a fresh call does this too; the state goes on after it
    restore_scheduler(scheduler, checkpoint.scheduler, device)
    checkpoint.latents.to(device)
    checkpoint.generator()
    return time.perf_counter() - started


def _tiny_rows(size: int, steps: int) -> None:
    """The tiny pipeline through generate: step time from a plain run, save time at each boundary."""
    import diffusers

    from gpuworker.installed import discover_models
    from gpuworker.pipelines import DiffusersPipeline
    from gpuworker.tiny import make_tiny_model
    from gpuworker.weights import img2img_class

    with tempfile.TemporaryDirectory() as root:
        make_tiny_model(Path(root) / "tiny")
        (model,) = discover_models(Path(root))
        base = DiffusersPipeline.load(model, "cpu")
    params = {"prompt": "a lighthouse at dusk", "width": size, "height": size, "steps": steps, "seed": 7}
    for name in SCHEDULERS:
        pipe = type(base.pipe).from_pipe(base.pipe,
                                         scheduler=getattr(diffusers, name).from_config(base.pipe.scheduler.config))
        pipe.set_progress_bar_config(disable=True)
        adapter = DiffusersPipeline(model, pipe, img2img_class(pipe).from_pipe(pipe), "cpu", "full")
        _tiny_row(adapter, params, name)


def _tiny_row(adapter: Any, params: dict[str, Any], name: str) -> None:
    from gpuworker.checkpoints import Checkpoint
    from gpuworker.step_hooks import StepHooks

    adapter.generate({**params, "steps": 1})  # warm-up
    stamps: list[float] = []
    adapter.generate(params, hooks=StepHooks(progress=lambda *_: stamps.append(time.perf_counter())))
    step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    saves: list[float] = []
    texts: list[tuple[str, int]] = []
    reported: list[float] = []

    def keep(checkpoint: Any) -> None:
        captured = time.perf_counter()  # capture_checkpoint ran between the progress hook and here
        text = checkpoint.to_base64()
        saves.append(captured - reported[-1] + time.perf_counter() - captured)
        texts.append((text, len(checkpoint.to_blob())))

    adapter.generate(params, hooks=StepHooks(progress=lambda *_: reported.append(time.perf_counter()),
                                             checkpoint_due=lambda: bool(reported), on_checkpoint=keep))
    text, blob = max(texts, key=lambda pair: len(pair[0]))  # DPM's grows with its history
    fingerprint = Checkpoint.from_base64(text).fingerprint  # the job's: generate took it for this job
    resume_s = statistics.median(_resume_seconds(text, adapter.pipe.scheduler, params["steps"], "cpu", fingerprint)
                                 for _ in range(5))
    _row("tiny", params["width"], name, step_s, blob, len(text), statistics.median(saves), resume_s)


def _sd15_rows(steps: int) -> None:
    """A random UNet of SD 1.5's config at 512x512, stepped by hand with guidance (batch 2)."""
    import diffusers
    import torch
    from diffusers import UNet2DConditionModel

    from gpuworker.checkpoints import capture_checkpoint, fingerprint_for

    started = time.perf_counter()
    torch.manual_seed(0)
    unet: Any = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    unet.eval()
    print(f"(SD-1.5-sized UNet built in {time.perf_counter() - started:.0f} s, "
          f"{sum(p.numel() for p in unet.parameters()) / 1e6:.0f} M parameters)", flush=True)
    config = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
              "num_train_timesteps": 1000, "steps_offset": 1}
    context = torch.randn(2, 77, 768, generator=torch.Generator("cpu").manual_seed(1))
    for name in SCHEDULERS:
        scheduler = getattr(diffusers, name)(**config)
        scheduler.set_timesteps(steps)
        fingerprint = fingerprint_for(scheduler, steps=steps, strength=None, width=512, height=512, device="cpu",
                                      dtype=torch.float32)
        generator = torch.Generator("cpu").manual_seed(7)
        latents = torch.randn(1, 4, 64, 64, generator=generator) * scheduler.init_noise_sigma
        step_times, saves, text, blob = [], [], "", 0
        for index, timestep in enumerate(scheduler.timesteps):
            started = time.perf_counter()
            with torch.no_grad():
                model_input = scheduler.scale_model_input(torch.cat([latents] * 2), timestep)
                uncond, cond = unet(model_input, timestep, encoder_hidden_states=context).sample.chunk(2)
            latents = scheduler.step(uncond + 7.5 * (cond - uncond), timestep, latents, generator=generator,
                                     return_dict=False)[0]
            step_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            checkpoint = capture_checkpoint(scheduler, latents, generator, index=index + 1, step=index + 1,
                                            steps=steps, fingerprint=fingerprint)
            assert checkpoint is not None
            text = checkpoint.to_base64()
            saves.append(time.perf_counter() - started)
            blob = len(checkpoint.to_blob())
        fresh = getattr(diffusers, name)(**config)
        resume_s = statistics.median(_resume_seconds(text, fresh, steps, "cpu", fingerprint) for _ in range(5))
        SD15_MEASURED[name] = (step_times, saves)  # for (b), when it runs after (a)
        _row("sd15-unet", 512, name, statistics.median(step_times), blob, len(text), statistics.median(saves),
             resume_s)


def part_a(args: argparse.Namespace) -> None:
    """(a) Checkpoint size, save time and resume time beside one step's time, on the CPU."""
    print(f"\n(a) checkpoints on CPU, {args.threads} torch threads; the largest checkpoint of each run "
          "(DPM-Solver's grows with its history), save: median over the boundaries, resume: median of 5")
    print(HEADER)
    for size in args.tiny_sizes:
        _tiny_rows(size, args.tiny_steps)
    if args.sd15_steps > 0:
        _sd15_rows(args.sd15_steps)


# --- shared by (b), (c), (d): the tiny pipeline, the worker's denoising loop and frames in-process ---

MODEL = "tiny-sd"
MAX_STEPS = 50  # the tiny manifest's most steps
_TINY: list[Any] = []  # the tiny pipeline, loaded once per run


def _tiny() -> Any:
    """The tiny model through DiffusersPipeline.load on the CPU, as the worker program loads it."""
    if not _TINY:
        from gpuworker.installed import discover_models
        from gpuworker.pipelines import DiffusersPipeline
        from gpuworker.tiny import make_tiny_model

        with tempfile.TemporaryDirectory() as root:
            make_tiny_model(Path(root) / "tiny")
            (model,) = discover_models(Path(root))
            _TINY.append(DiffusersPipeline.load(model, "cpu"))
        _TINY[0].generate({"prompt": "warm", "width": 64, "height": 64, "steps": 2, "seed": 1})  # warm-up
    return _TINY[0]


def _pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class Timed:
    """The tiny pipeline, keeping the span of each call the denoising thread makes: a job's generate
    (its frames between steps run inside it) and a batch's generate_frames."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.rung = inner.rung
        self.spans: list[tuple[float, float, str]] = []  # (start, end, "job" | "frames")

    def generate(self, params: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.generate(params, **kwargs)
        finally:
            self.spans.append((started, time.perf_counter(), "job"))

    def generate_frames(self, request: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.generate_frames(request)
        finally:
            self.spans.append((started, time.perf_counter(), "frames"))

    def check_inputs(self, params: Any) -> Any:
        return self.inner.check_inputs(params)

    def move_to(self, rung: str) -> None:
        self.inner.move_to(rung)

    def busy(self, start: float, end: float, kind: str | None = None) -> float:
        """Seconds within [start, end] the thread spent in calls (of one kind, or any: their union)."""
        clipped = sorted((max(a, start), min(b, end)) for a, b, k in list(self.spans)
                         if (kind is None or k == kind) and b > start and a < end)
        total, reach = 0.0, start
        for a, b in clipped:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


def _loop_class(yielding: bool) -> type:
    """DenoiseLoop as the worker runs it, or (yielding False) the worker without yielding: the same
    loop with no frames between a job's steps, so frames run only before a job and between jobs."""
    from gpuworker.denoise_loop import DenoiseLoop

    if yielding:
        return DenoiseLoop

    class WithoutYielding(DenoiseLoop):
        def _run_frames(self, *, gather: bool = True) -> float:
            if not gather:  # called from a job's progress hook, between two of its steps
                return 0.0
            return super()._run_frames(gather=gather)

    return WithoutYielding


class Rig:
    """One worker's denoising thread in this process, wired as job_desk.JobDesk wires it: a
    FrameRunner whose frames the DenoiseLoop runs, both on the tiny pipeline; every message the worker
    would send is kept here with the time it was posted. `feed` keeps that many jobs held (one running,
    the rest waiting), submitting the next each time one posts its job_result."""

    def __init__(self, *, yielding: bool = True, max_batch: int = 1, checkpoint_seconds: float = 0.0,
                 job_params: dict[str, Any] | None = None, feed: int = 0, account: str | None = None):
        from gpuworker.frames import FrameRunner

        self.pipe = Timed(_tiny())
        self.changed = threading.Condition()
        self.messages: list[tuple[float, dict[str, Any]]] = []  # job messages, in the order posted
        self.frame_posted: dict[tuple[str, int], float] = {}
        self.released: set[str] = set()
        self.fed: set[str] = set()  # the ids of the jobs fed
        self.job_params = job_params or {}
        self.feed = feed
        self.account = account  # of the jobs fed
        self._next_id = itertools.count(1)
        self.runner = FrameRunner({MODEL: self.pipe}, {MODEL: max_batch}, self._post_frame, clock=time.perf_counter)
        self.loop = _loop_class(yielding)({MODEL: self.pipe}, self._post, self._release, clock=time.perf_counter,
                                          frames=self.runner, checkpoint_seconds=lambda: checkpoint_seconds)

    def __enter__(self) -> Rig:
        self.loop.start()
        for _ in range(self.feed):
            self.submit(self.job_params, account=self.account)
        return self

    def __exit__(self, *exc: object) -> None:
        self.feed = 0
        self.loop.stop()

    def submit(self, params: dict[str, Any], *, priority: int = 0, account: str | None = None,
               job_id: str | None = None) -> str:
        from gpuworker.jobs import WorkerJob
        from gpuworker.timings import JobTiming

        if job_id is None:
            job_id = f"job-{next(self._next_id)}"
            if params is self.job_params:
                self.fed.add(job_id)
        self.loop.submit(WorkerJob(job_id, MODEL, params, JobTiming(job_id, MODEL, time.perf_counter()),
                                 priority=priority, account=account))
        return job_id

    def _post(self, message: dict[str, Any], job: Any) -> None:
        with self.changed:
            self.messages.append((time.perf_counter(), message))
            self.changed.notify_all()
        if message["type"] == "job_result" and self.feed and message["job_id"] in self.fed:
            self.submit(self.job_params, account=self.account)

    def _release(self, job: Any) -> None:
        with self.changed:
            self.released.add(job.job_id)
            self.changed.notify_all()

    def _post_frame(self, message: dict[str, Any]) -> None:
        with self.changed:
            self.frame_posted[(message["session_id"], message["seq"])] = time.perf_counter()
            self.changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], seconds: float = 120.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, seconds)

    def ended(self, job_id: str) -> bool:
        return self.posted("job_result", job_id) is not None or self.posted("job_failed", job_id) is not None

    def posted(self, kind: str, job_id: str) -> float | None:
        """When the job's first message of that type was posted (None: not yet)."""
        with self.changed:
            return next((at for at, m in self.messages if m["type"] == kind and m.get("job_id") == job_id), None)

    def step_seconds(self, start: float = 0.0, end: float = math.inf) -> list[float]:
        """Between two job_progress posts of one job, one step apart, with nothing else posted between
        (no other job ran there): a step, with whatever runs at its boundary (frames, a checkpoint)."""
        with self.changed:
            kept = [(at, m) for at, m in self.messages if m["type"] != "job_result"]
        return [b - a for (a, m), (b, n) in zip(kept, kept[1:], strict=False)
                if start <= a and b <= end and m["type"] == n["type"] == "job_progress"
                and m["job_id"] == n["job_id"] and n["step"] == m["step"] + 1]

    def steps_done(self, start: float, end: float) -> int:
        with self.changed:
            return sum(1 for at, m in self.messages if m["type"] == "job_progress" and start <= at < end)


# --- (b) work lost when a worker dies mid-job --------------------------------------------------


Timeline = list[tuple[float, bool]]  # (seconds, True for a checkpoint's save, False for a step)


def _timeline(steps: list[float], every: float, save: float) -> Timeline:
    """A job's steps with a save of `save` seconds at the first step boundary after each `every`
    seconds, counted as steps.CheckpointTimer counts them: from the run's start, then from each
    boundary that took one (every <= 0: no checkpoints)."""
    timeline: Timeline = []
    now, next_due = 0.0, every if every > 0 else math.inf
    for step in steps:
        timeline.append((step, False))
        now += step
        if now >= next_due:
            next_due = now + every
            timeline.append((save, True))
            now += save
    return timeline


def _lost(timeline: Timeline) -> tuple[float, float, int, float]:
    """A death at a time uniform over the timeline loses the step-seconds done since the last saved
    checkpoint (all of them before the first; a save cut short saves nothing). Return (the mean lost,
    the most lost, the saves, the timeline's seconds), exactly (the integral, no sampling)."""
    area, done_since, total, worst, saves = 0.0, 0.0, 0.0, 0.0, 0
    for seconds, is_save in timeline:
        total += seconds
        if is_save:
            area += done_since * seconds  # dying during the save: it is not saved yet
            done_since = 0.0
            saves += 1
        else:
            area += done_since * seconds + seconds * seconds / 2  # what was done, and this step's part
            done_since += seconds
            worst = max(worst, done_since)
    return area / total, worst, saves, total


def _job_steps(measured: list[float], seconds: float) -> list[float]:
    """A job of about `seconds` of steps: the measured step seconds over and over."""
    steps: list[float] = []
    total = 0.0
    while total < seconds:
        step = measured[len(steps) % len(measured)]
        steps.append(step)
        total += step
    return steps


def _tiny_step_and_save(steps: int) -> tuple[list[float], list[float]]:
    """The tiny pipeline's step seconds (a plain run) and save seconds (a capture at each boundary of a
    second run: capture_checkpoint inside generate, then the wire's base64, as DenoiseLoop sends it)."""
    from gpuworker.step_hooks import StepHooks

    adapter = _tiny()
    params = {"prompt": "a lighthouse at dusk", "width": 64, "height": 64, "steps": steps, "seed": 7}
    stamps: list[float] = []
    adapter.generate(params, hooks=StepHooks(progress=lambda *_: stamps.append(time.perf_counter())))
    step_seconds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    reported: list[float] = []
    saves: list[float] = []

    def keep(checkpoint: Any) -> None:
        checkpoint.to_base64()
        saves.append(time.perf_counter() - reported[-1])

    adapter.generate(params, hooks=StepHooks(progress=lambda *_: reported.append(time.perf_counter()),
                                             checkpoint_due=lambda: bool(reported), on_checkpoint=keep))
    return step_seconds, saves


def _real_lost(args: argparse.Namespace) -> None:
    """One real job through DenoiseLoop with periodic checkpoints: its real timeline (a step ends at
    its job_progress post; a save runs from there to its job_checkpoint post) integrated as the
    table's, beside the simulation on the same steps."""
    steps = args.real_steps
    params = {"prompt": "a lighthouse at dusk", "width": 64, "height": 64, "steps": steps, "seed": 3}
    with Rig(checkpoint_seconds=args.real_every) as rig:
        job_id = rig.submit(params)
        if not rig.wait_for(lambda: rig.ended(job_id), 600.0):
            print("    real run: the job did not end in time")
            return
        if rig.posted("job_result", job_id) is None:
            print("    real run: the job failed (see the log above)")
            return
        with rig.changed:
            mine = [(at, m) for at, m in rig.messages if m.get("job_id") == job_id]
    progress = [at for at, m in mine if m["type"] == "job_progress"]
    saved = {m["step"]: at for at, m in mine if m["type"] == "job_checkpoint"}
    real: Timeline = []
    previous = progress[0] - statistics.median(b - a for a, b in zip(progress, progress[1:], strict=False))
    for step, at in enumerate(progress, start=1):
        real.append((at - previous, False))
        previous = at
        if step in saved:
            real.append((saved[step] - at, True))
            previous = saved[step]
    step_list = [seconds for seconds, is_save in real if not is_save]
    save_list = [seconds for seconds, is_save in real if is_save]
    mean, worst, count, total = _lost(real)
    sim_mean, sim_worst, sim_count, _ = _lost(_timeline(step_list, args.real_every,
                                                        statistics.median(save_list) if save_list else 0.0))
    print(f"    real run: one {steps}-step tiny job through DenoiseLoop, checkpoint_seconds {args.real_every:g}: "
          f"{total:.2f} s, {count} job_checkpoint, mean lost {mean:.3f} s (max {worst:.3f}); simulated on its "
          f"step seconds: {sim_count} saves, mean lost {sim_mean:.3f} s (max {sim_worst:.3f}); none: "
          f"{sum(step_list) / 2:.3f} s")


def part_b(args: argparse.Namespace) -> None:
    """(b) Expected work lost at a worker's death, checkpoints every `--every` s against none."""
    every = args.every
    print(f"\n(b) work lost when the worker dies mid-job (death time uniform over the job), checkpoints every "
          f"{every:g} s against none; computed on measured step and save seconds (not a real death)")
    rows: list[tuple[str, list[float], float]] = []
    # on a thread of its own, as the worker's denoising thread runs it: on this CPU torch's steps on the main
    # thread were ~1.8x faster than on any other (OpenMP's pool of the main thread spins between regions)
    results: list[tuple[list[float], list[float]]] = []
    thread = threading.Thread(target=lambda: results.append(_tiny_step_and_save(args.b_steps)), name="denoise")
    thread.start()
    thread.join()
    step_seconds, saves = results[0]
    rows.append(("tiny 64", step_seconds, statistics.median(saves)))
    if SD15_MEASURED:
        name, (sd_steps, sd_saves) = max(SD15_MEASURED.items(), key=lambda item: statistics.median(item[1][1]))
        rows.append((f"sd15-unet 512 {name.removesuffix('Scheduler')}", sd_steps, statistics.median(sd_saves)))
    else:
        print("    (no SD-1.5-sized UNet row: it uses part (a)'s figures of this run; run with --parts ab)")
    print(f"{'model':<34}{'step s':>8}{'save ms':>9}{'job s':>7}{'steps':>7}{'none: lost s':>14}"
          f"{'ckpt: lost s':>14}{'max s':>8}{'saves':>7}{'overhead':>10}{'lost ratio':>12}")
    for label, measured, save in rows:
        for seconds in args.job_seconds:
            steps = _job_steps(measured, seconds)
            none_mean = _lost(_timeline(steps, 0.0, save))[0]
            mean, worst, count, total = _lost(_timeline(steps, every, save))
            overhead = count * save
            print(f"{label:<34}{statistics.median(measured):>8.3f}{save * 1000:>9.2f}{seconds:>7.0f}{len(steps):>7}"
                  f"{none_mean:>14.2f}{mean:>14.2f}{worst:>8.2f}{count:>7}"
                  f"{overhead / (total - overhead) * 100:>9.3f}%{mean / none_mean:>12.3f}", flush=True)
    print("    none: a job restarts from step 0, so it loses the time it ran (mean: half the job). ckpt: it loses "
          "the step-seconds since its last saved checkpoint; overhead: saves x the median save, over the job's steps")
    if args.real_steps > 0:
        _real_lost(args)


# --- (c) frames of live sessions while a stream of jobs runs -------------------------------------


def _png(rgb: tuple[int, int, int], size: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def _draw(rig: Rig, session_id: str, params: Any, strength: float, image: bytes, stop: threading.Event,
          sent: list[tuple[float, float]]) -> None:
    """One drawer: its next frame as soon as its previous result is posted (as SessionDesk.frame queues
    it: FrameQueue.put, and a wake when the queue was empty); keeps (submitted, latency)."""
    from gpuworker.frames import QueuedFrame

    for seq in itertools.count(1):
        if stop.is_set():
            return
        submitted = time.perf_counter()
        frame = QueuedFrame(session_id=session_id, seq=seq, model_id=MODEL, params=params,
                            prompt=f"{session_id} draws", strength=strength, image=image, received=submitted)
        if rig.runner.queue.put(frame):
            rig.loop.wake()
        key = (session_id, seq)

        def answered(key: tuple[str, int] = key) -> bool:
            return key in rig.frame_posted or stop.is_set()

        if not rig.wait_for(answered, 60.0) or key not in rig.frame_posted:
            return
        sent.append((submitted, rig.frame_posted[key] - submitted))


@dataclass
class Phase:
    name: str
    frames: list[float]  # latencies of the frames submitted within the window
    jobs_per_s: float
    busy: float  # share of the window the denoising thread spent in pipeline calls
    frames_share: float  # ... in frame batches
    steps: list[float]  # step seconds within the window
    batches: list[int]  # the sizes of the frame batches begun within the window


def _phase(args: argparse.Namespace, name: str, *, sessions: int, jobs: bool, yielding: bool = True) -> Phase:
    from gpuworker.frames import SessionParams

    job_params = {"prompt": "a lighthouse at dusk", "width": args.size, "height": args.size,
                  "steps": args.job_steps, "seed": 11}
    stop = threading.Event()
    sent: list[tuple[float, float]] = []
    with Rig(yielding=yielding, max_batch=args.max_batch or max(1, sessions), job_params=job_params,
             feed=args.held_jobs if jobs else 0) as rig:
        drawers = [threading.Thread(target=_draw, daemon=True, args=(
            rig, f"s{i}", SessionParams(args.size, args.size, args.frame_steps, 7.5, 100 + i), args.strength,
            _png((40 * i % 256, 90, 200), args.size), stop, sent)) for i in range(sessions)]
        for drawer in drawers:
            drawer.start()
        start = time.perf_counter() + args.warmup
        time.sleep(args.warmup + args.seconds)
        end = time.perf_counter()
        stop.set()
        with rig.changed:
            rig.changed.notify_all()
        for drawer in drawers:
            drawer.join(30)
    window = end - start
    return Phase(name, [latency for at, latency in sent if start <= at < end],
                 rig.steps_done(start, end) / args.job_steps / window, rig.pipe.busy(start, end) / window,
                 rig.pipe.busy(start, end, "frames") / window, rig.step_seconds(start, end),
                 [size for at, size in list(rig.runner.runs) if start <= at < end])


def _check(label: str, ok: bool, detail: str) -> None:
    print(f"    {'PASS' if ok else 'MISS'}  {label}: {detail}")


def part_c(args: argparse.Namespace) -> None:
    """(c) Mixed load on one worker: frames beside a stream of jobs, yielding between steps or not."""
    n = args.sessions
    print(f"\n(c) mixed load, tiny model {args.size}x{args.size} on CPU, {args.threads} torch threads: {n} sessions "
          f"({args.frame_steps} steps, strength {args.strength:g}; each sends its next frame when its last result is "
          f"posted, batches of up to {args.max_batch or n}), {args.job_steps}-step jobs kept {args.held_jobs} held "
          f"({args.held_jobs - 1}-{args.held_jobs} waiting); {args.seconds:g} s per phase after {args.warmup:g} s")
    phases = [_phase(args, "frames alone", sessions=n, jobs=False),
              _phase(args, "jobs alone", sessions=0, jobs=True),
              _phase(args, "frames + jobs", sessions=n, jobs=True),
              _phase(args, "no yield: frames + jobs", sessions=n, jobs=True, yielding=False)]
    print(f"{'phase':<26}{'frames':>7}{'p50 ms':>8}{'p95 ms':>8}{'jobs/s':>8}{'step p95 ms':>13}{'busy':>7}"
          f"{'frames share':>14}{'per batch':>11}")
    for p in phases:
        print(f"{p.name:<26}{len(p.frames):>7}{_pct(p.frames, 50) * 1000:>8.0f}{_pct(p.frames, 95) * 1000:>8.0f}"
              f"{p.jobs_per_s:>8.3f}{_pct(p.steps, 95) * 1000:>13.1f}{p.busy * 100:>6.1f}%"
              f"{p.frames_share * 100:>13.1f}%{statistics.mean(p.batches) if p.batches else math.nan:>11.2f}",
              flush=True)
    alone, jobs, mixed, baseline = phases
    step_p95 = _pct(jobs.steps, 95)
    bound = _pct(alone.frames, 95) + step_p95 + 0.010
    for p in (mixed, baseline):
        print(f"  goals, {p.name}:")
        p95 = _pct(p.frames, 95)
        _check("frame p95 under load <= alone + one step p95 + 10 ms", p95 <= bound,
               f"{p95 * 1000:.0f} ms against {bound * 1000:.0f} ms ({_pct(alone.frames, 95) * 1000:.0f} + "
               f"{step_p95 * 1000:.1f} + 10)")
        ratio = p.jobs_per_s / jobs.jobs_per_s
        _check("work conserved: jobs/s under load / alone + frames share >= 0.9", ratio + p.frames_share >= 0.9,
               f"{ratio:.3f} + {p.frames_share:.3f} = {ratio + p.frames_share:.3f}")
        _check("thread busy >= 95% while work waits", p.busy >= 0.95, f"{p.busy * 100:.1f}%")
    print(f"    (jobs alone: the thread busy {jobs.busy * 100:.1f}%; frames alone: {alone.busy * 100:.1f}%, "
          "where it waits for drawers between frames, as it should)")


# --- (d) an urgent job while long jobs run -------------------------------------------------------


def _urgent_delays(rig: Rig, args: argparse.Namespace, *, priority: int, repeats: int,
                   rng: random.Random) -> list[float]:
    """Submit an urgent job of the long jobs' account `repeats` times, each a random moment into a
    step of a running long job; its delay from submit to its job_started post."""
    urgent = {"prompt": "urgent", "width": args.size, "height": args.size, "steps": args.urgent_steps, "seed": 5}
    delays = []
    for _ in range(repeats):
        before = rig.steps_done(0.0, math.inf)

        def in_steps(before: int = before) -> bool:  # a long job is in its steps, and some were timed
            return rig.steps_done(0.0, math.inf) >= before + 3 and len(rig.step_seconds()) >= 2

        rig.wait_for(in_steps)
        time.sleep(rng.uniform(0.0, statistics.median(rig.step_seconds())))
        submitted = time.perf_counter()
        job_id = rig.submit(urgent, priority=priority, account="acct")

        def ended(job_id: str = job_id) -> bool:
            return rig.ended(job_id)

        finished = rig.wait_for(ended, 600.0)
        started = rig.posted("job_started", job_id)
        if not finished or started is None or rig.posted("job_result", job_id) is None:
            print(f"    the urgent job {job_id} did not end in time, or failed")
            break
        delays.append(started - submitted)
    return delays


def part_d(args: argparse.Namespace) -> None:
    """(d) An urgent job (priority 9) among long jobs of its account: its start delay."""
    print(f"\n(d) an urgent {args.urgent_steps}-step job submitted while {args.long_steps}-step jobs of its account "
          f"run (one running, one waiting, kept so), tiny {args.size}x{args.size}, in-process DenoiseLoop")
    long_job = {"prompt": "a long night", "width": args.size, "height": args.size, "steps": args.long_steps,
                "seed": 9}
    rng = random.Random(4)
    # the long jobs are of the urgent one's account, so priority orders them (across accounts: turns)
    with Rig(job_params=long_job, feed=2, account="acct") as rig:
        urgent = _urgent_delays(rig, args, priority=9, repeats=args.repeats, rng=rng)
        same = _urgent_delays(rig, args, priority=0, repeats=args.baseline_repeats, rng=rng)
        steps = rig.step_seconds()
    step_p95 = _pct(steps, 95)
    print(f"{'urgent job':<28}{'n':>4}{'p50 ms':>10}{'max ms':>10}")
    for label, delays in (("priority 9 (overtakes)", urgent), ("priority 0 (baseline: waits)", same)):
        print(f"{label:<28}{len(delays):>4}{_pct(delays, 50) * 1000:>10.0f}"
              f"{max(delays, default=math.nan) * 1000:>10.0f}")
    print(f"    a long job's step: p50 {_pct(steps, 50) * 1000:.1f} ms, p95 {step_p95 * 1000:.1f} ms "
          f"({len(steps)} steps of this run)")
    bound = step_p95 + 0.050
    worst = max(urgent, default=math.inf)
    _check("urgent start delay <= one step + 50 ms", worst <= bound,
           f"max {worst * 1000:.0f} ms against {bound * 1000:.0f} ms ({step_p95 * 1000:.1f} + 50)")


def part_e(args: argparse.Namespace) -> None:
    """(e) the urgent job through the API: real Daphne, the real worker in this process."""
    print("\n(e) an urgent job through the API and the real worker (tiny model, CPU): submit -> its first "
          f"step begins, {args.urgent_rounds} rounds per case", flush=True)
    print(f"{'case':<58}{'step ms':>12}{'delay p50 ms':>14}{'delay max ms':>14}{'goal ms':>9}  verdict")
    for depth, case in ((1, "full worker (depth 1): the API preempts the long job"),
                        (2, "worker with room (depth 2): it overtakes at a step")):
        _urgent_through_api(args, depth, case)


def _urgent_through_api(args: argparse.Namespace, depth: int, case: str) -> None:
    import asyncio

    import httpx

    from gpuworker.main import WorkerOptions, build_worker
    from tests.support.stack import Stack

    async def rounds(stack: Stack, account: str, worker_token: str, models_dir: Path) -> tuple[list[float], float]:
        worker = build_worker(WorkerOptions(api=stack.ws_url, token=worker_token, models_dir=models_dir,
                                            device="cpu", worker_id=f"bench-urgent-{depth}:0", threads=args.threads,
                                            realtime=False))
        running = asyncio.create_task(worker.run())
        headers = {"Authorization": f"Token {account}"}
        size = args.urgent_size
        async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=60, trust_env=False) as api:
            async def submit(prompt: str, steps: int, priority: int) -> str:
                response = await api.post("/api/v1/jobs/", json={"model_id": "tiny-sd", "priority": priority,
                                                                 "params": {"prompt": prompt, "width": size,
                                                                            "height": size, "steps": steps,
                                                                            "seed": 3}})
                response.raise_for_status()
                return str(response.json()["id"])

            async def wait(job_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
                deadline = time.monotonic() + 300
                while True:
                    job = (await api.get(f"/api/v1/jobs/{job_id}/")).json()
                    if done(job):
                        return job
                    assert time.monotonic() < deadline and job["state"] not in ("failed", "cancelled"), job
                    await asyncio.sleep(0.01)

            def timing_of(job_id: str) -> Any:
                return next(t for t in reversed(worker.timings) if t.job_id == job_id)

            # the step time, from an uninterrupted job of the same size
            alone = await submit("alone", 20, 0)
            await wait(alone, lambda job: job["state"] == "succeeded")
            t = timing_of(alone)
            step_s = (t.denoise_end - t.denoise_start) / 20
            long = await submit("a long job", 50, 0)
            rng = random.Random(depth)
            delays: list[float] = []
            for n in range(args.urgent_rounds):
                past = ((await api.get(f"/api/v1/jobs/{long}/")).json()["progress"] or {"step": 0})["step"]

                def further(job: dict[str, Any], past: int = past) -> bool:
                    return bool((job.get("progress") or {}).get("step", 0) > past + 2)

                await wait(long, further)
                await asyncio.sleep(rng.uniform(0, step_s))  # a random moment within a step, as in (d)
                submitted = time.monotonic()
                urgent = await submit(f"urgent {n}", 2, 9)
                await wait(urgent, lambda job: job["state"] == "succeeded")
                delays.append(timing_of(urgent).denoise_start - submitted)
            await api.post(f"/api/v1/jobs/{long}/cancel/")
        worker.stop()
        await asyncio.gather(running, return_exceptions=True)
        return delays, step_s

    with Stack(JOB_DISPATCH_DEPTH=str(depth), JOB_CHECKPOINT_SECONDS="0") as stack:
        account, worker_token = stack.prepare()
        models_dir = stack.workdir / "models"
        stack.manage("load_manifests", stack.manage("make_tiny_model", str(models_dir / "tiny")))
        stack.start_api()
        delays, step_s = asyncio.run(rounds(stack, account, worker_token, models_dir))
    goal = step_s + 0.050
    worst = max(delays)
    print(f"{case:<58}{step_s * 1000:>12.1f}{statistics.median(delays) * 1000:>14.1f}{worst * 1000:>14.1f}"
          f"{goal * 1000:>9.1f}  {'PASS' if worst <= goal else 'MISS'}", flush=True)


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {"a": part_a, "b": part_b, "c": part_c, "d": part_d,
                                                       "e": part_e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="".join(PARTS), help=f"which parts to run, of {''.join(PARTS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--tiny-sizes", type=int, nargs="+", default=[64],
                        help="the tiny VAE scales by 2 only: at 512 its UNet attends over 128x128 tokens (slow)")
    parser.add_argument("--tiny-steps", type=int, default=8)
    parser.add_argument("--sd15-steps", type=int, default=3, help="steps of the SD-1.5-sized UNet (0: skip it)")
    parser.add_argument("--size", type=int, default=64, help="(b)'s real run, (c), (d): jobs' and frames' size")
    parser.add_argument("--every", type=float, default=10.0, help="(b) seconds between checkpoints")
    parser.add_argument("--job-seconds", type=float, nargs="+", default=[30, 60, 120, 300], help="(b) job lengths")
    parser.add_argument("--b-steps", type=int, default=40, help="(b) steps of the tiny job whose steps are measured")
    parser.add_argument("--real-steps", type=int, default=MAX_STEPS, help="(b) the real run's steps (0: no real run)")
    parser.add_argument("--real-every", type=float, default=0.5, help="(b) the real run's checkpoint_seconds")
    parser.add_argument("--sessions", type=int, default=3, help="(c) live sessions drawing")
    parser.add_argument("--frame-steps", type=int, default=2, help="(c) a session's steps")
    parser.add_argument("--strength", type=float, default=0.6, help="(c) each frame's strength")
    parser.add_argument("--max-batch", type=int, default=0, help="(c) frames per call (0: as many as sessions)")
    parser.add_argument("--job-steps", type=int, default=20, help="(c) steps of each job of the stream")
    parser.add_argument("--held-jobs", type=int, default=3, help="(c) jobs held at once: one running, the rest waiting")
    parser.add_argument("--seconds", type=float, default=15.0, help="(c) measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="(c) seconds per phase before measuring")
    parser.add_argument("--long-steps", type=int, default=50, help="(d) steps of each long job (the tiny model's most)")
    parser.add_argument("--urgent-steps", type=int, default=4, help="(d) steps of the urgent job")
    parser.add_argument("--repeats", type=int, default=10, help="(d) urgent jobs at priority 9")
    parser.add_argument("--baseline-repeats", type=int, default=3, help="(d) urgent jobs at priority 0 (the baseline)")
    parser.add_argument("--urgent-rounds", type=int, default=5, help="(e) urgent jobs per case")
    parser.add_argument("--urgent-size", type=int, default=128, help="(e) the jobs' size (longer steps than (d))")
    args = parser.parse_args()
    for name in ("b_steps", "job_steps", "long_steps", "urgent_steps", "frame_steps", "real_steps"):
        if not (name == "real_steps" and args.real_steps == 0) and not 1 <= getattr(args, name) <= MAX_STEPS:
            parser.error(f"--{name.replace('_', '-')}: 1 to {MAX_STEPS} (the tiny model's most steps)")
    import torch

    torch.set_num_threads(args.threads)
    for part in args.parts:
        if part not in PARTS:
            parser.error(f"no part {part!r}: the parts are {', '.join(PARTS)}")
        started = time.perf_counter()
        load = " ".join(f"{value:.1f}" for value in os.getloadavg())
        print(f"\n--- part {part}: load average {load} on {os.cpu_count()} CPUs", flush=True)
        PARTS[part](args)
        print(f"--- part {part} took {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
