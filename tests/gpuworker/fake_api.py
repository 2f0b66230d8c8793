"""An in-process fake of the API's side of the worker socket, for testing the worker alone.

A `websockets` server on 127.0.0.1 that keeps its port across stop() and start() (an API restart),
answers every hello with a welcome, and files every message of every connection in arrival order.
With `protocol=2` it speaks v2: its welcome says so (and `checkpoint_seconds` and `preview_steps`, when given) and (with
`auto_ack`) it answers every job_result, job_failed and job_preempted with job_ack. With `token` it
checks the handshake's `Authorization: Token T` header and closes with 4001 on anything else.
Waiting is event-driven: `next_message` wakes on each message filed, it never polls or sleeps.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

WAIT_SECONDS = 30.0
WELCOME_SENT = "_welcome_sent"  # a marker filed among the messages when a welcome goes out
FINAL_TYPES = ("job_result", "job_failed", "job_preempted")
BARRIER_MODEL = "barrier-model-served-nowhere"


class FakeApi:
    """The API's side of /ws/worker/; with refuse_token it accepts, then closes with 4001."""

    def __init__(self, *, heartbeat_seconds: float = 10.0, refuse_token: bool = False,
                 unknown_models: list[str] | None = None, protocol: int | None = None, auto_ack: bool = True,
                 token: str | None = None, checkpoint_seconds: float | None = None,
                 preview_steps: int | None = None):
        self.heartbeat_seconds = heartbeat_seconds
        self.refuse_token = refuse_token
        self.unknown_models = unknown_models or []
        self.protocol = protocol  # None: a v1 API (its welcome has no protocol)
        self.auto_ack = auto_ack  # v2: answer each final message with job_ack
        self.token = token
        self.checkpoint_seconds = checkpoint_seconds  # welcome.checkpoint_seconds, when not None
        self.preview_steps = preview_steps  # welcome.preview_steps, when not None
        self.port = 0
        self.paths: list[str] = []
        self.authorizations: list[str | None] = []  # each handshake's Authorization header
        self.received: list[dict[str, Any]] = []  # each with "_connection": 1, 2, ...
        self._taken: set[int] = set()
        self._changed = asyncio.Condition()
        self._server: Server | None = None
        self._connections: list[ServerConnection] = []
        self._count = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await serve(self._serve, "127.0.0.1", self.port, max_size=None, compression=None,
                                   process_request=self._record_path)
        self.port = self._server.sockets[0].getsockname()[1]  # kept for the restart

    async def stop(self) -> None:
        """Drop every connection without a close frame, as a killed API does, and stop listening."""
        assert self._server is not None
        self._server.close(close_connections=False)
        for connection in list(self._connections):
            connection.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> FakeApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            await self.stop()

    def _record_path(self, connection: ServerConnection, request: Any) -> None:
        self.paths.append(request.path)
        self.authorizations.append(request.headers.get("Authorization"))

    async def _file(self, message: dict[str, Any]) -> None:
        async with self._changed:
            self.received.append(message)
            self._changed.notify_all()

    async def _serve(self, connection: ServerConnection) -> None:
        self._count += 1
        number = self._count
        authorization = connection.request.headers.get("Authorization") if connection.request else None
        if self.refuse_token or (self.token is not None and authorization != f"Token {self.token}"):
            await connection.close(4001, "bad token")
            return
        self._connections.append(connection)
        try:
            async for raw in connection:
                message = json.loads(raw)
                message["_connection"] = number
                await self._file(message)
                if message.get("type") == "hello":
                    welcome = {"type": "welcome", "unknown_models": self.unknown_models,
                               "heartbeat_seconds": self.heartbeat_seconds, "frame_budget_ms": 500}
                    if self.protocol is not None:
                        welcome["protocol"] = self.protocol
                    if self.checkpoint_seconds is not None:
                        welcome["checkpoint_seconds"] = self.checkpoint_seconds
                    if self.preview_steps is not None:
                        welcome["preview_steps"] = self.preview_steps
                    await connection.send(json.dumps(welcome))
                    await self._file({"type": WELCOME_SENT, "_connection": number})
                elif message.get("type") in FINAL_TYPES and self.protocol == 2 and self.auto_ack:
                    await connection.send(json.dumps({"type": "job_ack", "job_id": message["job_id"]}))
        except ConnectionClosed:
            pass
        finally:
            self._connections.remove(connection)

    # --- the test's side ------------------------------------------------------------------------

    async def send(self, message: dict[str, Any] | str) -> None:
        """To the newest open worker socket; a str goes as it is (for malformed messages)."""
        assert self._connections, "no worker socket is open"
        await self._connections[-1].send(message if isinstance(message, str) else json.dumps(message))

    async def job(self, params: dict[str, Any], model_id: str = "tiny-sd", job_id: str | None = None,
                  **v2: Any) -> str:
        """Send a job (`v2`: priority, account, resume, as a v2 API adds them); its id."""
        job_id = job_id or str(uuid.uuid4())
        await self.send({"type": "job", "job_id": job_id, "attempt": 1, "model_id": model_id, "params": params, **v2})
        return job_id

    async def next_message(self, type: str, timeout: float = WAIT_SECONDS, **fields: Any) -> dict[str, Any]:
        """The first message not yet taken with this type and these fields; waits for it."""
        return await self.next_message_of((type,), timeout, **fields)

    async def barrier(self) -> None:
        """Return once the worker has handled everything sent before: a session_start is answered
        in order, after the messages ahead of it (for a model no worker serves, it is refused)."""
        session_id = str(uuid.uuid4())
        await self.send({"type": "session_start", "session_id": session_id, "model_id": BARRIER_MODEL,
                         "params": {}})
        await self.next_message("session_refused", session_id=session_id)

    async def session_start(self, session_id: str, params: dict[str, Any] | None = None,
                            model_id: str = "tiny-sd") -> dict[str, Any]:
        """Start a session; return the worker's answer (session_accepted or session_refused)."""
        await self.send({"type": "session_start", "session_id": session_id, "model_id": model_id,
                         "params": params or {}})
        return await self.next_message_of(("session_accepted", "session_refused"), session_id=session_id)

    async def next_message_of(self, types: tuple[str, ...], timeout: float = WAIT_SECONDS,
                              **fields: Any) -> dict[str, Any]:
        """The first message not yet taken of any of these types with these fields."""
        def find() -> int | None:
            return next((i for i, m in enumerate(self.received) if i not in self._taken
                         and m.get("type") in types and all(m.get(k) == v for k, v in fields.items())), None)

        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(lambda: find() is not None)
            except TimeoutError:
                raise AssertionError(f"no {types} {fields} within {timeout}s; got {self.brief()}") from None
            index = find()
            assert index is not None
            self._taken.add(index)
            return self.received[index]

    async def frame(self, session_id: str, seq: int, image: str, prompt: str = "a sketch",
                    strength: float | None = None) -> None:
        params: dict[str, Any] = {"prompt": prompt}
        if strength is not None:
            params["strength"] = strength
        await self.send({"type": "frame", "session_id": session_id, "seq": seq, "image": image, "params": params})

    def frames_of(self, session_id: str) -> list[dict[str, Any]]:
        """Every frame_result received for a session, in order."""
        return [m for m in self.received if m.get("type") == "frame_result" and m.get("session_id") == session_id]

    async def ack(self, job_id: str) -> None:
        """Acknowledge a job's final message (for a fake made with auto_ack=False)."""
        await self.send({"type": "job_ack", "job_id": job_id})

    def about(self, job_id: str) -> list[dict[str, Any]]:
        """Every message received about a job, in order."""
        return [m for m in self.received if m.get("job_id") == job_id]

    def index_of(self, message: dict[str, Any]) -> int:
        return next(i for i, m in enumerate(self.received) if m is message)

    def brief(self) -> list[str]:
        return [f"{m.get('_connection')}:{m.get('type')}:{str(m.get('job_id', ''))[:8]}" for m in self.received]
