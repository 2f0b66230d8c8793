"""The submission throttle's arithmetic (a sliding window estimated from two fixed windows' counts),
and the throttle itself on a clock the test moves."""
from __future__ import annotations

import pytest
from django.core.cache import cache
from rest_framework.test import APIRequestFactory, force_authenticate

from scheduling.throttles import JobSubmitThrottle, seconds_until_allowed, sliding_count


@pytest.mark.parametrize(("previous", "current", "elapsed", "expected"), [
    (0, 5, 0.5, 5.0),  # nothing before: this window's count
    (10, 0, 0.0, 10.0),  # at the start of a window the last one still counts whole
    (10, 2, 0.75, 4.5),  # a quarter of the last window is still inside the sliding one
    (10, 2, 1.0, 2.0),
])
def test_the_sliding_count_weighs_the_last_window_by_what_it_still_covers(previous, current, elapsed, expected):
    assert sliding_count(previous=previous, current=current, elapsed=elapsed) == expected


def test_retry_after_is_when_the_estimate_fits_again():
    # 10 a minute; the last window had 10, this one 2, a quarter in: 9.5 -> fits once 1 - 8/10 = 0.2 passed
    assert seconds_until_allowed(previous=10, current=2, elapsed=0.1, limit=10, duration=60) == pytest.approx(6.0)
    assert seconds_until_allowed(previous=10, current=2, elapsed=0.5, limit=10, duration=60) == 0.0
    # this window alone is full: its rest, then until its own weight fits in the next
    assert seconds_until_allowed(previous=0, current=10, elapsed=0.5, limit=10, duration=60) == pytest.approx(30.0)
    assert seconds_until_allowed(previous=0, current=20, elapsed=0.5, limit=10, duration=60) == pytest.approx(60.0)


class Clocked(JobSubmitThrottle):
    now = 1_000_000.0

    def timer(self) -> float:
        return Clocked.now


@pytest.mark.django_db
def test_the_throttle_holds_the_rate_over_a_sliding_window(settings, alice):
    settings.JOB_SUBMIT_RATE = "4/minute"
    cache.clear()

    def allowed() -> bool:
        request = APIRequestFactory().post("/api/v1/jobs/")
        force_authenticate(request, user=alice)
        request.user = alice
        return Clocked().allow_request(request, None)

    Clocked.now = 60 * 20_000.0  # the start of a window
    assert [allowed() for _ in range(5)] == [True] * 4 + [False]
    Clocked.now += 90  # half way into the next window: 4 * 0.5 = 2 still count
    assert [allowed() for _ in range(3)] == [True, True, False]
    Clocked.now += 120  # two windows later: nothing counts
    assert allowed()
