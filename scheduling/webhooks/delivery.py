"""A webhook attempt's three steps: prepare (the database: its body fixed, signed with its account's
secret of now), send (the network only: look the host up again, check every address, POST to the
checked one) and record; `webhooks_deliver` runs them inline. docs/operations.md, "Webhooks"."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings

from potocolom.protocol.errors import DomainError
from scheduling.models import WebhookDelivery
from scheduling.serializers import job_payload
from scheduling.webhooks import services
from scheduling.webhooks.addresses import parse_webhook_url
from scheduling.webhooks.policy import deliveries_to_start
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


@dataclass(frozen=True)
class Attempt:
    """What one attempt needs once the database has been read: no row, no connection."""

    url: str
    account_id: int
    headers: dict[str, str]
    body: bytes


def lease_seconds() -> float:
    """How long a claim holds: one attempt's lookup and timeout, and time to record it."""
    return settings.WEBHOOK_TIMEOUT_SECONDS + RESOLVE_SECONDS + 30.0


def webhook_body(delivery: WebhookDelivery) -> str:
    """The job's representation as GET /api/v1/jobs/ID/ gives it (URLs absolute on the origin it was
    submitted to), less its `webhook` object (this delivery's own record), as compact JSON."""
    job = delivery.job
    payload = job_payload(job, position=None, image_url=lambda path: job.webhook_origin + path)
    payload.pop("webhook", None)
    return json.dumps(payload, separators=(",", ":"))


def webhook_attempt_prepare(*, delivery: WebhookDelivery, now: datetime) -> Attempt:
    """The attempt of a claimed delivery at `now`: its body (fixed at the first), signed."""
    body = services.webhook_delivery_fix_body(delivery=delivery, body=webhook_body(delivery))
    secret = services.webhook_secret_of(account=delivery.job.account, now=now)
    headers = signed_headers(secret=secret, webhook_id=delivery.webhook_id, at=now, body=body)
    return Attempt(url=delivery.url, account_id=delivery.job.account_id, headers=headers, body=body.encode("utf-8"))


def webhook_attempt_send(attempt: Attempt, *, resolve: Resolver | None = None) -> AttemptResult:
    """Check the host again (it may resolve elsewhere since submission), then POST to the address
    that passed; a refused host is never connected to. No database: a thread of its own may run it."""
    try:
        target = parse_webhook_url(attempt.url)
        address = checked_address(target, account_id=attempt.account_id, allow_private=settings.WEBHOOK_ALLOW_PRIVATE,
                                  ports=settings.WEBHOOK_PORTS, resolve=resolve or configured_resolver())
    except ValueError as exc:
        return AttemptResult(None, f"refused: {exc}", 0.0)
    except WebhookRefused as exc:
        return AttemptResult(None, f"{exc.kind}: {exc}", 0.0)
    except DomainError:  # this account's (or this process's) lookups are all under way
        return AttemptResult(None, "dns: too many lookups under way", 0.0)
    return post(target, address=address, headers=attempt.headers, body=attempt.body,
                timeout=settings.WEBHOOK_TIMEOUT_SECONDS)


def webhook_attempt_record(*, delivery: WebhookDelivery, result: AttemptResult, at: datetime, now: datetime) -> None:
    """Record the attempt begun `at` and ended `now` (and log a failure or a lapsed claim)."""
    if not services.webhook_delivery_record(delivery=delivery, result=result, at=at, now=now,
                                            max_attempts=settings.WEBHOOK_ATTEMPTS):
        log.warning("webhook %s: its claim lapsed before its attempt was recorded", delivery.webhook_id)
    elif result.error:
        log.info("webhook %s attempt %d: %s", delivery.webhook_id, len(delivery.attempts), result.error)


def webhooks_deliver(*, now: datetime, resolve: Resolver | None = None, limit: int = 16) -> int:
    """Attempt, one after another, the deliveries due at `now` (up to `limit`, each account at most
    WEBHOOK_CONCURRENCY); how many were attempted. The runner does the same with its threads."""
    due = services.webhook_deliveries_due(now=now, per_account=settings.WEBHOOK_CONCURRENCY, limit=limit)
    chosen = deliveries_to_start(due, in_flight={}, per_account=settings.WEBHOOK_CONCURRENCY, free=limit)
    claimed = services.webhook_deliveries_claim(due=chosen, now=now, lease_seconds=lease_seconds())
    for delivery in claimed:
        result = webhook_attempt_send(webhook_attempt_prepare(delivery=delivery, now=now), resolve=resolve)
        webhook_attempt_record(delivery=delivery, result=result, at=now, now=now)
    return len(claimed)
