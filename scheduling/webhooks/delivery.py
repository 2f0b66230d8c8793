"""One pass of webhook delivery: claim the due deliveries, fix each one's body (the job's
representation), sign it with its account's secret of now, look its host up again and check every
address, POST to the checked one, record the attempt. The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from scheduling.models import WebhookDelivery
from scheduling.serializers import job_payload
from scheduling.webhooks import services
from scheduling.webhooks.addresses import Target, parse_webhook_url
from scheduling.webhooks.resolving import (
    RESOLVE_SECONDS,
    Resolver,
    WebhookRefused,
    checked_address,
    configured_resolver,
)
from scheduling.webhooks.sending import AttemptResult, post
from scheduling.webhooks.signing import signed_headers

log = logging.getLogger(__name__)
Mapper = Callable[[Callable[["Attempt"], AttemptResult], Iterable["Attempt"]], Iterator[AttemptResult]]


@dataclass(frozen=True)
class Attempt:
    """What one attempt needs once the database has been read: no row, no connection."""

    url: str
    headers: dict[str, str]
    body: bytes


def webhook_body(delivery: WebhookDelivery) -> str:
    """The job's representation as GET /api/v1/jobs/ID/ gives it (URLs absolute on the origin it was
    submitted to), less its `webhook` object (this delivery's own record), as compact JSON."""
    job = delivery.job
    payload = job_payload(job, position=None, image_url=lambda path: job.webhook_origin + path)
    payload.pop("webhook", None)
    return json.dumps(payload, separators=(",", ":"))


def webhooks_deliver(*, now: datetime, resolve: Resolver | None = None, mapper: Mapper = map,
                     limit: int = 16) -> int:
    """Attempt every delivery due at `now` (up to `limit`); how many were attempted. `mapper` runs
    the network part (a thread pool's map in the runner; plain map inline)."""
    lease = settings.WEBHOOK_TIMEOUT_SECONDS + RESOLVE_SECONDS + 30.0
    claimed = services.webhook_deliveries_claim(now=now, limit=limit, lease_seconds=lease)
    if not claimed:
        return 0
    attempts = [_prepared(delivery, now=now) for delivery in claimed]
    chosen = resolve or configured_resolver()
    results = list(mapper(lambda attempt: _attempt(attempt, resolve=chosen), attempts))
    for delivery, result in zip(claimed, results, strict=True):
        if not services.webhook_delivery_record(delivery=delivery, result=result, now=now,
                                                max_attempts=settings.WEBHOOK_ATTEMPTS):
            log.warning("webhook %s: its claim lapsed before its attempt was recorded", delivery.webhook_id)
        elif result.error:
            log.info("webhook %s attempt %d: %s", delivery.webhook_id, len(delivery.attempts), result.error)
    return len(claimed)


def _prepared(delivery: WebhookDelivery, *, now: datetime) -> Attempt:
    body = services.webhook_delivery_fix_body(delivery=delivery, body=webhook_body(delivery))
    secret = services.webhook_secret_of(account=delivery.job.account, now=now)
    headers = signed_headers(secret=secret, webhook_id=delivery.webhook_id, at=now, body=body)
    return Attempt(url=delivery.url, headers=headers, body=body.encode("utf-8"))


def _attempt(attempt: Attempt, *, resolve: Resolver) -> AttemptResult:
    """Check the host again (it may resolve elsewhere since submission), then POST to the address
    that passed; a refused host is never connected to."""
    try:
        target: Target = parse_webhook_url(attempt.url)
        address = checked_address(target, allow_private=settings.WEBHOOK_ALLOW_PRIVATE, resolve=resolve)
    except (ValueError, WebhookRefused) as exc:
        return AttemptResult(None, f"refused: {exc}", 0.0)
    return post(target, address=address, headers=attempt.headers, body=attempt.body,
                timeout=settings.WEBHOOK_TIMEOUT_SECONDS)
