"""The worker socket (docs/protocol.md, "Worker socket"): where it connects and with which token, and
`Connection`, which says hello, hands each API message to the worker, sends the outbox in order and
heartbeats, reconnecting with backoff until stopped; a refused token ends it (TokenRefused)."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from gpuworker.outbox import KEPT_WHILE_DOWN, Outbox, Outgoing
from potocolom.protocol.errors import MessageError
from potocolom.protocol.worker import PROTOCOL_V1, PROTOCOL_V2, ApiMessage, Heartbeat, Welcome, parse_api_message

log = logging.getLogger(__name__)

WORKER_PATH = "/ws/worker/"
RECONNECT_INITIAL_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 10.0
MAX_RESULT_BYTES = 16 * 2**20  # the contract's Daphne message limit: a bigger result could never land
TOKEN_REFUSED_CODE = 4001
MAX_MESSAGE_BYTES = 64 * 2**20  # jobs carry init images; be generous on what we accept
DEFAULT_HEARTBEAT_SECONDS = 10.0
OPEN_TIMEOUT_SECONDS = 10.0
CLOSE_TIMEOUT_SECONDS = 2.0


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


class Peer(Protocol):
    """What a connection asks of the worker it carries (worker.GpuWorker)."""

    def hello_message(self) -> dict[str, Any]: ...

    def welcomed(self) -> None: ...

    def receive(self, message: ApiMessage) -> None: ...

    def disconnected(self, close_code: int | None) -> None: ...

    def sent(self, out: Outgoing) -> None: ...

    def changed(self) -> None: ...


class Connection:
    """One worker's socket to the API, across reconnects: hello first, then each API message to the
    peer (a welcome it handles itself), and the outbox sent in order once welcomed.

    `welcome` is the current connection's first welcome (None until it came): its protocol and
    settings hold until the next connection. The peer hears `changed` whenever a message leaves the
    outbox or the connection stops (a drain waits on those).
    """

    def __init__(self, config: WorkerConfig, peer: Peer, *, outbox: Outbox, clock: Callable[[], float]):
        self.config = config
        self.url = worker_socket_url(config.api_url)
        self.outbox = outbox
        self.welcome: Welcome | None = None
        self.welcomes = 0  # how many connections got as far as a welcome
        self._headers = auth_headers(config.token)
        self._peer = peer
        self._clock = clock
        self._backoff = Backoff(config.reconnect_initial_seconds, config.reconnect_max_seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None  # the outbox has something to send
        self._stopped: asyncio.Event | None = None
        self._stop_asked = False
        self._ws: ClientConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the current connection's sender and heartbeat
        self._closing: asyncio.Task[None] | None = None

    @property
    def protocol(self) -> int:
        """The current connection's protocol: 2 once a v2 welcome came, else 1."""
        return self.welcome.protocol if self.welcome is not None else PROTOCOL_V1

    @property
    def v2(self) -> bool:
        """The API of the current connection said protocol 2: job_ack and cancel answers apply."""
        return self.protocol >= PROTOCOL_V2

    @property
    def checkpoint_seconds(self) -> float:
        """The current connection's welcome.checkpoint_seconds (v2; 0: none)."""
        return self.welcome.checkpoint_seconds if self.welcome is not None and self.v2 else 0.0

    @property
    def preview_steps(self) -> int:
        """The current connection's welcome.preview_steps (v2; 0: no previews)."""
        return self.welcome.preview_steps if self.welcome is not None and self.v2 else 0

    @property
    def live(self) -> bool:
        """Connected and welcomed: messages other than the kept ones only mean something now."""
        return self._ws is not None and self.welcome is not None

    @property
    def serving(self) -> bool:
        """run() has begun and stop() has not."""
        return self._stopped is not None and not self._stopped.is_set()

    def start(self) -> bool:
        """In the running event loop, before run(): False when stop() came first."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        return not self._stop_asked

    async def run(self) -> None:
        """Connect, serve and reconnect with backoff until stop(); TokenRefused on close code 4001."""
        assert self._stopped is not None, "start() first"
        while not self._stopped.is_set():
            await self._connect_once()
            if self._stopped.is_set():
                break
            delay = self._backoff.next_delay()
            log.info("reconnecting to %s in %.1f s", self.config.api_url, delay)
            try:
                await asyncio.wait_for(self._stopped.wait(), delay)
            except TimeoutError:
                pass

    def stop(self) -> None:
        """From any thread: close the socket and reconnect no more."""
        self._stop_asked = True
        self.call_soon(self._begin_stop)

    def call_soon(self, callback: Callable[..., None], *args: Any) -> bool:
        """From any thread: run `callback(*args)` on the event loop; False once the loop is gone."""
        if self._loop is None or self._loop.is_closed():
            return False
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: the worker stopped
            return False
        return True

    def enqueue(self, out: Outgoing) -> None:
        """On the event loop: queue a message (one not kept while down is dropped then)."""
        if out.kind not in KEPT_WHILE_DOWN and not self.live:
            return  # progress and heartbeats only mean something on a live connection
        self.outbox.append(out)
        if self._ready is not None:
            self._ready.set()

    def _begin_stop(self) -> None:
        assert self._stopped is not None
        self._stopped.set()
        self._peer.changed()
        if self._ws is not None:
            self._closing = asyncio.ensure_future(self._ws.close())

    async def _connect_once(self) -> None:
        """One connection, from the handshake until it closes; errors but a refused token are only logged."""
        try:
            # The token travels in the handshake's Authorization header, never in the URL (logs).
            async with connect(self.url, additional_headers=self._headers, max_size=MAX_MESSAGE_BYTES,
                               compression=None, open_timeout=OPEN_TIMEOUT_SECONDS,
                               close_timeout=CLOSE_TIMEOUT_SECONDS) as ws:
                await self._serve(ws)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise TokenRefused(f"HTTP {exc.response.status_code}") from exc
            log.warning("the API at %s rejected the handshake: %s", self.config.api_url, exc)
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            log.warning("cannot reach the API at %s: %s", self.config.api_url, exc or type(exc).__name__)

    async def _serve(self, ws: ClientConnection) -> None:
        """Say hello, then hand on messages until the socket closes."""
        assert self._stopped is not None
        if self._stopped.is_set():
            return
        self._ws, self.welcome = ws, None  # protocol 1 until this connection's welcome says otherwise
        try:
            await ws.send(json.dumps(self._peer.hello_message()))
            async for raw in ws:
                self._receive(raw)
        except ConnectionClosed:
            pass
        finally:
            self._ws = None
            self._peer.disconnected(ws.close_code)
            tasks, self._tasks = self._tasks, []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if ws.close_code == TOKEN_REFUSED_CODE:
            raise TokenRefused()

    def _receive(self, raw: str | bytes) -> None:
        """Hand on one message; a bad or unknown one is logged, never fatal."""
        try:
            message = parse_api_message(json.loads(raw))
        except ValueError as exc:  # not JSON, or off the contract (MessageError)
            log.warning("ignoring a message: %s: %.200r", exc, raw)
            return
        try:
            if isinstance(message, Welcome):
                self._welcomed(message)
            else:
                self._peer.receive(message)
        except MessageError as exc:
            log.warning("ignoring a bad %s message: %s", message.type, exc)
        except Exception:
            log.exception("error handling a %s message", message.type)

    def _welcomed(self, message: Welcome) -> None:
        """The first welcome of a connection starts its sender and heartbeat; a repeated one changes nothing."""
        period = message.heartbeat_seconds
        if period is None:
            log.warning("welcome without a usable heartbeat_seconds; using %s", DEFAULT_HEARTBEAT_SECONDS)
            period = DEFAULT_HEARTBEAT_SECONDS
        if message.unknown_models:
            log.warning("the API does not know these models, so routes nothing of them here: %s",
                        message.unknown_models)
        if self._ws is None or self.welcome is not None:
            return
        self.welcome = message
        self.welcomes += 1
        self._backoff.reset()
        log.info("welcomed by %s as %s (protocol %d, heartbeat every %s s)", self.config.api_url,
                 self.config.worker_id, self.protocol, period)
        self.outbox.reconnected()  # final messages not acknowledged go again, right after the welcome
        assert self._ready is not None
        self._tasks.append(asyncio.create_task(self._send_outbox(self._ws), name="outbox"))
        self._tasks.append(asyncio.create_task(self._heartbeat(float(period)), name="heartbeat"))
        self._ready.set()
        self._peer.welcomed()

    async def _send_outbox(self, ws: ClientConnection) -> None:
        """Send queued messages in order; a message leaves the outbox only once it was sent."""
        try:
            await self._send_queued(ws)
        except ConnectionClosed:
            pass  # the receive loop sees the close too, and the messages stay for the next welcome
        except Exception:
            log.exception("the outbox sender failed; reconnecting")
            await ws.close(1011, "worker error")

    async def _send_queued(self, ws: ClientConnection) -> None:
        assert self._ready is not None
        while True:
            await self._ready.wait()
            self._ready.clear()
            while (out := self.outbox.peek()) is not None:
                if not self.outbox.wanted(out):
                    self.outbox.popleft()
                    self._peer.changed()
                    continue
                await ws.send(out.text)
                self.outbox.popleft()
                self.outbox.sent(out, now=self._clock(), await_ack=self.v2)
                self._peer.changed()
                self._peer.sent(out)

    async def _heartbeat(self, period: float) -> None:
        """A heartbeat every period, and (v2) each final message still unacknowledged a period after it went."""
        text = json.dumps(Heartbeat().to_wire())
        cutoff = self._clock()
        while True:
            await asyncio.sleep(period)
            self.enqueue(Outgoing("heartbeat", text, None))
            if self.v2 and self.outbox.resend_sent_before(cutoff) and self._ready is not None:
                self._ready.set()
            cutoff = self._clock()
