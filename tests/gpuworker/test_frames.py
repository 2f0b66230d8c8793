"""Realtime frames: batching, gathering and the session table (no socket)."""
from __future__ import annotations

import base64
import io
import random
import threading
from typing import Any

import numpy as np
import pytest

from gpuworker.frames import (
    FrameQueue,
    FrameRunner,
    QueuedFrame,
    SessionParams,
    active_sessions,
    batch_limits,
    call_strength,
    denoise_steps,
    gather_wait,
    gather_window,
    group_frames,
)
from gpuworker.inputs import ParamsRefused
from gpuworker.pipelines import FrameRequest
from gpuworker.sessions import LiveSession, SessionTable, frame_of, session_params
from gpuworker.slots import RealtimeCapacity
from potocolom.protocol.errors import MessageError
from potocolom.protocol.worker import parse_api_message
from tests.gpuworker.support import TEST_SECONDS

DEFAULT = SessionParams(width=64, height=64, steps=2, guidance_scale=7.5, seed=1)
BIG = SessionParams(width=128, height=64, steps=2, guidance_scale=7.5, seed=1)
CAPACITY = RealtimeCapacity(frame_ms_p95=200.0, slots=2, width=64, height=64, steps=2, measured={})


def png_b64(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, rgb).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def frame(session: str, seq: int = 1, *, model: str = "m", params: SessionParams = DEFAULT,
          strength: float = 1.0, image: str = "") -> QueuedFrame:
    return QueuedFrame(session_id=session, seq=seq, model_id=model, params=params, prompt=f"{session} {seq}",
                 strength=strength, image=base64.b64decode(image))


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 10, 25, 50])
def test_it_gives_each_strength_the_denoising_steps_diffusers_would(steps: int) -> None:
    for strength in [i / 100 for i in range(101)]:
        wanted = denoise_steps(steps, strength)
        assert wanted == max(1, min(int(steps * strength), steps))
        shared = call_strength(steps, wanted)
        assert 0 < shared <= 1 and min(int(steps * shared), steps) == wanted  # diffusers' get_timesteps


@pytest.mark.parametrize(("frames", "max_batch", "expected"), [
    ([frame("a"), frame("b"), frame("c")], {"m": 2}, [["a1", "b1"], ["c1"]]),
    ([frame("a"), frame("b")], {}, [["a1"], ["b1"]]),  # an unknown model: one frame a call
    ([frame("a"), frame("b", model="n"), frame("c")], {"m": 4, "n": 4}, [["a1", "c1"], ["b1"]]),
    ([frame("a"), frame("b", params=BIG), frame("c")], {"m": 4}, [["a1", "c1"], ["b1"]]),  # sizes never mix
    ([frame("a", strength=0.6), frame("b", strength=0.9), frame("c", strength=1.0)], {"m": 4},
     [["a1", "b1"], ["c1"]]),  # 0.6 and 0.9 of 2 steps both denoise 1 step; 1.0 denoises 2
    ([frame("a", strength=0.1), frame("b", strength=0.5)], {"m": 4}, [["a1", "b1"]]),  # at least one step
    ([frame("a", 1), frame("b", 1), frame("a", 2)], {"m": 4}, [["a2", "b1"]]),  # the newest frame of a
    ([], {"m": 4}, []),
])
def test_it_groups_compatible_frames_into_batches(frames: list[QueuedFrame], max_batch: dict[str, int],
                                                  expected: list[list[str]]) -> None:
    batches = group_frames(frames, max_batch)

    assert [[f"{f.session_id}{f.seq}" for f in batch] for batch in batches] == expected


def test_it_keeps_only_the_newest_queued_frame_of_a_session() -> None:
    queue = FrameQueue()

    assert queue.put(frame("a", 1)) is True  # it was empty: wake the thread
    assert queue.put(frame("b", 1)) is False
    assert queue.put(frame("a", 3)) is False
    assert queue.put(frame("a", 2)) is False  # older than the one queued: dropped
    queue.drop_session("b")
    assert [(f.session_id, f.seq) for f in queue.take()] == [("a", 3)]
    assert queue.take() == []


class RecordingPipeline:
    rung = "full"

    def __init__(self) -> None:
        self.requests: list[FrameRequest] = []

    def check_inputs(self, params: Any) -> Any:
        raise NotImplementedError

    def generate_frames(self, request: FrameRequest) -> list[Any]:
        from PIL import Image

        self.requests.append(request)
        return [Image.new("RGB", (request.width, request.height)) for _ in request.prompts]


def test_it_runs_a_batch_with_each_frames_own_prompt_and_seed_and_skips_undecodable_frames() -> None:
    pipeline, posted, done = RecordingPipeline(), [], threading.Event()

    def post(message: dict[str, Any]) -> None:
        posted.append(message)
        if len(posted) == 2:
            done.set()

    runner = FrameRunner({"m": pipeline}, {"m": 4}, post)
    a = frame("a", 5, image=png_b64((255, 0, 0)), params=DEFAULT, strength=0.7)
    b = frame("b", 9, image=png_b64((0, 0, 255)), params=SessionParams(64, 64, 2, 7.5, seed=42), strength=0.6)
    for queued in (a, frame("bad", 1, image="bm90IGFuIGltYWdl"), b):
        runner.queue.put(queued)

    assert runner.run_pending() == 1
    assert done.wait(10)
    runner.close()
    (request,) = pipeline.requests
    assert request.prompts == ["a 5", "b 9"] and request.seeds == [1, 42]
    assert request.strength == call_strength(2, 1) and request.steps == 2
    assert [(m["session_id"], m["seq"], m["batch_size"]) for m in posted] == [("a", 5, 2), ("b", 9, 2)]
    assert base64.b64decode(posted[0]["image"])[:2] == b"\xff\xd8"  # JPEG


@pytest.mark.parametrize(("slots", "max_batch", "expected"), [
    ({"m": 8, "n": 2}, None, {"m": 8, "n": 2}),  # no --max-batch: as many frames a call as slots
    ({"m": 8, "n": 2}, 4, {"m": 4, "n": 2}),
    ({"m": 8, "n": 2}, 1, {"m": 1, "n": 1}),  # --max-batch 1: batching off
    ({"m": 0}, None, {"m": 1}),  # at least one frame a call
    ({}, 4, {}),
])
def test_it_caps_frames_per_call_at_the_max_batch(slots: dict[str, int], max_batch: int | None,
                                                  expected: dict[str, int]) -> None:
    assert batch_limits(slots, max_batch) == expected


@pytest.mark.parametrize(("last_call", "max_batch", "expected"), [
    (0.100, {"m": 4}, 0.025),  # a quarter of the last call
    (1.000, {"m": 4}, 0.05),  # capped
    (0.100, {"m": 1}, 0.0),  # batching off: nothing to gather
    (0.100, {"m": 1, "n": 2}, 0.025),
    (0.0, {"m": 4}, 0.0),  # nothing ran yet
    (0.100, {}, 0.0),
])
def test_it_sizes_the_gather_window_from_the_last_call(last_call: float, max_batch: dict[str, int],
                                                      expected: float) -> None:
    assert gather_window(last_call, max_batch) == pytest.approx(expected)


@pytest.mark.parametrize(("last_ran", "now", "horizon", "expected"), [
    ({"a": 10.0, "b": 9.5, "c": 8.0}, 10.2, 1.0, {"a", "b"}),  # c stopped drawing
    ({"a": 10.0}, 11.0, 1.0, {"a"}),  # within the horizon means at most it
    ({}, 10.0, 1.0, set()),
])
def test_it_waits_only_for_sessions_that_drew_lately(last_ran: dict[str, float], now: float, horizon: float,
                                                     expected: set[str]) -> None:
    assert active_sessions(last_ran, now=now, horizon=horizon) == expected


@pytest.mark.parametrize(("now", "pending", "active", "first_received", "last_end", "window", "expected"), [
    (10.00, {"a", "b"}, {"a", "b"}, 9.99, 9.98, 0.05, 0.0),  # everyone is in: run now
    (10.00, {"a", "b", "c"}, {"a", "b"}, 9.99, 9.98, 0.05, 0.0),  # a newcomer never holds a batch up
    (10.00, {"a"}, set(), 9.99, 9.98, 0.05, 0.0),  # a lone new session: run now
    (10.00, {"a"}, {"a", "b"}, 9.99, 9.98, 0.05, 0.04),  # b's round trip: wait from the later start
    (10.00, {"a"}, {"a", "b"}, 9.00, 9.98, 0.05, 0.03),  # a waited through the last batch: from its end
    (10.00, {"a"}, {"a", "b"}, 9.99, 9.90, 0.05, 0.04),
    (10.00, {"a"}, {"a", "b"}, 9.90, 9.80, 0.05, -0.05),  # the window is over: run now
    (10.00, {"a"}, {"a", "b"}, 9.99, 9.98, 0.0, 0.0),  # no window (batching off)
    (10.00, set(), {"a"}, 9.99, 9.98, 0.05, 0.0),  # nothing pending
])
def test_it_gathers_frames_for_at_most_the_window(now: float, pending: set[str], active: set[str],
                                                  first_received: float, last_end: float, window: float,
                                                  expected: float) -> None:
    waited = gather_wait(now=now, pending=pending, active=active, first_received=first_received,
                         last_end=last_end, window=window)

    assert waited == pytest.approx(expected) if expected > 0 else waited <= 0


class SteppingClock:
    """A clock that moves `step` seconds at each reading (0: frozen)."""

    def __init__(self, now: float = 100.0, step: float = 0.0) -> None:
        self.now, self.step = now, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def runner_after_a_batch_of(sessions: list[str], clock: SteppingClock, **runner: Any) -> tuple[FrameRunner, Any]:
    """A runner that just ran one batch of these sessions, each call reading 0.1 s off the clock."""
    pipeline = RecordingPipeline()
    frames_runner = FrameRunner({"m": pipeline}, {"m": 8}, lambda message: None, clock=clock, **runner)
    for session in sessions:
        frames_runner.queue.put(frame(session, 1, image=png_b64((0, 0, 0))))
    clock.step = 0.05  # started, then ended: a 0.1 s call whatever else reads the clock
    assert frames_runner.run_pending() == 1
    clock.step = 0.0
    return frames_runner, pipeline


def test_it_runs_at_once_when_every_session_of_the_last_batch_sent_again() -> None:
    runner, pipeline = runner_after_a_batch_of(["a", "b", "c", "d"], SteppingClock())
    for session in "dcba":
        runner.queue.put(frame(session, 2, image=png_b64((0, 0, 0))))

    assert runner.run_pending() == 1
    runner.close()
    assert [len(request.prompts) for request in pipeline.requests] == [4, 4]


def test_it_waits_for_a_session_of_the_last_batch_until_its_frame_comes() -> None:
    clock = SteppingClock()
    runner, pipeline = runner_after_a_batch_of(["a", "b"], clock)
    runner.queue.put(frame("a", 2, image=png_b64((0, 0, 0))))
    ran: list[int] = []
    thread = threading.Thread(target=lambda: ran.append(runner.run_pending()))
    thread.start()  # the clock stands still: the window never ends, so it waits for b
    runner.queue.put(frame("b", 2, image=png_b64((0, 0, 0))))
    thread.join(TEST_SECONDS)

    assert not thread.is_alive() and ran == [1]
    runner.close()
    assert [request.prompts for request in pipeline.requests] == [["a 1", "b 1"], ["a 2", "b 2"]]


@pytest.mark.parametrize(("after", "gather", "end"), [
    (0.03, True, None),  # the window (a quarter of the last 0.1 s call) is over
    (0.0, False, None),  # between a job's steps: no gathering
    (0.0, True, "b"),  # b ended
])
def test_it_runs_what_it_has_when_it_need_not_wait(after: float, gather: bool, end: str | None) -> None:
    clock = SteppingClock()
    runner, pipeline = runner_after_a_batch_of(["a", "b"], clock)
    clock.now += after
    if end is not None:
        runner.drop_session(end)
    runner.queue.put(frame("a", 2, image=png_b64((0, 0, 0))))

    assert runner.run_pending(gather=gather) == 1
    runner.close()
    assert [request.prompts for request in pipeline.requests] == [["a 1", "b 1"], ["a 2"]]


def test_it_never_waits_with_batching_off() -> None:
    runner, pipeline = runner_after_a_batch_of(["a", "b"], SteppingClock())  # the clock stands still
    runner.cap_batches(1)
    runner.queue.put(frame("a", 2, image=png_b64((0, 0, 0))))

    assert runner.max_batch == {"m": 1} and runner.run_pending() == 1  # b is not waited for
    runner.close()
    assert [len(request.prompts) for request in pipeline.requests] == [2, 1]


def test_it_stops_gathering_when_the_queue_is_cleared() -> None:
    runner, _ = runner_after_a_batch_of(["a", "b"], SteppingClock())
    runner.queue.put(frame("a", 2, image=png_b64((0, 0, 0))))
    ran: list[int] = []
    thread = threading.Thread(target=lambda: ran.append(runner.run_pending()))
    thread.start()
    runner.close()  # the worker stops
    thread.join(TEST_SECONDS)

    assert not thread.is_alive() and ran == [0]


def test_it_refuses_a_session_when_its_model_has_no_free_slot() -> None:
    table = SessionTable({"m": 2})
    table.add(LiveSession("a", "m", DEFAULT))
    table.add(LiveSession("b", "m", DEFAULT))

    assert table.free("m") == 0 and table.free("other") == 0
    table.remove("a")
    assert table.free("m") == 1 and table.in_use("m") == 1


def test_it_fills_in_the_session_defaults_and_checks_params_with_the_pipeline(tiny_pipeline: Any) -> None:
    rng = random.Random(0)

    assert session_params({}, CAPACITY, tiny_pipeline, rng).width == 64
    chosen = session_params({"width": 128, "steps": 4, "seed": 7, "extra": 1}, CAPACITY, tiny_pipeline, rng)
    assert chosen == SessionParams(width=128, height=64, steps=4, guidance_scale=7.5, seed=7)
    for bad in ({"width": "64"}, {"width": 64.0}, {"steps": True}, {"width": 100}, {"steps": 0}, [1]):
        with pytest.raises(ParamsRefused):
            session_params(bad, CAPACITY, tiny_pipeline, rng)


@pytest.mark.parametrize("message", [
    {"seq": "1", "image": "AAAA"}, {"seq": 1}, {"seq": 1, "image": ""}, {"seq": 1, "image": "AAAA", "params": []},
    {"seq": 1, "image": "AAAA", "params": {"prompt": 3}}, {"seq": 1, "image": "AAAA", "params": {"strength": 2}},
    {"seq": True, "image": "AAAA"}])
def test_it_rejects_a_malformed_frame(message: dict[str, Any]) -> None:
    with pytest.raises(MessageError):
        order = parse_api_message({"type": "frame", "session_id": "a", **message})
        frame_of(order, LiveSession("a", "m", DEFAULT), 0.0)  # type: ignore[arg-type]  # a frame, if parsed


def test_it_gives_each_frame_of_a_batch_what_it_would_get_alone(tiny_pipeline: Any) -> None:
    from PIL import Image

    red, blue = Image.new("RGB", (64, 64), (220, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 220))

    def request(prompts: list[str], images: list[Any], seeds: list[int]) -> FrameRequest:
        return FrameRequest(prompts=prompts, images=images, seeds=seeds, width=64, height=64, steps=2,
                            guidance_scale=7.5, strength=1.0)

    batched = tiny_pipeline.generate_frames(request(["a red cat", "the blue sea"], [red, blue], [1, 2]))
    alone = [tiny_pipeline.generate_frames(request([p], [i], [s]))[0]
             for p, i, s in (("a red cat", red, 1), ("the blue sea", blue, 2))]

    assert [image.size for image in batched] == [(64, 64), (64, 64)]
    for together, solo in zip(batched, alone, strict=True):
        difference = np.abs(np.asarray(together, dtype=int) - np.asarray(solo, dtype=int))
        assert difference.max() <= 2  # float rounding in the batched UNet, no more
    assert not np.array_equal(np.asarray(batched[0]), np.asarray(batched[1]))
