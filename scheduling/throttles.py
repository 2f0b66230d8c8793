"""How often an account may submit jobs (JOB_SUBMIT_RATE), across every API process: two counters
per account estimate the sliding window, one Lua script on Redis (else Django's cache). Why not
DRF's own: docs/design/http.md, "Submission rate"."""
from __future__ import annotations

import math
import threading
from typing import Any

from django.conf import settings
from rest_framework.throttling import UserRateThrottle

from potocolom.runtime import Slot, runtime
from scheduling.queues.redis import redis_client_from_url

# KEYS[1] this window's counter, KEYS[2] the last one's; ARGV[1] limit, ARGV[2] elapsed (0..1),
# ARGV[3] the counter's lifetime (s) -> {1, 0, 0} allowed (and counted), or {0, previous, current}
_SLIDING = """
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if previous * (1 - tonumber(ARGV[2])) + current >= tonumber(ARGV[1]) then return {0, previous, current} end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, 0, 0}
"""


class SlidingScripts:
    """This process's sliding-window script per Redis (URL, connect timeout, read timeout), made once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.scripts: dict[tuple[str, float | None, float | None], Any] = {}

    def on(self, where: tuple[str, float | None, float | None]) -> Any:
        with self.lock:
            if where not in self.scripts:
                url, connect_timeout, read_timeout = where
                client = redis_client_from_url(url, socket_connect_timeout=connect_timeout,
                                               socket_timeout=read_timeout)
                self.scripts[where] = client.register_script(_SLIDING)
            return self.scripts[where]


SLIDING_SCRIPTS = Slot("scheduling.throttles", make=SlidingScripts)


def _redis_cache() -> tuple[str, float | None, float | None] | None:
    """Where the default cache lives, when it is Redis: (URL, connect timeout, read timeout)."""
    cache: dict[str, Any] = settings.CACHES.get("default", {})
    if not str(cache.get("BACKEND", "")).endswith("RedisCache"):
        return None
    location = cache.get("LOCATION")
    url = location[0] if isinstance(location, (list, tuple)) else str(location)
    options: dict[str, Any] = cache.get("OPTIONS") or {}
    return url, options.get("socket_connect_timeout"), options.get("socket_timeout")


def _script(where: tuple[str, float | None, float | None]) -> Any:
    """The sliding-window script on this process's client for the cache's Redis (made once)."""
    return runtime.get(SLIDING_SCRIPTS).on(where)


def sliding_count(*, previous: int, current: int, elapsed: float) -> float:
    """Requests in the sliding window ending now, from the counts of the last fixed window and this
    one, `elapsed` (0..1) of the way through this one."""
    return previous * (1.0 - elapsed) + current


def seconds_until_allowed(*, previous: int, current: int, elapsed: float, limit: int, duration: float) -> float:
    """How long until `sliding_count` drops below `limit` (the Retry-After)."""
    if current >= limit:  # this window alone is full: its end, and then the next one starts from it
        rest = 1.0 - elapsed
        return duration * (rest + max(0.0, 1.0 - limit / current))
    if previous <= 0:
        return 0.0
    needed = 1.0 - (limit - current) / previous  # the elapsed fraction at which the estimate fits
    return max(0.0, needed - elapsed) * duration


class JobSubmitThrottle(UserRateThrottle):
    """Submissions per account; over the rate, DRF's Throttled (429 `throttled` with Retry-After)."""

    scope = "job_submit"
    num_requests: int  # set by SimpleRateThrottle.__init__ from the rate
    duration: int
    _wait: float

    def get_rate(self) -> str:
        # Read at each request, not frozen when DRF's settings were first imported.
        return str(settings.JOB_SUBMIT_RATE)

    def allow_request(self, request: Any, view: Any) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        now = self.timer()
        window, into = divmod(now, self.duration)
        current_key, previous_key = f"{key}:{int(window)}", f"{key}:{int(window) - 1}"
        elapsed = into / self.duration
        lifetime = math.ceil(2 * self.duration)  # a window's counter is the `previous` of the next one
        if where := _redis_cache():  # the cache's own Redis, in one round trip
            prefix = f"{settings.CACHES['default'].get('KEY_PREFIX', '')}:throttle:"
            # a Redis error answers 503 unavailable, as any (potocolom.web.errors)
            allowed, previous, current = _script(where)(keys=[prefix + current_key, prefix + previous_key],
                                                        args=[self.num_requests, repr(elapsed), lifetime])
            if allowed:
                return True
            previous, current = int(previous), int(current)
        else:
            counts = self.cache.get_many([current_key, previous_key])
            previous, current = int(counts.get(previous_key, 0)), int(counts.get(current_key, 0))
            if sliding_count(previous=previous, current=current, elapsed=elapsed) < self.num_requests:
                if not self.cache.add(current_key, 1, timeout=lifetime):
                    try:
                        self.cache.incr(current_key)
                    except ValueError:  # expired between add and incr
                        self.cache.set(current_key, 1, timeout=lifetime)
                return True
        self._wait = seconds_until_allowed(previous=previous, current=current, elapsed=elapsed,
                                           limit=self.num_requests, duration=self.duration)
        return False

    def wait(self) -> float | None:
        return max(1.0, float(getattr(self, "_wait", self.duration)))


class JobControlThrottle(JobSubmitThrottle):
    """Pauses and resumes per account, together, at JOB_SUBMIT_RATE on a counter of their own: each
    takes a job out of the queue or puts it back (a held one's pause costs its worker a preemption),
    work a submission's worth; a client's submissions never use up its pauses, nor the reverse."""

    scope = "job_control"
