"""Webhook receivers for tests: a real HTTP server on 127.0.0.1 in a thread of its own, answering each
POST with the next scripted status (or hanging until released) and keeping what it got; and a server
that answers with a line that is not HTTP (docs/protocol.md, "Webhooks")."""
from __future__ import annotations

import http.server
import socket
import threading


class Receiver:
    """An HTTP server on 127.0.0.1 answering each POST with the next scripted status (then 200),
    keeping every request it got."""

    def __init__(self, statuses: list[int] | None = None, *, headers: dict[str, str] | None = None,
                 hold: threading.Event | None = None) -> None:
        self.hold = hold  # set: answer; unset: each request waits for it (a hanging receiver)
        self.statuses = list(statuses or [])
        self.extra_headers = headers or {}
        self.requests: list[dict] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.requests.append({"path": self.path, "headers": dict(self.headers.items()),
                                              "body": body})
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    receiver.arrived.notify_all()
                if receiver.hold is not None:
                    receiver.hold.wait(60)
                self.send_response(status)
                for name, value in receiver.extra_headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, *, timeout: float) -> list[dict]:
        """The requests once `count` have arrived (fails after `timeout` seconds)."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, timeout), self.requests
            return list(self.requests)

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()


class Banner:
    """A TCP server on 127.0.0.1 that answers every connection with one line that is not HTTP (an
    SSH server's banner, say), then reads until the client closes it."""

    def __init__(self, line: bytes) -> None:
        self.line = line
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:  # as an SSH server does: its banner first, then it reads what comes
                conn.settimeout(30)
                conn.sendall(self.line)
                try:
                    while conn.recv(65536):
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept under way
        except OSError:
            pass
        self.listener.close()
