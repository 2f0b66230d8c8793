"""Small factories and clients shared by the API-side tests: registered models, a tiny PNG,
a REST client with token auth, a fake worker socket, and a bounded wait for async outcomes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async

# The contract's example schema: `prompt` required, sizes from a short list, no additionalProperties.
PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "maxLength": 1000},
        "width": {"type": "integer", "enum": [64, 128, 256, 512]},
        "height": {"type": "integer", "enum": [64, 128, 256, 512]},
        "seed": {"type": "integer", "minimum": 0},
        "steps": {"type": "integer", "minimum": 1, "maximum": 50},
    },
}


def manifest_dict(model_id: str, *, tier: str = "draft", cost: float = 1.0,
                  capabilities: tuple[str, ...] = ("txt2img", "img2img"),
                  params_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid manifest object, as a manifest file holds it."""
    return {"model_id": model_id, "tier": tier, "cost": cost, "capabilities": list(capabilities),
            "pipeline": "StableDiffusionPipeline", "source": f"models/{model_id}",
            "params_schema": params_schema if params_schema is not None else PROMPT_SCHEMA}


def register_model(model_id: str, **fields: Any):
    """Register a model as `load_manifests` would (a ModelManifest row)."""
    from models_registry.models import ModelManifest

    data = manifest_dict(model_id, **fields)
    return ModelManifest.objects.create(**data)


def tiny_png(width: int = 1, height: int = 1, *, shade: int = 200) -> bytes:
    """A real, minimal grey PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes([shade]) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def api_client(account=None, *, raise_request_exception: bool = True):
    """DRF's APIClient with the account's API token (no credentials when account is None)."""
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    client = APIClient(raise_request_exception=raise_request_exception)
    if account is not None:
        token, _ = Token.objects.get_or_create(user=account)
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout: float = 5.0, interval: float = 0.02) -> Any:
    """Await `check()` until it returns something truthy (and return it); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s; last value: {value!r}")
        await asyncio.sleep(interval)


async def close_sync_thread_connections() -> None:
    """Close the database connections of the thread that runs database_sync_to_async calls.

    With persistent connections (CONN_MAX_AGE) that thread would keep one open after the test, and
    PostgreSQL refuses to drop a test database that still has a session."""
    from django.db import connections

    await database_sync_to_async(connections.close_all)()


def submit_jobs_now(account, count: int, *, model_id: str = "tiny-a", priority: int = 0) -> list[str]:
    """Submit `count` jobs (prompts "job 0".."job N") through the service, as REST would; their ids."""
    from django.utils import timezone

    from scheduling.services import JobRequest, job_submit

    return [str(job_submit(account=account, now=timezone.now(),
                           request=JobRequest(params={"prompt": f"job {n}"}, model_id=model_id, priority=priority)).id)
            for n in range(count)]


submit_jobs = database_sync_to_async(submit_jobs_now)


@database_sync_to_async
def job_row(job_id: str) -> dict[str, Any]:
    """A job's row as plain values (read through the sync database thread)."""
    from scheduling.models import Job

    return Job.objects.values().get(id=job_id)


@database_sync_to_async
def job_states(job_ids: list[str]) -> list[str]:
    from scheduling.models import Job

    states = dict(Job.objects.filter(id__in=job_ids).values_list("id", "state"))
    return [states[_uuid(job_id)] for job_id in job_ids]


def _uuid(job_id: str):
    import uuid

    return uuid.UUID(job_id)


def hello(worker_id: str, models: list[str], **entry: Any) -> dict[str, Any]:
    """A worker's hello serving `models` on the full rung."""
    fields = {"rung": "full", "realtime": False, "frame_ms_p95": None, "realtime_slots": 0, **entry}
    return {"type": "hello", "worker_id": worker_id, "gpu": {"name": "Fake GPU", "total_mib": 8192, "free_mib": 8000},
            "models": [{"model_id": model_id, **fields} for model_id in models]}


class FakeWorker:
    """The worker side of /ws/worker/, driven by the test through channels' WebsocketCommunicator."""

    def __init__(self, token: str | None, worker_id: str = "host-a:0") -> None:
        from channels.testing import WebsocketCommunicator

        from potocolom.asgi import application

        path = "/ws/worker/" if token is None else f"/ws/worker/?token={token}"
        self.worker_id = worker_id
        self.communicator = WebsocketCommunicator(application, path)
        self.closed = False

    async def connect(self) -> None:
        connected, _ = await self.communicator.connect(timeout=5)
        assert connected, "the worker socket was not accepted"

    async def join(self, models: list[str]) -> dict[str, Any]:
        """Connect and say hello; the welcome."""
        await self.connect()
        await self.send(hello(self.worker_id, models))
        welcome = await self.receive()
        assert welcome["type"] == "welcome", welcome
        return welcome

    async def send(self, message: dict[str, Any]) -> None:
        await self.communicator.send_json_to(message)

    async def send_text(self, text: str) -> None:
        await self.communicator.send_to(text_data=text)

    async def receive(self, timeout: float = 5.0) -> dict[str, Any]:
        output = await self.communicator.receive_output(timeout)
        assert output["type"] == "websocket.send", f"expected a message, got {output}"
        return json.loads(output["text"])

    async def receive_output(self, timeout: float = 5.0) -> dict[str, Any]:
        return await self.communicator.receive_output(timeout)

    async def jobs(self, count: int) -> list[dict[str, Any]]:
        """The next `count` messages, each a `job`."""
        messages = [await self.receive() for _ in range(count)]
        assert all(m["type"] == "job" for m in messages), messages
        return messages

    async def silent(self, window: float = 0.2) -> bool:
        """Nothing more arrives within `window` seconds (the only fixed wait: proving an absence)."""
        return await self.communicator.receive_nothing(timeout=window)

    async def drain(self, window: float = 0.3) -> list[dict[str, Any]]:
        """Every message that arrives until nothing more comes for `window` seconds."""
        messages = []
        while not await self.silent(window):
            messages.append(await self.receive())
        return messages

    async def expect_close(self, timeout: float = 5.0) -> int | None:
        """Skip messages until the server closes the socket; its close code."""
        while True:
            output = await self.communicator.receive_output(timeout)
            if output["type"] == "websocket.close":
                self.closed = True
                return output.get("code")

    async def close(self) -> None:
        """The worker's side goes away (a closed socket); waits for the consumer to finish."""
        if not getattr(self, "_disconnected", False):
            self._disconnected = True
            if self.communicator.future.cancelled():
                return  # a receive that timed out has already stopped the consumer
            await self.communicator.disconnect(timeout=5)

    # the worker's job messages

    async def started(self, job_id: str) -> None:
        await self.send({"type": "job_started", "job_id": job_id})

    async def progress(self, job_id: str, step: int, steps: int) -> None:
        await self.send({"type": "job_progress", "job_id": job_id, "step": step, "steps": steps})

    async def result(self, job_id: str, images: list[str], *, gpu_ms: float = 12.5, rung: str = "full") -> None:
        await self.send({"type": "job_result", "job_id": job_id, "images": images, "gpu_ms": gpu_ms, "rung": rung})

    async def failed(self, job_id: str, error: str) -> None:
        await self.send({"type": "job_failed", "job_id": job_id, "error": error})


@contextlib.asynccontextmanager
async def sockets_of(kind: type, token: str | None) -> AsyncIterator[Callable[..., Any]]:
    """A factory of worker sockets of `kind` presenting `token` (`make(worker_id)`); every one still
    open is closed at the end, and the sync thread's connections with them."""
    made: list[Any] = []

    def make(worker_id: str = "host-a:0") -> Any:
        made.append(kind(token, worker_id))
        return made[-1]

    try:
        yield make
    finally:
        for worker in made:
            await worker.close()
        await close_sync_thread_connections()
