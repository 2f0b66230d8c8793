"""Fixtures of the session tests: accounts with tokens, models, a worker credential, and browser
and worker sockets that are closed at the end of each test."""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.helpers import FakeWorker, close_sync_thread_connections, hello, register_model


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


class Browser:
    """The drawing page's side of /ws/session/, driven through channels' WebsocketCommunicator."""

    def __init__(self, *, headers: list[tuple[bytes, bytes]] | None = None, **query: Any) -> None:
        from channels.testing import WebsocketCommunicator

        from potocolom.asgi import application

        self.communicator = WebsocketCommunicator(application, f"/ws/session/?{urlencode(query)}", headers=headers)
        self.close_code: int | None = None
        self.disconnected = False

    async def connect(self) -> None:
        connected, _ = await self.communicator.connect(timeout=5)
        assert connected, "the session socket was not accepted"

    async def receive(self, timeout: float = 5.0) -> dict[str, Any]:
        output = await self.communicator.receive_output(timeout)
        if output["type"] == "websocket.close":
            self.close_code = output.get("code")
            raise AssertionError(f"the socket closed with {self.close_code}")
        return json.loads(output["text"])

    async def expect(self, kind: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """The next message of this type and fields; others before it are skipped."""
        while True:
            message = await self.receive(timeout)
            if message.get("type") == kind and all(message.get(k) == v for k, v in fields.items()):
                return message

    async def expect_state(self, state: str, **fields: Any) -> dict[str, Any]:
        return await self.expect("state", state=state, **fields)

    async def expect_close(self, timeout: float = 5.0) -> int | None:
        """Skip messages until the server closes the socket; its close code."""
        while True:
            output = await self.communicator.receive_output(timeout)
            if output["type"] == "websocket.close":
                self.close_code = output.get("code")
                return self.close_code

    async def silent(self, window: float = 0.2) -> bool:
        """Nothing arrives within `window` seconds (a fixed wait only to prove an absence)."""
        return await self.communicator.receive_nothing(timeout=window)

    async def send(self, message: dict[str, Any]) -> None:
        await self.communicator.send_json_to(message)

    async def send_text(self, text: str) -> None:
        await self.communicator.send_to(text_data=text)

    async def close(self) -> None:
        if not self.disconnected:
            self.disconnected = True
            if self.communicator.future.cancelled():
                return  # a receive that timed out has already stopped the consumer
            await self.communicator.disconnect(timeout=5)


@pytest.fixture
def models(db):
    register_model("tiny-a", cost=1.0)
    register_model("tiny-b", cost=2.0)
    register_model("tiny-c", cost=0.5, capabilities=("txt2img",))  # no img2img: never a session's model
    register_model("std-a", tier="standard", cost=3.0)


@pytest.fixture
def worker_token(db) -> str:
    from workers.services import worker_token_create

    return worker_token_create(name="host-a")


def token_of(account) -> str:
    from rest_framework.authtoken.models import Token

    return Token.objects.get(user=account).key


@pytest.fixture
async def sockets(db, worker_token):
    """Open browser sockets (`browser(account, ...)`) and workers (`worker(id, models, slots)`)."""
    from channels.db import database_sync_to_async

    made: list[Any] = []

    async def browser(account=None, *, connect: bool = True, token: str | None = None,
                      headers: list[tuple[bytes, bytes]] | None = None, **query: Any) -> Browser:
        if account is not None:
            query["token"] = await database_sync_to_async(token_of)(account)
        elif token is not None:
            query["token"] = token
        query.setdefault("model_id", "tiny-a")
        made.append(Browser(headers=headers, **{k: v for k, v in query.items() if v is not None}))
        if connect:
            await made[-1].connect()
        return made[-1]

    async def worker(worker_id: str = "host-a:0", models: tuple[str, ...] = ("tiny-a",), slots: int = 1,
                     frame_ms: float = 40.0) -> FakeWorker:
        made.append(FakeWorker(worker_token, worker_id))
        await made[-1].connect()
        await made[-1].send(hello(worker_id, list(models), realtime=slots > 0, frame_ms_p95=frame_ms,
                                  realtime_slots=slots))
        welcome = await made[-1].receive()
        assert welcome["type"] == "welcome", welcome
        return made[-1]

    yield browser, worker
    for sock in reversed(made):
        await sock.close()
    await close_sync_thread_connections()
