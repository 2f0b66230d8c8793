"""What one job's time went to on a worker (monotonic timestamps, for logs and benchmarks), and the
denoising loop's idle gaps between back-to-back jobs (encoding and upload should never hold it up;
bench/worker_idle.py measures them)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class JobTiming:
    """Monotonic timestamps (seconds) of one job, for logs and benchmarks.

    outcome: "held" until the job ends as "succeeded", "failed", "cancelled" or "preempted".
    """

    job_id: str
    model_id: str
    received: float
    denoise_start: float | None = None
    denoise_end: float | None = None
    encode_start: float | None = None
    encode_end: float | None = None
    sent: float | None = None
    outcome: str = "held"
    rung: str | None = None  # the rung the job's last pipeline call ran on
    gpu_ms: float | None = None  # job_result.gpu_ms: the successful call's own time

    def summary(self) -> str:
        """One log line: where the job's time went, in milliseconds, and the rung it ran on."""
        def ms(start: float | None, end: float | None) -> str:
            return "-" if start is None or end is None else f"{(end - start) * 1000:.0f}"
        gpu = "-" if self.gpu_ms is None else f"{self.gpu_ms:.0f}"
        return (f"job {self.job_id} ({self.model_id}) {self.outcome} on rung {self.rung or '-'}, gpu {gpu} ms: "
                f"waited "
                f"{ms(self.received, self.denoise_start)} ms, denoised {ms(self.denoise_start, self.denoise_end)} ms, "
                f"encoded {ms(self.encode_start, self.encode_end)} ms, sent "
                f"{ms(self.encode_end, self.sent)} ms after encoding, {ms(self.received, self.sent)} ms in all")


def denoise_idle_gaps(timings: Sequence[JobTiming]) -> list[float]:
    """Seconds the denoising loop sat idle between back-to-back jobs.

    For each job that was already held when the job before it finished denoising, the time from
    that end to its own denoising start. Zero-ish gaps mean encoding and upload never held it up.
    """
    # (denoise_start, denoise_end, received) of each job that ran, in the order it started
    ran = sorted(((t.denoise_start, t.denoise_end, t.received) for t in timings
                  if t.denoise_start is not None and t.denoise_end is not None), key=lambda run: run[0])
    return [start - ended for (_, ended, _), (start, _, received) in zip(ran, ran[1:], strict=False)
            if received <= ended]
