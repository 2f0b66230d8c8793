"""The job queue in Redis, shared by every API process on one database (JOB_QUEUE=redis): the
JobQueues interface and order, one atomic Lua script per call, rebuilt from the database when Redis
loses it. Keys, scripts and the rebuild protocol: docs/design/redis-queue.md."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from scheduling.policy import QueuedJob

PRIORITY_MAX = 9
SUBMITTED_US_LIMIT = 10**17  # 17 digits in the member; microseconds since the epoch are ~2e15
REBUILD_CHUNK_JOBS = 10_000  # per loading script: bounded commands, and Redis blocked ~10 ms at a time
REBUILD_LOCK_MS = 15_000  # a crashed rebuild blocks the queue at most this long (100k jobs take < 1 s)
REBUILD_WAIT_SECONDS = 20.0  # how long a process waits for another's rebuild: past the lock's expiry
REBUILD_POLL_SECONDS = 0.02
STAGING_TTL_MS = 10 * 60_000  # staging keys of a rebuild that died before its swap go away
JOB_ID_MAX_BYTES = 1_000  # a rebuild frames members with a 4-digit byte length
MEMBER_HEAD = 20  # "p:" + 17 digits + ":" before the job id


class QueueLost(Exception):
    """The shared job queue lost its contents (Redis restarted or was flushed): rebuild it from the database."""

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        super().__init__(self.detail)


class QueueRebuildTimedOut(QueueLost):
    """Another process's rebuild of the shared job queue did not finish in time."""


def redis_client_from_url(url: str, **options: Any) -> redis.Redis:
    """A client for `url` (redis://host:port/db) as RedisQueues expects it: short connect timeout."""
    options.setdefault("socket_connect_timeout", 2.0)
    options.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **options)


def member_of(job: QueuedJob) -> str:
    """The job's sorted-set member: its dispatch order as a string."""
    if not 0 <= job.priority <= PRIORITY_MAX:
        raise ValueError(f"priority {job.priority} is outside 0..{PRIORITY_MAX}")
    if not 0 <= job.submitted_us < SUBMITTED_US_LIMIT:
        raise ValueError(f"submitted_us {job.submitted_us} is outside 0..{SUBMITTED_US_LIMIT - 1}")
    if len(job.job_id.encode()) > JOB_ID_MAX_BYTES:
        raise ValueError(f"job_id {job.job_id[:40]!r}... is longer than {JOB_ID_MAX_BYTES} bytes")
    return f"{PRIORITY_MAX - job.priority}:{job.submitted_us:017d}:{job.job_id}"


def job_of(member: str, model_id: str) -> QueuedJob:
    return QueuedJob(job_id=member[MEMBER_HEAD:], model_id=model_id,
                     priority=PRIORITY_MAX - int(member[0]), submitted_us=int(member[2:19]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# KEYS[1] marker, KEYS[2] jobs, KEYS[3] counts; ARGV[1] the queue key prefix ("{prefix}:q:").
# Lua compares strings with strcoll, which follows the server's locale: `before` compares bytes, as
# sorted sets do.
_PRELUDE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('QUEUE_LOST') end
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function take(model, member, job_id)
  redis.call('ZREM', ARGV[1] .. model, member)
  redis.call('HDEL', KEYS[2], job_id)
  if redis.call('HINCRBY', KEYS[3], model, -1) <= 0 then redis.call('HDEL', KEYS[3], model) end
end
local function head_of(first)  -- the best head among the models ARGV[first..]: member, model
  local best, best_model = nil, nil
  for i = first, #ARGV do
    local head = redis.call('ZRANGE', ARGV[1] .. ARGV[i], 0, 0)[1]
    if head and (best == nil or before(head, best)) then best, best_model = head, ARGV[i] end
  end
  return best, best_model
end
local function entry_of(job_id)  -- member, model of a queued job; nil when not queued
  local value = redis.call('HGET', KEYS[2], job_id)
  if not value then return nil end
  local cut = 20 + #job_id
  return string.sub(value, 1, cut), string.sub(value, cut + 1)
end
"""

# ARGV[2] job_id, ARGV[3] model_id, ARGV[4] member
_PUSH = _PRELUDE + """
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[4] .. ARGV[3]) == 0 then return 0 end
redis.call('ZADD', ARGV[1] .. ARGV[3], 0, ARGV[4])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return 1
"""

# ARGV[2] job_id -> {member, model} or nil
_REMOVE = _PRELUDE + """
local member, model = entry_of(ARGV[2])
if not member then return nil end
take(model, member, ARGV[2])
return {member, model}
"""

# ARGV[2] 1 to take the job, 0 to leave it; ARGV[3..] model ids -> {member, model} or nil
_HEAD = _PRELUDE + """
local member, model = head_of(3)
if not member then return nil end
if ARGV[2] == '1' then take(model, member, string.sub(member, 21)) end
return {member, model}
"""

# ARGV[2] job_id -> 1-based position or nil
_POSITION = _PRELUDE + """
local member, model = entry_of(ARGV[2])
if not member then return nil end
return redis.call('ZRANK', ARGV[1] .. model, member) + 1
"""

# ARGV[2] model_id -> members in dispatch order
_QUEUED = _PRELUDE + "return redis.call('ZRANGE', ARGV[1] .. ARGV[2], 0, -1)\n"
_COUNTS = _PRELUDE + "return redis.call('HGETALL', KEYS[3])\n"
_LENGTH = _PRELUDE + "return redis.call('HLEN', KEYS[2])\n"
_CONTAINS = _PRELUDE + "return redis.call('HEXISTS', KEYS[2], ARGV[2])\n"

# KEYS[1] lock, KEYS[2] marker, KEYS[3] jobs, KEYS[4] counts, KEYS[5] staged jobs, KEYS[6] staged counts;
# ARGV[1] token, ARGV[2] queue key prefix, ARGV[3] staged queue key prefix, ARGV[4..] staged models.
# Installs a rebuild's staged keys in one step, only while its lock is still held.
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for _, model in ipairs(redis.call('HKEYS', KEYS[4])) do redis.call('UNLINK', ARGV[2] .. model) end
redis.call('UNLINK', KEYS[3], KEYS[4])  -- freed in the background: the old contents may be large
for i = 4, #ARGV do
  redis.call('RENAME', ARGV[3] .. ARGV[i], ARGV[2] .. ARGV[i])
  redis.call('PERSIST', ARGV[2] .. ARGV[i])
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('RENAME', KEYS[5], KEYS[3])
  redis.call('PERSIST', KEYS[3])
  redis.call('RENAME', KEYS[6], KEYS[4])
  redis.call('PERSIST', KEYS[4])
end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] staged queue of a model, KEYS[2] staged jobs, KEYS[3] staged counts; ARGV[1] model_id,
# ARGV[2] members, each after its byte length in 4 digits, ARGV[3] staging TTL in ms.
_LOAD = """
local blob, model, at = ARGV[2], ARGV[1], 1
local scored, entries, loaded = {}, {}, 0
local function flush()
  if #scored > 0 then
    redis.call('ZADD', KEYS[1], unpack(scored))
    redis.call('HSET', KEYS[2], unpack(entries))
    scored, entries = {}, {}
  end
end
while at <= #blob do
  local size = tonumber(string.sub(blob, at, at + 3))
  local member = string.sub(blob, at + 4, at + 3 + size)
  at = at + 4 + size
  scored[#scored + 1] = 0
  scored[#scored + 1] = member
  entries[#entries + 1] = string.sub(member, 21)
  entries[#entries + 1] = member .. model
  loaded = loaded + 1
  if #scored >= 2000 then flush() end  -- unpack's arguments stay far below Lua's stack limit
end
flush()
redis.call('HINCRBY', KEYS[3], model, loaded)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return loaded
"""

# KEYS[1] lock; ARGV[1] token
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisQueues:
    """Queued jobs per model in Redis, shared by every API process using the same `prefix`.

    Same interface and order as `MemoryQueues`; each call is one atomic script (one round trip).
    Any call raises `QueueLost` when Redis has lost the queue since the last rebuild.
    """

    def __init__(self, client: redis.Redis, prefix: str = "potocolom:jobs", *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 lock_ms: int = REBUILD_LOCK_MS, wait_seconds: float = REBUILD_WAIT_SECONDS,
                 poll_seconds: float = REBUILD_POLL_SECONDS) -> None:
        self.client = client
        self.prefix = prefix
        self._clock, self._sleep = clock, sleep
        self._lock_ms, self._wait_seconds, self._poll_seconds = lock_ms, wait_seconds, poll_seconds
        self._queue_prefix = f"{prefix}:q:"
        self._marker, self._jobs, self._counts = f"{prefix}:marker", f"{prefix}:jobs", f"{prefix}:counts"
        self._lock = f"{prefix}:lock"
        self._push, self._remove, self._head = (client.register_script(s) for s in (_PUSH, _REMOVE, _HEAD))
        self._position, self._queued = client.register_script(_POSITION), client.register_script(_QUEUED)
        self._counts_script, self._length = client.register_script(_COUNTS), client.register_script(_LENGTH)
        self._contains, self._swap = client.register_script(_CONTAINS), client.register_script(_SWAP)
        self._unlock, self._load = client.register_script(_UNLOCK), client.register_script(_LOAD)

    def _run(self, script: Any, *args: object) -> Any:
        try:
            return script(keys=[self._marker, self._jobs, self._counts], args=[self._queue_prefix, *args])
        except redis.ResponseError as error:
            if str(error).startswith("QUEUE_LOST"):
                raise QueueLost() from None
            raise

    def _job(self, reply: Sequence[bytes | str] | None) -> QueuedJob | None:
        return job_of(_text(reply[0]), _text(reply[1])) if reply else None

    # the MemoryQueues interface

    def __len__(self) -> int:
        return int(self._run(self._length))

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, str) and self._run(self._contains, job_id) == 1

    def push(self, job: QueuedJob) -> bool:
        """Add a job; False (and no change) when it is queued already."""
        return self._run(self._push, job.job_id, job.model_id, member_of(job)) == 1

    def remove(self, job_id: str) -> QueuedJob | None:
        """Take a job out wherever it is; None when it is not queued."""
        return self._job(self._run(self._remove, job_id))

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """The job that goes next to a worker serving these models, left in place."""
        return self._job(self._run(self._head, "0", *model_ids))

    def pop_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """Take the job that goes next to a worker serving these models."""
        return self._job(self._run(self._head, "1", *model_ids))

    def position(self, job_id: str) -> int | None:
        """The 1-based place among queued jobs of its model; None when not queued."""
        place = self._run(self._position, job_id)
        return None if place is None else int(place)

    def queued(self, model_id: str) -> list[QueuedJob]:
        """A model's queued jobs in dispatch order."""
        return [job_of(_text(member), model_id) for member in self._run(self._queued, model_id)]

    def counts(self) -> dict[str, int]:
        """Queued jobs per model (models with none left out)."""
        flat = self._run(self._counts_script)
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def rebuild(self, jobs: Iterable[QueuedJob]) -> None:
        """Replace the contents with `jobs` (the database's queued rows); while another process is
        rebuilding, wait for its rows instead (see `rebuild_from`)."""
        self.rebuild_from(lambda: jobs)

    # losing and rebuilding

    def is_lost(self) -> bool:
        """Whether the queue needs a rebuild (never built, or Redis lost it)."""
        return not self.client.exists(self._marker)

    def recover(self, load: Callable[[], Iterable[QueuedJob]]) -> bool:
        """After `QueueLost`: rebuild from `load()` unless the queue is whole again (another process
        rebuilt it) or another process is rebuilding it (then wait for that). True when this call
        rebuilt. Retry the failed operation afterwards."""
        return self._rebuild(load, only_if_lost=True)

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]]) -> bool:
        """Replace the contents with `load()` (which reads the database's queued rows once the queue
        is closed to other processes), or wait for another process's rebuild in progress. True when
        this call rebuilt. Raises `QueueRebuildTimedOut` after `wait_seconds` of waiting."""
        return self._rebuild(load, only_if_lost=False)

    def _rebuild(self, load: Callable[[], Iterable[QueuedJob]], *, only_if_lost: bool) -> bool:
        deadline = self._clock() + self._wait_seconds
        waited = False
        while True:
            if (only_if_lost or waited) and not self.is_lost():
                return False  # another process's rebuild ended; what changed after its read was refused
            token = uuid.uuid4().hex
            if self.client.set(self._lock, token, nx=True, px=self._lock_ms):
                try:
                    if only_if_lost and not self.is_lost():
                        return False
                    if self._rebuild_locked(load, token):
                        return True
                finally:
                    self._unlock(keys=[self._lock], args=[token])
            if self._clock() >= deadline:
                raise QueueRebuildTimedOut()
            waited = True
            self._sleep(self._poll_seconds)

    def _rebuild_locked(self, load: Callable[[], Iterable[QueuedJob]], token: str) -> bool:
        """Close the queue, read `load()`, stage it, swap it in; False when the lock expired meanwhile."""
        self.client.delete(self._marker)
        staging = f"{self.prefix}:build:{token}"
        staged_queue_prefix, staged_jobs, staged_counts = f"{staging}:q:", f"{staging}:jobs", f"{staging}:counts"
        jobs: dict[str, QueuedJob] = {}
        for job in load():
            jobs[job.job_id] = job  # the last row of a job id wins, as in MemoryQueues.rebuild
        by_model: dict[str, list[bytes]] = {}
        for job in jobs.values():
            by_model.setdefault(job.model_id, []).append(member_of(job).encode())
        staged_keys = [staged_jobs, staged_counts, *(staged_queue_prefix + model_id for model_id in by_model)]
        try:
            for model_id, members in by_model.items():
                for start in range(0, len(members), REBUILD_CHUNK_JOBS):
                    # one framed string per chunk: redis-py packs 200,000 separate arguments 4x slower
                    blob = b"".join(b"%04d%s" % (len(member), member)
                                    for member in members[start:start + REBUILD_CHUNK_JOBS])
                    self._load(keys=[staged_queue_prefix + model_id, staged_jobs, staged_counts],
                               args=[model_id, blob, STAGING_TTL_MS])
            return self._swap(keys=[self._lock, self._marker, self._jobs, self._counts, staged_jobs, staged_counts],
                              args=[token, self._queue_prefix, staged_queue_prefix, *by_model]) == 1
        finally:
            self.client.delete(*staged_keys)  # left only when the swap did not happen

    def delete_all(self) -> None:
        """Delete every key under the prefix, the marker included (tests, and tearing down)."""
        keys = list(self.client.scan_iter(match=f"{_glob_escape(self.prefix)}:*", count=1000))
        for start in range(0, len(keys), 1000):
            self.client.delete(*keys[start:start + 1000])


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class RecoveringQueues:
    """A RedisQueues that rebuilds itself from `load()` (the database's queued rows) when Redis has
    lost it, then retries the call once: what the dispatcher holds, so a Redis restart loses no job."""

    shared = True  # every API process on the database takes jobs from it

    def __init__(self, queues: RedisQueues, load: Callable[[], Iterable[QueuedJob]]) -> None:
        self.redis = queues
        self.load = load

    def _retry(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except QueueLost:
            self.redis.recover(self.load)
            return call()

    def __len__(self) -> int:
        return int(self._retry(self.redis.__len__))

    def __contains__(self, job_id: object) -> bool:
        return bool(self._retry(lambda: job_id in self.redis))

    def rebuild(self, jobs: Iterable[QueuedJob]) -> None:
        self.redis.rebuild(jobs)

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]]) -> None:
        """Rebuild from `load()` (the database's queued rows; an API process starting), unless another
        process is rebuilding it; `load` is kept to rebuild again whenever Redis loses the queue."""
        self.load = load
        self.redis.rebuild_from(load)

    def push(self, job: QueuedJob) -> bool:
        return bool(self._retry(lambda: self.redis.push(job)))

    def remove(self, job_id: str) -> QueuedJob | None:
        return self._retry(lambda: self.redis.remove(job_id))  # type: ignore[no-any-return]

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        models = list(model_ids)
        return self._retry(lambda: self.redis.peek_for(models))  # type: ignore[no-any-return]

    def pop_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        models = list(model_ids)
        return self._retry(lambda: self.redis.pop_for(models))  # type: ignore[no-any-return]

    def position(self, job_id: str) -> int | None:
        return self._retry(lambda: self.redis.position(job_id))  # type: ignore[no-any-return]

    def queued(self, model_id: str) -> list[QueuedJob]:
        return self._retry(lambda: self.redis.queued(model_id))  # type: ignore[no-any-return]

    def counts(self) -> dict[str, int]:
        return self._retry(self.redis.counts)  # type: ignore[no-any-return]
