"""Realtime frames on the worker: kept newest-per-session and run in batches on the denoising thread
(`group_frames`, `gather_wait` are pure), their results encoded on a thread of their own. What,
when and why: docs/design/frame-batching.md."""
from __future__ import annotations

import base64
import collections
import io
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gpuworker.inputs import ParamsRefused, open_image
from gpuworker.limits import MAX_IMAGE_PIXELS
from gpuworker.pipelines import FrameRequest, GenerationRequest
from potocolom.protocol.worker import FrameResult

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)

JPEG_QUALITY = 85  # frame_result images: JPEG is a fraction of PNG's size for drawings
GATHER_FRACTION = 0.25  # the gather window: at most this fraction of the last batch's call time...
GATHER_MAX_SECONDS = 0.05  # ...and never more than this
ACTIVE_FRAMES = 3  # a session that ran no frame for this many frame times is not waited for
KEPT_RUNS = 1000  # FrameRunner.runs keeps the latest batches only: a worker runs for days


# --- frames and batches (pure) ------------------------------------------------------------------


class FramePipeline(Protocol):
    """What realtime needs of a loaded model (pipelines.DiffusersPipeline)."""

    rung: str

    def check_inputs(self, params: Any) -> GenerationRequest: ...

    def generate_frames(self, request: FrameRequest) -> list[Image]: ...


@dataclass(frozen=True)
class SessionParams:
    """A live session's fixed parameters (from session_start, defaults filled in)."""

    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int


@dataclass(frozen=True)
class QueuedFrame:
    """One frame of a live session, as received; its image's header was checked when it arrived
    (sessions.frame_of), its pixels are decoded on the denoising thread."""

    session_id: str
    seq: int
    model_id: str
    params: SessionParams
    prompt: str
    strength: float
    image: bytes  # PNG, JPEG or WebP bytes whose header declared at most MAX_IMAGE_PIXELS
    received: float = 0.0


def denoise_steps(steps: int, strength: float) -> int:
    """The denoising steps diffusers' img2img runs: int(steps x strength), at least 1."""
    return max(1, min(int(steps * strength), steps))


def call_strength(steps: int, denoised: int) -> float:
    """A strength that gives exactly `denoised` steps of `steps` (clear of float rounding)."""
    return 1.0 if denoised >= steps else (denoised + 0.5) / steps


BatchKey = tuple[str, int, int, int, float, int]


def batch_key(frame: QueuedFrame) -> BatchKey:
    """Frames with equal keys can share one pipeline call."""
    p = frame.params
    return (frame.model_id, p.width, p.height, p.steps, p.guidance_scale, denoise_steps(p.steps, frame.strength))


def newest_per_session(frames: Sequence[QueuedFrame]) -> list[QueuedFrame]:
    """One frame per session, the one with the highest seq, at its session's first place."""
    newest: dict[str, QueuedFrame] = {}
    for frame in frames:
        held = newest.get(frame.session_id)
        if held is None or frame.seq >= held.seq:
            newest[frame.session_id] = frame
    return list(newest.values())


def group_frames(frames: Sequence[QueuedFrame], max_batch: Mapping[str, int]) -> list[list[QueuedFrame]]:
    """Batches for one pipeline call each, in order of their first frame; at most max_batch[model]
    frames each (1 for a model not named); only the newest frame per session."""
    groups: dict[BatchKey, list[QueuedFrame]] = {}
    for frame in newest_per_session(frames):
        groups.setdefault(batch_key(frame), []).append(frame)
    batches: list[list[QueuedFrame]] = []
    for key, group in groups.items():
        size = max(1, max_batch.get(key[0], 1))
        batches.extend(group[i:i + size] for i in range(0, len(group), size))
    return batches


def batch_limits(slots: Mapping[str, int], max_batch: int | None = None) -> dict[str, int]:
    """Frames per pipeline call for each model: its slots, capped at max_batch (--max-batch) when
    given; at least 1."""
    return {model_id: max(1, n if max_batch is None else min(n, max_batch)) for model_id, n in slots.items()}


def gather_window(last_call_seconds: float, max_batch: Mapping[str, int], *, fraction: float = GATHER_FRACTION,
                  cap: float = GATHER_MAX_SECONDS) -> float:
    """Seconds the idle denoising thread may wait for more frames: a fraction of the last batch's
    call time, capped; 0 when no model batches (nothing to gather)."""
    if not any(n > 1 for n in max_batch.values()):
        return 0.0
    return max(0.0, min(cap, fraction * last_call_seconds))


def active_sessions(last_ran: Mapping[str, float], *, now: float, horizon: float) -> set[str]:
    """The sessions whose latest frame ran (its batch ended) within `horizon` seconds of now."""
    return {session_id for session_id, ended in last_ran.items() if now - ended <= horizon}


def gather_wait(*, now: float, pending: Collection[str], active: Collection[str], first_received: float,
                last_end: float, window: float) -> float:
    """Seconds to wait before running the pending frames (0 or less: run them now).

    Now when nothing is pending, when every active session has a frame pending, or when the window
    is over; the window starts at the end of the last batch or at the first pending frame's
    arrival, whichever is later, so sessions just answered get their round trip.
    """
    if not pending or window <= 0 or set(active) <= set(pending):
        return 0.0
    return max(first_received, last_end) + window - now


def encode_jpeg_b64(image: Image, quality: int = JPEG_QUALITY) -> str:
    """frame_result.image: bare base64 JPEG."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# --- the queue and the runner (threads) ---------------------------------------------------------


class FrameQueue:
    """Pending frames, newest per session only; safe to use from any thread."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pending: dict[str, QueuedFrame] = {}

    def put(self, frame: QueuedFrame) -> bool:
        """Queue a frame (an older pending frame of its session is replaced; an older frame than
        the pending one is dropped); True when the queue was empty before."""
        with self._changed:
            was_empty = not self._pending
            held = self._pending.get(frame.session_id)
            if held is None or frame.seq >= held.seq:
                self._pending[frame.session_id] = frame
            self._changed.notify_all()
            return was_empty

    def take(self, wait: Callable[[Sequence[QueuedFrame]], float] | None = None) -> list[QueuedFrame]:
        """Take every pending frame. With `wait`, first wait while wait(pending frames) gives
        seconds left (more than 0): each put, drop or clear asks it again."""
        with self._changed:
            while wait is not None and self._pending:
                seconds = wait(list(self._pending.values()))
                if seconds <= 0:
                    break
                self._changed.wait(seconds)
            frames, self._pending = list(self._pending.values()), {}
            return frames

    def drop_session(self, session_id: str) -> None:
        with self._changed:
            self._pending.pop(session_id, None)
            self._changed.notify_all()

    def clear(self) -> None:
        with self._changed:
            self._pending.clear()
            self._changed.notify_all()


PostFrame = Callable[[dict[str, Any]], None]


class FrameRunner:
    """Runs queued frames in batches on the denoising thread; encodes results on its own thread.

    `post` gets each frame_result message (from the encoder thread). `busy_seconds` adds up the
    time spent in pipeline calls, so a job that frames ran inside can leave it out of its gpu_ms.
    `runs` holds the latest `keep_runs` batches (a worker runs for days).
    """

    def __init__(self, pipelines: Mapping[str, FramePipeline], max_batch: Mapping[str, int], post: PostFrame, *,
                 encode: Callable[[Image], str] = encode_jpeg_b64, clock: Callable[[], float] = time.monotonic,
                 max_image_pixels: int = MAX_IMAGE_PIXELS, keep_runs: int = KEPT_RUNS):
        self.queue = FrameQueue()
        # (clock at start, batch size) of the latest batches run, in order
        self.runs: collections.deque[tuple[float, int]] = collections.deque(maxlen=keep_runs)
        self.max_image_pixels = max_image_pixels
        self.busy_seconds = 0.0
        self._pipelines = dict(pipelines)
        self._max_batch = dict(max_batch)
        self._batch_cap: int | None = None  # --max-batch, for models added later too
        self._last_ran: dict[str, float] = {}  # session_id -> clock when its latest frame's batch ended
        self._last_end = 0.0  # clock when the latest batch ended
        self._last_call_seconds = 0.0  # the latest batch's pipeline call
        self._post = post
        self._encode = encode
        self._clock = clock
        # Its own encoder, so a frame never waits behind a big job's PNG.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="frame-encode")

    def cap_batches(self, max_batch: int | None) -> None:
        """At most max_batch frames per pipeline call (--max-batch; 1 turns batching off)."""
        self._batch_cap = max_batch
        self._max_batch = batch_limits(self._max_batch, max_batch)
        if max_batch is not None:
            log.info("realtime frames: at most %d per pipeline call%s", max_batch,
                     " (batching off)" if max_batch == 1 else "")

    @property
    def max_batch(self) -> dict[str, int]:
        return dict(self._max_batch)

    def add_model(self, model_id: str, pipeline: FramePipeline, slots: int) -> None:
        """On the event loop: a model loaded on demand runs frames in batches of up to its slots
        (capped as cap_batches said). The tables are replaced, never changed in place: the
        denoising thread reads them meanwhile."""
        self._pipelines = {**self._pipelines, model_id: pipeline}
        self._max_batch = {**self._max_batch, **batch_limits({model_id: slots}, self._batch_cap)}

    def remove_model(self, model_id: str) -> None:
        """On the event loop: an unloaded model runs no more frames (and is referenced no more)."""
        self._pipelines = {m: p for m, p in self._pipelines.items() if m != model_id}
        self._max_batch = {m: n for m, n in self._max_batch.items() if m != model_id}

    def run_pending(self, *, gather: bool = True) -> int:
        """On the denoising thread: run the pending frames, batched; return the batches run.

        With gather (the thread is idle), first wait for the active sessions' frames, within the
        gather window (see the module docstring); without, run what is pending now.
        """
        frames = self.queue.take(self._gather_wait if gather else None)
        if not frames:
            return 0
        ran = 0
        for batch in group_frames(frames, self._max_batch):
            ran += self._run_batch(batch)
        return ran

    def _gather_wait(self, pending: Sequence[QueuedFrame]) -> float:
        now = self._clock()
        window = gather_window(self._last_call_seconds, self._max_batch)
        if window <= 0:
            return 0.0
        active = self._active_sessions(now, window)
        return gather_wait(now=now, pending={f.session_id for f in pending}, active=active,
                           first_received=min(f.received for f in pending), last_end=self._last_end,
                           window=window)

    def _active_sessions(self, now: float, window: float) -> set[str]:
        """The sessions that drew lately; the others are forgotten (so the table stays small)."""
        horizon = ACTIVE_FRAMES * (self._last_call_seconds + window)
        last_ran = self._last_ran.copy()  # one atomic copy: drop_session runs on the event loop
        active = active_sessions(last_ran, now=now, horizon=horizon)
        for session_id in set(last_ran) - active:  # forget sessions that stopped drawing
            self._last_ran.pop(session_id, None)
        return active

    def forget_sessions(self) -> None:
        """The connection dropped: every session is gone, and so is every pending frame."""
        self._last_ran.clear()
        self.queue.clear()

    def drop_session(self, session_id: str) -> None:
        """The session ended: drop its pending frame, and wait for it no more."""
        self._last_ran.pop(session_id, None)  # first: dropping the frame wakes a gathering thread
        self.queue.drop_session(session_id)

    def _run_batch(self, batch: list[QueuedFrame]) -> int:
        decoded: list[tuple[QueuedFrame, Image]] = []
        for frame in batch:
            try:
                decoded.append((frame, open_image(frame.image, max_pixels=self.max_image_pixels, what="frame image")))
            except ParamsRefused as exc:
                log.warning("session %s: frame %s dropped: %s", frame.session_id, frame.seq, exc)
        pipeline = self._pipelines.get(batch[0].model_id)
        if not decoded or pipeline is None:
            return 0
        params = batch[0].params
        denoised = denoise_steps(params.steps, batch[0].strength)
        request = FrameRequest(
            prompts=[f.prompt for f, _ in decoded], images=[image for _, image in decoded],
            seeds=[f.params.seed for f, _ in decoded], width=params.width, height=params.height, steps=params.steps,
            guidance_scale=params.guidance_scale, strength=call_strength(params.steps, denoised))
        started = self._clock()
        try:
            images = pipeline.generate_frames(request)
        except Exception:  # one bad batch must not end the denoising loop
            self.busy_seconds += self._clock() - started
            log.exception("a batch of %d frame(s) of %s failed", len(decoded), batch[0].model_id)
            return 0
        ended = self._clock()
        elapsed = ended - started
        self.busy_seconds += elapsed
        gpu_ms = round(elapsed * 1000, 1)
        self.runs.append((started, len(decoded)))
        self._last_end, self._last_call_seconds = ended, elapsed
        for frame, _ in decoded:
            self._last_ran[frame.session_id] = ended
        # A session that ended while its batch ran is back in the table: forget the idle ones.
        self._active_sessions(ended, gather_window(elapsed, self._max_batch))
        try:
            self._encoder.submit(self._send, [f for f, _ in decoded], images, gpu_ms)
        except RuntimeError:  # the encoder was shut down: the worker is stopping
            pass
        return 1

    def _send(self, frames: list[QueuedFrame], images: list[Image], gpu_ms: float) -> None:
        for frame, image in zip(frames, images, strict=True):
            try:
                encoded = self._encode(image)
            except Exception:
                log.exception("session %s: frame %s could not be encoded", frame.session_id, frame.seq)
                continue
            self._post(FrameResult(frame.session_id, frame.seq, encoded, gpu_ms, len(frames)).to_wire())

    @property
    def batch_sizes(self) -> list[int]:
        return [size for _, size in self.runs]

    def close(self) -> None:
        self.queue.clear()
        self._encoder.shutdown(wait=False, cancel_futures=True)
