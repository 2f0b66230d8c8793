"""Standard Webhooks signing: an account's secret (`whsec_` + base64 of 32 random bytes) and the
three headers of an attempt, signed with the `standardwebhooks` library (HMAC-SHA256 over
"{webhook-id}.{webhook-timestamp}.{body}"). The story: docs/protocol.md, "Webhooks"."""
from __future__ import annotations

import base64
import math
import secrets
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def signed_headers(*, secret: str, webhook_id: str, at: datetime, body: str) -> dict[str, str]:
    """The webhook-id, webhook-timestamp (Unix seconds of `at`) and webhook-signature headers."""
    seconds = math.floor(at.timestamp())
    signature = Webhook(secret).sign(webhook_id, datetime.fromtimestamp(seconds, UTC), body)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(seconds), "webhook-signature": signature}
