"""Writes of webhooks: an account's secret (made on first use, rotated), and a delivery's claim by
one process (compare-and-set on its due_at), its body fixed once, and each attempt recorded with
what policy.after_attempt decides. The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Min

from scheduling.models import WebhookDelivery, WebhookSecret, WebhookState
from scheduling.webhooks.policy import after_attempt
from scheduling.webhooks.sending import AttemptResult
from scheduling.webhooks.signing import new_secret


def webhook_secret_of(*, account: User, now: datetime) -> str:
    """The account's signing secret, made on first use."""
    found = WebhookSecret.objects.filter(account=account).values_list("secret", flat=True).first()
    if found:
        return found
    try:
        with transaction.atomic():
            return WebhookSecret.objects.create(account=account, secret=new_secret(), created_at=now).secret
    except IntegrityError:  # made meanwhile by another request: that one is the account's
        return WebhookSecret.objects.get(account=account).secret


def webhook_secret_rotate(*, account: User, now: datetime) -> str:
    """A new signing secret for the account; deliveries attempted from now on are signed with it."""
    secret = new_secret()
    WebhookSecret.objects.update_or_create(account=account, defaults={"secret": secret, "created_at": now})
    return secret


def webhook_deliveries_claim(*, now: datetime, limit: int, lease_seconds: float) -> list[WebhookDelivery]:
    """Claim up to `limit` due deliveries for this process: each one's due_at moves to the end of
    its claim in a compare-and-set, so that of several processes exactly one attempts it (and one
    that dies mid-attempt leaves it due again once its claim lapses)."""
    claimed: list[WebhookDelivery] = []
    until = now + timedelta(seconds=lease_seconds)
    due = (WebhookDelivery.objects.filter(state=WebhookState.PENDING, due_at__lte=now)
           .order_by("due_at", "id").values_list("id", "due_at")[:limit])
    for delivery_id, due_at in due:
        if WebhookDelivery.objects.filter(id=delivery_id, state=WebhookState.PENDING, due_at=due_at).update(
                due_at=until):
            delivery = WebhookDelivery.objects.select_related("job", "job__account").filter(id=delivery_id).first()
            if delivery is not None:  # None: its job was deleted meanwhile (the row went with it)
                claimed.append(delivery)
    return claimed


def webhook_delivery_fix_body(*, delivery: WebhookDelivery, body: str) -> str:
    """The body every attempt of this delivery sends: fixed at its first attempt."""
    if not delivery.body:
        WebhookDelivery.objects.filter(id=delivery.id, body="").update(body=body)
        delivery.body = WebhookDelivery.objects.filter(id=delivery.id).values_list("body", flat=True).get()
    return delivery.body


def webhook_delivery_record(*, delivery: WebhookDelivery, result: AttemptResult, now: datetime,
                            max_attempts: int) -> bool:
    """Record an attempt made at `now` under this process's claim (delivery.due_at), and what comes
    next: delivered, failed, or due again after the backoff. False when the claim had lapsed and
    another process claimed it meanwhile (its record stands)."""
    attempts = [*delivery.attempts, {"at": now.isoformat().replace("+00:00", "Z"), "status_code": result.status_code,
                                     "error": result.error, "duration_ms": result.duration_ms}]
    decision = after_attempt(status_code=result.status_code, attempts_made=len(attempts),
                             max_attempts=max_attempts, now=now)
    recorded = WebhookDelivery.objects.filter(id=delivery.id, state=WebhookState.PENDING,
                                              due_at=delivery.due_at).update(
        attempts=attempts, state=decision.state, due_at=decision.due_at) == 1
    if recorded:
        delivery.attempts, delivery.state, delivery.due_at = attempts, decision.state, decision.due_at
    return recorded


def webhook_next_due() -> datetime | None:
    """When the earliest pending delivery is due (a claimed one: when its claim lapses)."""
    return WebhookDelivery.objects.filter(state=WebhookState.PENDING).aggregate(next=Min("due_at"))["next"]
