"""One webhook attempt over the network: a POST to the address that was checked (never a second
lookup), the URL's host in the Host header and as the TLS server name, no redirect followed, one
deadline over it all, at most MAX_RESPONSE_BYTES read, and what failed said in our words."""
from __future__ import annotations

import errno
import http.client
import socket
import ssl
import time
from dataclasses import dataclass

from scheduling.webhooks.addresses import Target

MAX_RESPONSE_BYTES = 64 * 1024
USER_AGENT = "potocolom-webhooks/1"


@dataclass(frozen=True)
class AttemptResult:
    status_code: int | None  # None: no HTTP answer (refused, unreachable, timed out)
    error: str | None  # None: a 2xx; else in our words (error_of, "status 503")
    duration_ms: float


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a given address, verifying the certificate for the URL's host name (SNI)."""

    def __init__(self, address: str, port: int, *, server_hostname: str, timeout: float) -> None:
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self.server_hostname = server_hostname

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.server_hostname)  # type: ignore[attr-defined]


def post(target: Target, *, address: str, headers: dict[str, str], body: bytes, timeout: float) -> AttemptResult:
    """POST `body` to `target` at `address`; its status code, or the error that stopped it."""
    started = time.monotonic()
    deadline = started + timeout
    conn: http.client.HTTPConnection
    if target.scheme == "https":
        conn = _PinnedHTTPSConnection(address, target.port, server_hostname=target.host, timeout=timeout)
    else:
        conn = http.client.HTTPConnection(address, target.port, timeout=timeout)
    try:
        conn.putrequest("POST", target.path, skip_host=True, skip_accept_encoding=True)
        for name, value in {"Host": target.host_header, "User-Agent": USER_AGENT,
                            "Content-Type": "application/json", "Content-Length": str(len(body)),
                            **headers}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        _bound(conn, deadline)
        response = conn.getresponse()
        left = MAX_RESPONSE_BYTES
        while left > 0:  # read (and drop) a bounded answer, under the same deadline
            _bound(conn, deadline)
            chunk = response.read(min(8192, left))
            if not chunk:
                break
            left -= len(chunk)
        return AttemptResult(response.status, _status_error(response.status), _ms_since(started))
    except Exception as exc:  # whatever stopped it, said in our words (never the receiver's bytes)
        return AttemptResult(None, error_of(exc), _ms_since(started))
    finally:
        conn.close()


def _status_error(status: int) -> str | None:
    return None if 200 <= status <= 299 else f"status {status}"


def error_of(exc: BaseException) -> str:
    """What stopped an attempt, in our words: `timeout`, `connection_refused`, `connection_reset`,
    `unreachable`, `connection_failed`, `tls` (`tls: certificate not verified`), `bad_response` (an
    answer that is not HTTP, or cut short), `no_response`. Never the exception's text: it may quote
    what the receiver sent (http.client's BadStatusLine holds the line it read)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "tls: certificate not verified"
    if isinstance(exc, ssl.SSLError):
        return "tls"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, http.client.RemoteDisconnected):  # closed before any answer
        return "no_response"
    if isinstance(exc, http.client.HTTPException):
        return "bad_response"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(exc, ConnectionError):
        return "connection_reset"
    if isinstance(exc, OSError):
        return "unreachable" if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) else "connection_failed"
    return "bad_response" if isinstance(exc, ValueError) else "internal_error"


def _bound(conn: http.client.HTTPConnection, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the attempt ran past its timeout")
    if conn.sock is not None:
        conn.sock.settimeout(left)


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)
