"""At most ACCOUNT_SOCKET_LIMIT open /ws/jobs/ sockets per account in the deployment: with REDIS_URL a
sorted set per account whose entries lapse unless their process refreshes them, else a count in the
process. docs/design/http.md, "Sockets per account"."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import redis
from django.conf import settings

from potocolom.runtime import Slot, runtime

log = logging.getLogger(__name__)
LEASE_SECONDS = 60.0  # an entry lapses this long after its process last refreshed it (a killed process's)
REFRESH_SECONDS = LEASE_SECONDS / 4  # how often a process refreshes the entries of its open sockets

# KEYS[1] the account's set, KEYS[2] every account's; ARGV[1] now, ARGV[2] limit, ARGV[3] the entry's
# expiry, ARGV[4] the socket, ARGV[5] the sets' lifetime (s), ARGV[6] the socket's entry in KEYS[2]
# -> 1 taken (or held already), 0 the account holds `limit` sockets
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[4]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""


class SocketCounts(Protocol):
    """The open sockets of each account, as one backend counts them (`now`: seconds since the epoch)."""

    def take(self, *, account: str, socket: str, limit: int, now: float) -> bool:
        """Count `socket` for `account` unless the account holds `limit` sockets; whether it was."""

    def refresh(self, *, held: list[tuple[str, str]], now: float) -> None:
        """The (account, socket) pairs of this process are still open."""

    def release(self, *, account: str, socket: str) -> None:
        """`socket` closed."""

    def count(self, *, account: str, now: float) -> int:
        """The account's open sockets (an entry of a killed process counts until it lapses)."""

    def count_all(self, *, now: float) -> int:
        """Every account's open sockets together (likewise)."""


class LocalSocketCounts:
    """Without Redis: the sockets of this process (one API process serves them all)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, set[str]] = defaultdict(set)

    def take(self, *, account: str, socket: str, limit: int, now: float) -> bool:
        with self.lock:
            sockets = self.open[account]
            if socket not in sockets and len(sockets) >= limit:
                return False
            sockets.add(socket)
            return True

    def refresh(self, *, held: list[tuple[str, str]], now: float) -> None:
        """Nothing lapses in a process."""

    def release(self, *, account: str, socket: str) -> None:
        with self.lock:
            self.open[account].discard(socket)
            if not self.open[account]:
                del self.open[account]

    def count(self, *, account: str, now: float) -> int:
        with self.lock:
            return len(self.open.get(account, ()))

    def count_all(self, *, now: float) -> int:
        with self.lock:
            return sum(len(sockets) for sockets in self.open.values())


class RedisSocketCounts:
    """Every API process's sockets: per account a sorted set of socket -> expiry, checked and added in
    one script, with the same entry ("account:socket") in one set of every account's (`everyone`:
    whether anybody listens at all, in one call); each process moves its own sockets' expiries on,
    so a killed process's lapse."""

    def __init__(self, client: redis.Redis, *, prefix: str, lease_seconds: float = LEASE_SECONDS) -> None:
        self.client = client
        self.prefix = prefix
        self.lease = lease_seconds
        self.script: Any = client.register_script(_TAKE)

    def key(self, account: str) -> str:
        return f"{self.prefix}{account}"

    @property
    def everyone(self) -> str:
        return f"{self.prefix}all"  # account ids are numbers: no account's key

    def take(self, *, account: str, socket: str, limit: int, now: float) -> bool:
        args = [repr(now), limit, repr(now + self.lease), socket, math.ceil(self.lease), f"{account}:{socket}"]
        return bool(self.script(keys=[self.key(account), self.everyone], args=args))

    def refresh(self, *, held: list[tuple[str, str]], now: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        for account, socket in held:  # an entry that lapsed meanwhile comes back: its socket is open
            pipe.zadd(self.key(account), {socket: now + self.lease})
            pipe.expire(self.key(account), math.ceil(self.lease))
            pipe.zadd(self.everyone, {f"{account}:{socket}": now + self.lease})
        if held:
            pipe.expire(self.everyone, math.ceil(self.lease))
        pipe.execute()

    def release(self, *, account: str, socket: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.key(account), socket)
        pipe.zrem(self.everyone, f"{account}:{socket}")
        pipe.execute()

    def count(self, *, account: str, now: float) -> int:
        return int(self.client.zcount(self.key(account), f"({now!r}", "+inf"))

    def count_all(self, *, now: float) -> int:
        return int(self.client.zcount(self.everyone, f"({now!r}", "+inf"))


class SocketSeats:
    """This process's open sockets in the account counts, and the task on its event loop that
    refreshes their entries while it holds any (started by the first, stopped with the last)."""

    def __init__(self, counts: SocketCounts, *, clock: Callable[[], float] = time.time) -> None:
        self.counts = counts
        self.clock = clock
        self.held: dict[str, str] = {}  # socket -> account
        self.task: asyncio.Task | None = None
        self.turns: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # account -> its lock, how many use it

    @contextlib.asynccontextmanager
    async def turn(self, account: str) -> AsyncIterator[None]:
        """The account's sockets take their places one at a time, in the order they asked (a lock's
        waiters are served first come, first served): of sockets opened one after another, the
        one past the limit is the last. Other accounts never wait for it."""
        lock, users = self.turns.setdefault(account, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self.turns[account]

    async def take(self, *, account: str, socket: str, limit: int) -> bool:
        """Whether the socket may stay open (counted until `release`). A backend that fails (Redis
        away) lets it stay, uncounted: the limit guards a deployment, it never locks accounts out."""
        try:
            taken = await asyncio.to_thread(self.counts.take, account=account, socket=socket, limit=limit,
                                            now=self.clock())
        except redis.RedisError as exc:
            log.warning("socket limit not checked for account %s: %s", account, exc)
            return True
        if taken:
            self.held[socket] = account
            loop = asyncio.get_running_loop()
            if self.task is None or self.task.done() or self.task.get_loop() is not loop:
                self.task = loop.create_task(self._refresh_forever(), name="socket-seats")
        return taken

    async def release(self, *, socket: str) -> None:
        """The socket closed (once; a socket never counted is ignored)."""
        account = self.held.pop(socket, None)
        if not self.held and self.task is not None:
            self.task.cancel()
            self.task = None
        if account is not None:
            try:
                await asyncio.to_thread(self.counts.release, account=account, socket=socket)
            except redis.RedisError as exc:  # its entry lapses by itself
                log.warning("socket %s of account %s not released: %s", socket, account, exc)

    def anyone_listens(self, account: str) -> bool:
        """Whether the account holds an open socket anywhere in the deployment; True when that cannot
        be told (Redis away): a caller skips work only on a sure no."""
        try:
            return self.counts.count(account=account, now=self.clock()) > 0
        except redis.RedisError:
            return True

    def anyone_listens_at_all(self) -> bool:
        """Whether any account holds an open socket anywhere in the deployment; True when that cannot
        be told (Redis away)."""
        try:
            return self.counts.count_all(now=self.clock()) > 0
        except redis.RedisError:
            return True

    def refresh_now(self) -> None:
        """Move the entries of this process's open sockets on (the task's pass)."""
        held = [(account, socket) for socket, account in list(self.held.items())]
        self.counts.refresh(held=held, now=self.clock())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await asyncio.to_thread(self.refresh_now)
            except Exception:  # one failed pass must not stop the next
                log.exception("could not refresh the open sockets' entries")


def _make_seats() -> SocketSeats:
    if not settings.REDIS_URL:
        return SocketSeats(LocalSocketCounts())
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT,
                                  socket_timeout=settings.REDIS_CONNECT_TIMEOUT)
    # one namespace per database, as the cache's (servers on other databases may share this Redis)
    prefix = f"{settings.CACHES['default'].get('KEY_PREFIX', '')}:sockets:"
    return SocketSeats(RedisSocketCounts(client, prefix=prefix))


def _stop(seats: SocketSeats) -> None:
    """Stop the refresh task (tests: its loop may be closed already, its task with it)."""
    task, seats.task = seats.task, None
    if task is not None and not task.done():
        with contextlib.suppress(RuntimeError):
            task.cancel()


SOCKET_SEATS = Slot("potocolom.web.socket_seats", make=_make_seats, stop=_stop)


def socket_seats() -> SocketSeats:
    """This process's SocketSeats (made at first use, from REDIS_URL)."""
    return runtime.get(SOCKET_SEATS)
