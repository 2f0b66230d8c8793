"""Reads and writes of webhooks: an account's secret (made on first use, rotated), the due deliveries,
a delivery's claim by one process (compare-and-set on its due_at), its body fixed once, and each
attempt recorded as policy.after_attempt decides. The story: docs/operations.md, "Webhooks"."""
from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import F, Min, Window
from django.db.models.functions import RowNumber

from scheduling.models import WebhookDelivery, WebhookSecret, WebhookState
from scheduling.webhooks.policy import DueDelivery, after_attempt
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


def webhook_deliveries_due(*, now: datetime, per_account: int, limit: int,
                           skip_accounts: Collection[int] = ()) -> list[DueDelivery]:
    """Deliveries due at `now`, at most `per_account` of each account (its earliest) and `limit` in
    all, every account's earliest first, none of `skip_accounts` (no room left in this process)."""
    turn = Window(RowNumber(), partition_by=[F("job__account_id")], order_by=[F("due_at").asc(), F("id").asc()])
    rows = (WebhookDelivery.objects.filter(state=WebhookState.PENDING, due_at__lte=now)
            .exclude(job__account_id__in=list(skip_accounts))
            .annotate(account_id=F("job__account_id"), turn=turn).filter(turn__lte=per_account)
            .order_by("turn", "due_at", "id").values_list("id", "account_id", "due_at")[:limit])
    return [DueDelivery(id=row_id, account_id=account_id, due_at=due_at) for row_id, account_id, due_at in rows
            if due_at is not None]


def webhook_deliveries_claim(*, due: Iterable[DueDelivery], now: datetime,
                             lease_seconds: float) -> list[WebhookDelivery]:
    """Claim these due deliveries for this process: each one's due_at moves to the end of its claim
    in a compare-and-set, so that of several processes exactly one attempts it (and one that dies
    mid-attempt leaves it due again once its claim lapses). The ones claimed, read anew."""
    claimed: list[WebhookDelivery] = []
    until = now + timedelta(seconds=lease_seconds)
    for each in due:
        if WebhookDelivery.objects.filter(id=each.id, state=WebhookState.PENDING, due_at=each.due_at).update(
                due_at=until):
            delivery = WebhookDelivery.objects.select_related("job", "job__account").filter(id=each.id).first()
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
                            max_attempts: int, at: datetime | None = None) -> bool:
    """Record an attempt begun `at` (default `now`) and ended at `now`, under this process's claim
    (delivery.due_at), and what comes next: delivered, failed, or due again after the backoff from
    `now`. False when the claim had lapsed and another process claimed it meanwhile (its record stands)."""
    begun = at or now
    attempts = [*delivery.attempts, {"at": begun.isoformat().replace("+00:00", "Z"), "status_code": result.status_code,
                                     "error": result.error, "duration_ms": result.duration_ms}]
    decision = after_attempt(status_code=result.status_code, attempts_made=len(attempts),
                             max_attempts=max_attempts, now=now)
    recorded = WebhookDelivery.objects.filter(id=delivery.id, state=WebhookState.PENDING,
                                              due_at=delivery.due_at).update(
        attempts=attempts, state=decision.state, due_at=decision.due_at) == 1
    if recorded:
        delivery.attempts, delivery.state, delivery.due_at = attempts, decision.state, decision.due_at
    return recorded


def webhook_next_due(*, skip_accounts: Collection[int] = ()) -> datetime | None:
    """When the earliest pending delivery is due (a claimed one: when its claim lapses), leaving out
    `skip_accounts` (those with no room left in this process: an attempt ending wakes the runner)."""
    pending = WebhookDelivery.objects.filter(state=WebhookState.PENDING)
    if skip_accounts:
        pending = pending.exclude(job__account_id__in=list(skip_accounts))
    return pending.aggregate(next=Min("due_at"))["next"]
