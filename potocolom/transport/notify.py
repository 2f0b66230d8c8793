"""Pushes from services to sockets, sent once the database transaction that decided them commits
(at once outside one): a consumer never hears of a state the database may still roll back."""
from __future__ import annotations

from functools import partial
from typing import Any

from django.db import transaction

from potocolom.transport import relay

SOCKET_SEND = "socket.send"  # a consumer writes the event's `message` to its client (RelayConsumer)


def socket_event(message: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The event that makes a consumer send `message` to its socket's client."""
    return {"type": SOCKET_SEND, "message": message, **extra}


def notify_after_commit(channel_name: str, event: dict[str, Any]) -> None:
    """Hand `event` to the consumer at `channel_name` once the current transaction commits."""
    transaction.on_commit(partial(relay.send_sync, channel_name, event))


def to_socket_after_commit(channel_name: str, message: dict[str, Any], **extra: Any) -> None:
    """Send a wire message to the client of the consumer at `channel_name`, after the commit."""
    notify_after_commit(channel_name, socket_event(message, **extra))
