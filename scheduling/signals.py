"""Signals inside scheduling where the sender must not import the receiver: a webhook delivery was
written (its job ended), so this process's delivery runner (scheduling/webhooks/runner.py) wakes.
Sent after the commit; receivers return at once (they only wake a thread)."""
from __future__ import annotations

from django.dispatch import Signal

webhook_due = Signal()  # no kwargs
