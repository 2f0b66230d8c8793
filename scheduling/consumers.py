"""The account's job socket /ws/jobs/: translates the job events of scheduling.events (every API
process's, through the account's group) into `job` and `job_progress` messages for the client.
The story: docs/protocol.md, "Job events"."""
from __future__ import annotations

import json
import uuid
from functools import partial
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from django.conf import settings

from potocolom.protocol import close_codes
from potocolom.protocol.events import JobChanged, JobProgressed
from potocolom.transport import relay
from potocolom.transport.relay import RelayConsumer
from potocolom.web.errors import close_code_of
from potocolom.web.socket_limit import socket_seats
from potocolom.web.sockets import presented_token, socket_account
from scheduling.errors import SocketLimitReached
from scheduling.events import account_group, job_of_snapshot
from scheduling.serializers import job_payload

MAX_JOB_FILTERS = 200  # `?job_id=` values one socket may name
RENDERED = "rendered"  # an event's field (in this process only) holding its text per host, once rendered

JPEG_DATA_URL = "data:image/jpeg;base64,"  # a worker's preview is bare base64 JPEG; browsers get a data URL


class JobEventsConsumer(RelayConsumer):
    """One client's view of its account's jobs (all of them, or the `?job_id=` ones)."""

    account_id: str | None = None
    group: str | None = None
    job_ids: frozenset[str] = frozenset()
    origin = ""

    async def connect(self) -> None:
        """Listen to the account's job events, then accept: once the client sees the socket open,
        every event of what it does next reaches it. Or accept and close at once with the code that
        says why not (4000 a bad job_id, 4001 no account, 4003 the account holds
        ACCOUNT_SOCKET_LIMIT sockets)."""
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        wanted = query.get("job_id", [])
        if len(wanted) > MAX_JOB_FILTERS or not all(_is_uuid(job_id) for job_id in wanted):
            await self._refuse(close_codes.BAD_QUERY, "job_id must be job ids (UUIDs), at most 200")
            return
        account = await database_sync_to_async(socket_account)(
            user=self.scope.get("user"), token=presented_token(self.scope))
        if account is None:
            await self._refuse(close_codes.NOT_AUTHENTICATED, "not authenticated")
            return
        limit, seats = settings.ACCOUNT_SOCKET_LIMIT, socket_seats()
        async with seats.turn(str(account.pk)):  # the account's sockets in the order they came
            # its place first (events are prepared only for accounts with a place taken), then in
            # the group; events that come before connect returns wait in this channel's inbox
            taken = await seats.take(account=str(account.pk), socket=self.channel_name, limit=limit)
            if taken:
                self.group = account_group(account.pk)
                await relay.group_membership(self.channel_layer, self.group, self.channel_name)
        if not taken:
            error = SocketLimitReached(f"the account already holds {limit} job sockets")
            await self._refuse(close_code_of(error), str(error.detail))
            return
        self.job_ids = frozenset(str(uuid.UUID(job_id)) for job_id in wanted)
        self.account_id = str(account.pk)
        self.origin = self._origin()
        await self.accept()

    async def _refuse(self, code: int, reason: str) -> None:
        """Accept and close at once (a close code reaches only an accepted socket)."""
        await self.accept()
        await self.close(code=code, reason=reason)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """The client has nothing to say on this socket: what it sends is ignored."""

    async def disconnect(self, code: int) -> None:
        """Leave the account's group, and free the socket's place in the account's count."""
        if self.group is not None:
            group, self.group = self.group, None
            await relay.group_membership(self.channel_layer, group, self.channel_name, join=False)
        await socket_seats().release(socket=self.channel_name)

    # events from scheduling.events

    async def jobs_job(self, event: dict[str, Any]) -> None:
        """A job of the account changed state: the job as GET /api/v1/jobs/ID/ shows it."""
        changed = JobChanged.parse(event)
        job, position, eta = job_of_snapshot(changed.job)
        if not self._wants(changed.account, str(job.id)):
            return
        # One event reaches every socket of the account in this process as one message: rendered
        # once per host the sockets came to, not once per socket (300 sockets, one render).
        rendered: dict[str, str] = event.setdefault(RENDERED, {})
        text = rendered.get(self.origin)
        if text is None:
            render = partial(job_payload, job, position=position, eta_seconds=eta, image_url=self._absolute)
            # a job with a webhook shows its delivery, read from the database
            payload = await database_sync_to_async(render)() if job.webhook_url else render()
            text = rendered[self.origin] = json.dumps({"type": "job", "job": payload})
        await self.send(text_data=text)

    async def jobs_progress(self, event: dict[str, Any]) -> None:
        """A worker's job_progress for a job of the account, its preview as sent (the worker's base64
        JPEG as the data URL the contract gives browsers)."""
        progress = JobProgressed.parse(event)
        if not self._wants(progress.account, progress.job_id):
            return
        message: dict[str, Any] = {"type": "job_progress", "job_id": progress.job_id, "step": progress.step,
                                   "steps": progress.steps}
        if progress.preview is not None:
            preview = progress.preview
            message["preview"] = preview if preview.startswith("data:") else JPEG_DATA_URL + preview
        await self.send(text_data=json.dumps(message))

    def _wants(self, account: str, job_id: str) -> bool:
        """Only the account's own events, and of those the jobs named, when some were."""
        return (self.account_id is not None and account == self.account_id
                and (not self.job_ids or job_id in self.job_ids))

    def _origin(self) -> str:
        """scheme://host of the URLs in a job (its images), as REST writes them for this host."""
        host = next((bytes(value).decode("latin-1") for name, value in self.scope.get("headers", [])
                     if name.lower() == b"host"), None)
        if not host:
            server = self.scope.get("server") or ("localhost", None)
            host = server[0] if server[1] in (None, 80, 443) else f"{server[0]}:{server[1]}"
        secure = settings.HTTPS or self.scope.get("scheme") == "wss"
        return f"{'https' if secure else 'http'}://{host}"

    def _absolute(self, path: str) -> str:
        return self.origin + path


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
