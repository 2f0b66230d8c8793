"""Django's HTTP side under Daphne: each request in one hop to a thread of a bounded pool of its
own, each caller's requests in a lane of their own (at most HTTP_THREADS_PER_CALLER of its threads,
the rest waiting without one), and the 413 for a body over MAX_REQUEST_BYTES before it is read.
docs/design/http.md."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from potocolom.runtime import Slot, runtime
from potocolom.web.middleware import DATABASE_FAILURES


class HttpThreads:
    """The process's HTTP threads (HTTP_THREADS), each with its own database connection: a request
    that waits holds up only its thread; the sockets' database calls keep asgiref's own thread."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pool = ThreadPoolExecutor(count, thread_name_prefix="http")

    def stop(self) -> None:
        """Each thread closes its database connections (a test database can then be dropped)."""
        meet = threading.Barrier(self.count, timeout=5)

        def close_mine() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                meet.wait()  # every thread takes one: no thread closes twice while another none
            connections.close_all()

        for _ in range(self.count):
            self.pool.submit(close_mine)
        self.pool.shutdown(wait=True)


HTTP_THREADS = Slot("potocolom.web.http_threads", make=lambda: HttpThreads(settings.HTTP_THREADS),
                    stop=HttpThreads.stop)


class CallerLanes:
    """The requests in flight of each caller of this process: at most `per_caller` on the HTTP
    threads at once, the next ones waiting their turn on the event loop (no thread held, first
    come first served), at most `waiting` of them; one more is refused. So one caller whose requests
    wait (a locked row, a slow upload) holds at most `per_caller` threads, and the others keep the
    rest. A caller is its token, else its session, else its address (a guess at the account that
    costs nothing: the account itself is known only once Django has authenticated the request)."""

    def __init__(self, *, per_caller: int, waiting: int) -> None:
        self.per_caller, self.waiting = per_caller, waiting
        self._lanes: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # caller -> slots, [requests]

    @contextlib.asynccontextmanager
    async def lane(self, caller: str) -> Any:
        """Hold one of the caller's places while the block runs; LaneFull when too many wait."""
        slots, users = self._lanes.setdefault(caller, (asyncio.Semaphore(self.per_caller), [0]))
        if users[0] >= self.per_caller + self.waiting:
            raise LaneFull()
        users[0] += 1
        try:
            async with slots:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._lanes[caller]


class LaneFull(Exception):
    """A caller already has HTTP_THREADS_PER_CALLER requests running and HTTP_WAITING_PER_CALLER waiting."""


CALLER_LANES = Slot("potocolom.web.caller_lanes", make=lambda: CallerLanes(
    per_caller=settings.HTTP_THREADS_PER_CALLER, waiting=settings.HTTP_WAITING_PER_CALLER))


def caller_of(scope: dict[str, Any]) -> str:
    """Who asks, from the request's headers alone: its token, its session cookie, or its address
    (hashed: nothing secret stays in memory as such)."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization" and value[:6].lower() == b"token ":
            return "token:" + hashlib.sha256(value[6:].strip()).hexdigest()[:32]
    for name, value in scope.get("headers", []):
        if name.lower() == b"cookie" and b"sessionid=" in value:
            session = value.split(b"sessionid=", 1)[1].split(b";", 1)[0].strip()
            return "session:" + hashlib.sha256(session).hexdigest()[:32]
    client = scope.get("client") or ("", 0)
    return f"address:{client[0]}"


class OneHopWsgi:
    """An ASGI HTTP application around a WSGI application."""

    def __init__(self, wsgi_application: Callable[..., Iterable[bytes]]) -> None:
        self.wsgi_application = wsgi_application

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        limit = settings.MAX_REQUEST_BYTES
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            await send_too_large(send, limit)
            return
        body = io.BytesIO()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.write(message.get("body", b""))
            if body.tell() > limit:
                await send_too_large(send, limit)
                return
            if not message.get("more_body"):
                break
        body.seek(0)
        run = sync_to_async(self._run, thread_sensitive=False, executor=runtime.get(HTTP_THREADS).pool)
        try:
            async with runtime.get(CALLER_LANES).lane(caller_of(scope)):
                status, headers, content = await run(wsgi_environ(scope, body))
        except LaneFull:
            await send_busy(send)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    def _run(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        check_connections_if_idle(time.monotonic())
        started: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[..., None]:
            started["status"] = int(status.split(" ", 1)[0])
            started["headers"] = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
            return lambda data: None

        result = self.wsgi_application(environ, start_response)
        try:
            content = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        return started["status"], started["headers"], content


IDLE_CHECK_SECONDS = 5.0  # a connection its thread left unused this long is checked before use
_last_request = threading.local()


def check_connections_if_idle(now: float) -> None:
    """In an HTTP thread, before a request: when the thread served none for IDLE_CHECK_SECONDS, or a
    request of this process met a database failure since its last one, the request's first query
    checks the thread's kept database connection first (Django's health check, one `SELECT 1`), and
    a broken one is replaced. A connection kept across a database restart otherwise fails that
    request with 503 (the soak found one, 53 s after PostgreSQL was back, on a thread idle since).
    Busy threads in a healthy process skip the check: it would cost every request a round trip."""
    last = getattr(_last_request, "at", None)
    failures = runtime.get(DATABASE_FAILURES).seen
    stale = getattr(_last_request, "failures", failures) != failures
    _last_request.at, _last_request.failures = now, failures
    check = stale or last is None or now - last >= IDLE_CHECK_SECONDS
    for kept in connections.all(initialized_only=True):
        kept.health_check_enabled = check or bool(kept.settings_dict.get("CONN_HEALTH_CHECKS"))  # type: ignore[attr-defined]


def wsgi_environ(scope: dict[str, Any], body: io.BytesIO) -> dict[str, Any]:
    """The WSGI environ of an ASGI HTTP scope (PEP 3333)."""
    path = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    server = scope.get("server") or ("localhost", 80)
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": root,
        "PATH_INFO": path.encode("utf-8").decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1] or 80),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": body,
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if scope.get("client"):
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = scope["client"][0], str(scope["client"][1])
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        value = raw_value.decode("latin-1")
        if name == "CONTENT_LENGTH" or name == "CONTENT_TYPE":
            key = name
        else:
            key = f"HTTP_{name}"
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def declared_length(scope: dict[str, Any]) -> int | None:
    """The request's Content-Length, or None when it has none (or one that is not a number:
    Django answers that one)."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_too_large(send: Callable[..., Any], limit: int) -> None:
    """413 in the contract's error body; the connection closes so the rest of the body is not read."""
    body = json.dumps({"error": "request_too_large",
                       "detail": f"the request body is over {limit} bytes (MAX_REQUEST_BYTES)"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def send_busy(send: Callable[..., Any]) -> None:
    """429 `throttled` in the contract's error body, for a caller with too many requests in flight."""
    body = json.dumps({"error": "throttled",
                       "detail": f"too many requests of yours are in flight on this process (at most "
                                 f"{settings.HTTP_THREADS_PER_CALLER} at once and "
                                 f"{settings.HTTP_WAITING_PER_CALLER} waiting); retry shortly"}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
