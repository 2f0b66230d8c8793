"""Django's HTTP side under Daphne: each request in one hop to a thread of a bounded pool of its
own, and the 413 for a body over MAX_REQUEST_BYTES before it is read. docs/design/http.md."""
from __future__ import annotations

import contextlib
import io
import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from potocolom.runtime import Slot, runtime


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
        status, headers, content = await run(wsgi_environ(scope, body))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    def _run(self, environ: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
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
