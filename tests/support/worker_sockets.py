"""The worker-socket tests' fixtures, a pytest plugin loaded by tests/conftest.py: a worker token
beside a registered model, sockets that present their token in the handshake's Authorization
header, and v2 hellos."""
from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import FakeWorker, hello


@pytest.fixture
def token(db) -> str:
    """A worker token (its name "hosts"), and the model tiny-a registered."""
    from tests.helpers import register_model
    from workers.services import worker_token_create

    register_model("tiny-a")
    return worker_token_create(name="hosts")


def hello_v2(worker_id: str, models: list[str], jobs: list[str] | None = None) -> dict[str, Any]:
    """A v2 worker's hello: `"protocol": 2` and the jobs it holds."""
    return {**hello(worker_id, models), "protocol": 2, "jobs": list(jobs or [])}


class V2Worker(FakeWorker):
    """A worker that says `"protocol": 2` in its hello (and lists the jobs it holds)."""

    async def join(self, models: list[str], jobs: list[str] | None = None) -> dict[str, Any]:
        await self.connect()
        await self.send(hello_v2(self.worker_id, models, jobs))
        welcome = await self.receive()
        assert welcome["type"] == "welcome", welcome
        return welcome


class HeaderWorker(FakeWorker):
    """A worker whose handshake carries `Authorization: <authorization>` and no token in the URL."""

    def __init__(self, authorization: str, worker_id: str = "host-a:0", *, query: str = "") -> None:
        from channels.testing import WebsocketCommunicator

        from potocolom.asgi import application

        self.worker_id = worker_id
        self.communicator = WebsocketCommunicator(application, "/ws/worker/" + query,
                                                  headers=[(b"authorization", authorization.encode("latin-1"))])
        self.closed = False


@pytest.fixture
async def v2_workers(token):
    """Like the `workers` fixture, for v2 workers."""
    from tests.helpers import close_sync_thread_connections

    made: list[V2Worker] = []

    def make(worker_id: str = "host-a:0", *, token: str | None = token) -> V2Worker:
        made.append(V2Worker(token, worker_id))
        return made[-1]

    yield make
    for worker in made:
        await worker.close()
    await close_sync_thread_connections()


@pytest.fixture
async def header_workers():
    """Factory of HeaderWorker sockets; every one still open is closed at the end."""
    from tests.helpers import close_sync_thread_connections

    made: list[HeaderWorker] = []

    def make(authorization: str, worker_id: str = "host-a:0", **options: Any) -> HeaderWorker:
        made.append(HeaderWorker(authorization, worker_id, **options))
        return made[-1]

    yield make
    for worker in made:
        await worker.close()
    await close_sync_thread_connections()
