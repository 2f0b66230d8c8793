"""Where a worker connects and what it says about itself: the socket's URL, its configuration, the
reconnect backoff, and the one error that ends the worker (a refused token)."""
from __future__ import annotations

import random
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER_PATH = "/ws/worker/"
RECONNECT_INITIAL_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 10.0
MAX_RESULT_BYTES = 16 * 2**20  # the contract's Daphne message limit: a bigger result could never land


class TokenRefused(RuntimeError):
    """The API refused the worker token (close code 4001): check --token, --token-file or WORKER_TOKEN."""

    def __init__(self, detail: str = "close code 4001") -> None:
        super().__init__(f"the API refused the worker token ({detail}); check --token, --token-file or WORKER_TOKEN")


class Backoff:
    """Exponential reconnect delays with jitter: 0.5 s doubling up to 10 s, each +-25 %."""

    def __init__(self, initial: float = RECONNECT_INITIAL_SECONDS, maximum: float = RECONNECT_MAX_SECONDS,
                 jitter: float = 0.25, rng: random.Random | None = None):
        self.initial, self.maximum, self.jitter = initial, maximum, jitter
        self._rng = rng or random.Random()
        self._next = initial

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        # Jitter spreads the reconnects of many workers after an API restart.
        return delay * (1 + self._rng.uniform(-self.jitter, self.jitter))

    def reset(self) -> None:
        self._next = self.initial


@dataclass(frozen=True)
class WorkerConfig:
    """Where the worker connects and what it says about itself."""

    api_url: str  # ws://HOST:PORT (http:// is taken as ws://)
    token: str
    worker_id: str
    gpu: dict[str, Any] | None = None  # {"name", "total_mib", "free_mib"}, None on CPU
    reconnect_initial_seconds: float = RECONNECT_INITIAL_SECONDS
    reconnect_max_seconds: float = RECONNECT_MAX_SECONDS
    max_result_bytes: int = MAX_RESULT_BYTES


def worker_socket_url(api_url: str) -> str:
    """`{api}/ws/worker/`, with no token in it (that goes in the Authorization header: URLs end up
    in proxy logs); raises ValueError for an address that is not ws:// or wss://."""
    parts = urllib.parse.urlsplit(api_url.strip())
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"--api must look like ws://HOST:PORT, got {api_url!r}")
    if parts.query:
        raise ValueError(f"--api takes no query string (the token goes in a header), got {api_url!r}")
    path = parts.path.rstrip("/")
    path = path + "/" if path.endswith(WORKER_PATH.rstrip("/")) else path + WORKER_PATH
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, "", ""))


def auth_headers(token: str) -> dict[str, str]:
    """The handshake headers that carry the worker token: `Authorization: Token T`."""
    return {"Authorization": f"Token {check_token(token, 'the worker token')}"}


def check_token(token: str, where: str) -> str:
    """A token stripped of surrounding whitespace (a file's trailing newline); ValueError when it
    is empty or holds whitespace or control characters (it must fit in one header line)."""
    token = token.strip()
    if not token:
        raise ValueError(f"{where} is empty")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError(f"{where} holds whitespace or control characters")
    return token


def resolve_token(*, token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """The worker token from --token, else --token-file PATH, else WORKER_TOKEN (the last two
    keep it out of the process list); ValueError with what to do when none gives one."""
    if token is not None:
        return check_token(token, "--token")
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file {token_file}: cannot read it ({exc.__class__.__name__}: {exc})") from None
        return check_token(text, f"--token-file {token_file}")
    if environ.get("WORKER_TOKEN") is not None:
        return check_token(environ["WORKER_TOKEN"], "WORKER_TOKEN")
    raise ValueError("a worker token is required: --token TOKEN, --token-file PATH or WORKER_TOKEN")
