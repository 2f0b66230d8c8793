"""How often an account may submit jobs (JOB_SUBMIT_RATE): DRF's own throttle over Django's
cache, which is Redis when REDIS_URL is set, so the rate holds across every API process."""
from __future__ import annotations

from django.conf import settings
from rest_framework.throttling import UserRateThrottle


class JobSubmitThrottle(UserRateThrottle):
    """Submissions per account; over the rate, DRF's Throttled (429 `throttled` with Retry-After)."""

    scope = "job_submit"

    def get_rate(self) -> str:
        # Read at each request, not frozen when DRF's settings were first imported.
        return str(settings.JOB_SUBMIT_RATE)
