"""The job queue in Redis, shared by every API process on one database (JOB_QUEUE=redis): the
JobQueues interface and order, one atomic Lua script per call, rebuilt from the database when Redis
loses it. Keys, scripts and the rebuild protocol: docs/design/redis-queue.md."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis

from scheduling.policy import STEPS_MAX, QueuedJob, Turn, merge_turns, turn_key

T = TypeVar("T")
PRIORITY_MAX = 9
TURN_US_LIMIT = 2**53  # turns are sorted-set scores (doubles): exact below this (the year 2255)
SUBMITTED_US_LIMIT = 2**52  # (the year 2112) a submission can be a turn key, and turns go past it; 17 digits
REBUILD_CHUNK_JOBS = 10_000  # per loading script: bounded commands, and Redis blocked ~10 ms at a time
REBUILD_LOCK_MS = 15_000  # a crashed rebuild blocks the queue at most this long (100k jobs take < 1 s)
REBUILD_WAIT_SECONDS = 20.0  # how long a process waits for another's rebuild: past the lock's expiry
REBUILD_POLL_SECONDS = 0.02
STAGING_TTL_MS = 10 * 60_000  # staging keys of a rebuild that died before its swap go away
JOB_ID_MAX_BYTES = 1_000  # a rebuild frames members with a 4-digit byte length
ACCOUNT_MAX_BYTES = 200
MODEL_ID_MAX_BYTES = 1_000
MEMBER_HEAD = 20  # "p:" + 17 digits + ":" before the job id


class QueueLost(Exception):
    """The shared job queue lost its contents (Redis restarted or was flushed): rebuild it from the database."""

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        super().__init__(self.detail)


class QueueRebuildTimedOut(QueueLost):
    """Another process's rebuild of the shared job queue did not finish in time."""


def redis_client_from_url(url: str, **options: Any) -> redis.Redis:
    """A client for `url` (redis://host:port/db) as RedisQueues expects it: a short connect timeout,
    and a read timeout so a stuck Redis fails the call (503 for a request) instead of hanging it."""
    options.setdefault("socket_connect_timeout", 2.0)
    options.setdefault("socket_timeout", 10.0)
    options.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **options)


def framed(text: str) -> str:
    """`text` after its byte length in 4 digits: prefix-free, so an account's members sort together."""
    return f"{len(text.encode()):04d}{text}"


def member_of(job: QueuedJob) -> str:
    """The job's place in its account's line as a string (the order of its bytes is the line's)."""
    if not 0 <= job.priority <= PRIORITY_MAX:
        raise ValueError(f"priority {job.priority} is outside 0..{PRIORITY_MAX}")
    if not 0 <= job.submitted_us < SUBMITTED_US_LIMIT:
        raise ValueError(f"submitted_us {job.submitted_us} is outside 0..{SUBMITTED_US_LIMIT - 1}")
    if len(job.job_id.encode()) > JOB_ID_MAX_BYTES:
        raise ValueError(f"job_id {job.job_id[:40]!r}... is longer than {JOB_ID_MAX_BYTES} bytes")
    if len(job.account.encode()) > ACCOUNT_MAX_BYTES or len(job.model_id.encode()) > MODEL_ID_MAX_BYTES:
        raise ValueError("account or model_id too long for the queue")
    return f"{PRIORITY_MAX - job.priority}:{job.submitted_us:017d}:{job.job_id}"


def steps_of(job: QueuedJob) -> str:
    """The job's steps as its entry holds them: 6 digits (0 to STEPS_MAX)."""
    return f"{min(max(int(job.steps), 0), STEPS_MAX):06d}"


def job_of(member: str, model_id: str, account: str, turn: str | None = None) -> QueuedJob:
    return QueuedJob(job_id=member[MEMBER_HEAD:], model_id=model_id, priority=PRIORITY_MAX - int(member[0]),
                     submitted_us=int(member[2:19]), account=account, turn_us=int(turn) if turn else None)


def split_line_member(line_member: str) -> tuple[str, str]:
    """(account, member) of a member of a model's lines (framed account, then the member)."""
    size = int(line_member[:4])
    head = line_member[4:].encode()
    return head[:size].decode(), head[size:].decode()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# KEYS[1] marker, KEYS[2] jobs, KEYS[3] counts, KEYS[4] last turns, KEYS[5] clocks, KEYS[6] steps;
# ARGV[1] the key prefix ("{prefix}:"). A job's entry in `jobs`: its framed model, its steps in 6
# digits, its line member. `counts` and `steps` hold each model's queued jobs and their steps
# summed, kept by the same scripts that add and take jobs. Per model: q: lines (every account's
# jobs, members framed account + member, so one account's members sort together), o: the same
# jobs by submission (oldest first), t: the rotation (accounts with jobs, scored by their turn
# key). Lua compares strings with strcoll, which follows the server's locale: `before` compares
# bytes, as sorted sets do. Numbers above 2^31 go to Redis as strings ('%.0f'), never through
# Lua's default number format (14 digits).
_PRELUDE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('QUEUE_LOST') end
local base = ARGV[1]
local function before(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function frame(s) return string.format('%04d', #s) .. s end
local function bounds(account) local p = frame(account) return '[' .. p, '(' .. p .. ';' end
-- model, line member, account, member, steps of a queued job; nil when not queued
local function entry_of(job_id)
  local value = redis.call('HGET', KEYS[2], job_id)
  if not value then return nil end
  local n = tonumber(string.sub(value, 1, 4))
  local model, line = string.sub(value, 5, 4 + n), string.sub(value, 11 + n)
  local steps = tonumber(string.sub(value, 5 + n, 10 + n))
  local a = tonumber(string.sub(line, 1, 4))
  return model, line, string.sub(line, 5, 4 + a), string.sub(line, 5 + a), steps
end
local function rekey(model, account)  -- the account's place in the model's rotation, or out of it
  local lo, hi = bounds(account)
  local rotation = base .. 't:' .. model
  if redis.call('ZLEXCOUNT', base .. 'q:' .. model, lo, hi) == 0 then
    redis.call('ZREM', rotation, account)
    return
  end
  local key = redis.call('HGET', KEYS[4], frame(account) .. model)
  if not key then
    local oldest = redis.call('ZRANGEBYLEX', base .. 'o:' .. model, lo, hi, 'LIMIT', 0, 1)[1]
    key = string.sub(oldest, #frame(account) + 1, #frame(account) + 17)
  end
  redis.call('ZADD', rotation, key, account)
end
local function take(model, line, account, member)
  local p = frame(account)
  local job_id = string.sub(member, 21)
  local steps = select(5, entry_of(job_id)) or 0
  redis.call('ZREM', base .. 'q:' .. model, line)
  redis.call('ZREM', base .. 'o:' .. model, p .. string.sub(member, 3, 19) .. ':' .. job_id)
  redis.call('HDEL', KEYS[2], job_id)
  if redis.call('HINCRBY', KEYS[3], model, -1) <= 0 then
    redis.call('HDEL', KEYS[3], model)
    redis.call('HDEL', KEYS[6], model)
  elseif steps > 0 then  -- never -0: Lua writes it "-0", which HINCRBY refuses
    redis.call('HINCRBY', KEYS[6], model, -steps)
  end
end
"""

# ARGV[2] job_id, ARGV[3] model_id, ARGV[4] account, ARGV[5] member, ARGV[6] steps (6 digits)
_PUSH = _PRELUDE + """
local p = frame(ARGV[4])
local line = p .. ARGV[5]
if redis.call('HSETNX', KEYS[2], ARGV[2], frame(ARGV[3]) .. ARGV[6] .. line) == 0 then return 0 end
redis.call('ZADD', base .. 'q:' .. ARGV[3], 0, line)
redis.call('ZADD', base .. 'o:' .. ARGV[3], 0, p .. string.sub(ARGV[5], 3, 19) .. ':' .. ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('HINCRBY', KEYS[6], ARGV[3], tonumber(ARGV[6]))
rekey(ARGV[3], ARGV[4])
return 1
"""

# ARGV[2] job_id -> {member, model, account, '', steps} or nil
_REMOVE = _PRELUDE + """
local model, line, account, member, steps = entry_of(ARGV[2])
if not model then return nil end
take(model, line, account, member)
rekey(model, account)
return {member, model, account, '', steps}
"""

# ARGV[2] 1 to take the job, 0 to leave it; ARGV[3] the dispatch time in us, or ''; ARGV[4..] model
# ids -> {member, model, account, turn given ('' when left in place), steps} or nil
_HEAD = _PRELUDE + """
local best = nil  -- turn, account, member, model, line
for i = 4, #ARGV do
  local model = ARGV[i]
  local head = redis.call('ZRANGE', base .. 't:' .. model, 0, 0, 'WITHSCORES')
  if head[1] then
    local account, turn = head[1], tonumber(head[2])
    local lo, hi = bounds(account)
    local line = redis.call('ZRANGEBYLEX', base .. 'q:' .. model, lo, hi, 'LIMIT', 0, 1)[1]
    local member = string.sub(line, #frame(account) + 1)
    if best == nil or turn < best[1] or (turn == best[1] and (before(account, best[2])
        or (account == best[2] and before(member, best[3])))) then
      best = {turn, account, member, model, line}
    end
  end
end
if not best then return nil end
local account, member, model = best[2], best[3], best[4]
local steps = select(5, entry_of(string.sub(member, 21)))
local given = ''
if ARGV[2] == '1' then
  local floor = tonumber(redis.call('HGET', KEYS[5], model) or '0')
  local top = redis.call('ZRANGE', base .. 't:' .. model, -1, -1, 'WITHSCORES')[2]
  if tonumber(top) > floor then floor = tonumber(top) end
  local turn = floor + 1
  if ARGV[3] ~= '' and tonumber(ARGV[3]) > turn then turn = tonumber(ARGV[3]) end
  given = string.format('%.0f', turn)
  take(model, best[5], account, member)
  redis.call('HSET', KEYS[5], model, given)
  redis.call('HSET', KEYS[4], frame(account) .. model, given)
  rekey(model, account)
end
return {member, model, account, given, steps}
"""

# ARGV[2..] job ids -> for each, its 1-based position, or 0 when it is not queued (policy.place_in_turns).
# The lengths of a model's lines are read once for all the ids of that model.
_POSITIONS = _PRELUDE + """
local lengths = {}  -- model -> {{account, length} in rotation order}
local out = {}
for i = 2, #ARGV do
  local model, line, account = entry_of(ARGV[i])
  local place = 0
  if model then
    local lines = base .. 'q:' .. model
    if not lengths[model] then
      local each = {}
      for _, other in ipairs(redis.call('ZRANGE', base .. 't:' .. model, 0, -1)) do
        local olo, ohi = bounds(other)
        each[#each + 1] = {other, redis.call('ZLEXCOUNT', lines, olo, ohi)}
      end
      lengths[model] = each
    end
    local lo = bounds(account)
    local rank = redis.call('ZLEXCOUNT', lines, lo, '(' .. line)
    local ahead = true
    place = 1
    for _, pair in ipairs(lengths[model]) do
      if pair[1] == account then ahead = false end
      local cap = rank
      if ahead then cap = rank + 1 end
      place = place + math.min(pair[2], cap)
    end
  end
  out[#out + 1] = place
end
return out
"""

# ARGV[2] model_id -> {accounts in rotation order, line members in order, their jobs' steps}
_QUEUED = _PRELUDE + """
local members = redis.call('ZRANGE', base .. 'q:' .. ARGV[2], 0, -1)
local steps = {}
for i, line in ipairs(members) do
  local a = tonumber(string.sub(line, 1, 4))
  steps[i] = select(5, entry_of(string.sub(line, 5 + a + 20))) or 0
end
return {redis.call('ZRANGE', base .. 't:' .. ARGV[2], 0, -1), members, steps}
"""
_COUNTS = _PRELUDE + "return redis.call('HGETALL', KEYS[3])\n"
_DEMAND = _PRELUDE + "return {redis.call('HGETALL', KEYS[3]), redis.call('HGETALL', KEYS[6])}\n"
_TURNS = _PRELUDE + "return redis.call('HGETALL', KEYS[4])\n"
_LENGTH = _PRELUDE + "return redis.call('HLEN', KEYS[2])\n"
_CONTAINS = _PRELUDE + "return redis.call('HEXISTS', KEYS[2], ARGV[2])\n"

# KEYS[1] lock, KEYS[2] marker, KEYS[3..7] jobs, counts, last turns, clocks, steps; KEYS[8..12]
# their staged copies; ARGV[1] token, ARGV[2] key prefix, ARGV[3] staged key prefix, ARGV[4..] staged
# models. Installs a rebuild's staged keys in one step, only while its lock is still held.
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for _, model in ipairs(redis.call('HKEYS', KEYS[4])) do
  for _, kind in ipairs({'q:', 'o:', 't:'}) do redis.call('UNLINK', ARGV[2] .. kind .. model) end
end
-- freed in the background: the old contents may be large
redis.call('UNLINK', KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
for i = 4, #ARGV do
  for _, kind in ipairs({'q:', 'o:', 't:'}) do
    redis.call('RENAME', ARGV[3] .. kind .. ARGV[i], ARGV[2] .. kind .. ARGV[i])
    redis.call('PERSIST', ARGV[2] .. kind .. ARGV[i])
  end
end
for i = 3, 7 do
  if redis.call('EXISTS', KEYS[i + 5]) == 1 then
    redis.call('RENAME', KEYS[i + 5], KEYS[i])
    redis.call('PERSIST', KEYS[i])
  end
end
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1..3] a model's staged lines, oldest, rotation; KEYS[4] staged jobs, KEYS[5] staged counts,
# KEYS[6] staged steps; ARGV[1] model_id, ARGV[2] line members, each after its byte length in 4
# digits and its job's steps in 6, ARGV[3] staging TTL in ms, ARGV[4..] the rotation as key,
# account pairs (first chunk only).
_LOAD = """
local blob, model, at = ARGV[2], ARGV[1], 1
local lines, oldest, entries, loaded, steps = {}, {}, {}, 0, 0
local function frame(s) return string.format('%04d', #s) .. s end
local function flush()
  if #lines > 0 then
    redis.call('ZADD', KEYS[1], unpack(lines))
    redis.call('ZADD', KEYS[2], unpack(oldest))
    redis.call('HSET', KEYS[4], unpack(entries))
    lines, oldest, entries = {}, {}, {}
  end
end
while at <= #blob do
  local size = tonumber(string.sub(blob, at, at + 3))
  local digits = string.sub(blob, at + 4, at + 9)
  local line = string.sub(blob, at + 10, at + 9 + size)
  at = at + 10 + size
  steps = steps + tonumber(digits)
  local a = tonumber(string.sub(line, 1, 4))
  local member = string.sub(line, 5 + a)
  local job_id = string.sub(member, 21)
  lines[#lines + 1] = 0
  lines[#lines + 1] = line
  oldest[#oldest + 1] = 0
  oldest[#oldest + 1] = string.sub(line, 1, 4 + a) .. string.sub(member, 3, 19) .. ':' .. job_id
  entries[#entries + 1] = job_id
  entries[#entries + 1] = frame(model) .. digits .. line
  loaded = loaded + 1
  if #lines >= 2000 then flush() end  -- unpack's arguments stay far below Lua's stack limit
end
flush()
for i = 4, #ARGV, 2 do redis.call('ZADD', KEYS[3], ARGV[i], ARGV[i + 1]) end
redis.call('HINCRBY', KEYS[5], model, loaded)
redis.call('HINCRBY', KEYS[6], model, steps)
for i = 1, 6 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return loaded
"""

# KEYS[1] staged last turns, KEYS[2] staged clocks; ARGV[1] TTL, ARGV[2..] field, turn, field, turn...
# (a field of the last turns is framed account + model; of the clocks, the model)
_LOAD_TURNS = """
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
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
        self._base = f"{prefix}:"
        self._marker, self._jobs, self._counts = f"{prefix}:marker", f"{prefix}:jobs", f"{prefix}:counts"
        self._last, self._clocks, self._steps = f"{prefix}:turns", f"{prefix}:clocks", f"{prefix}:steps"
        self._lock = f"{prefix}:lock"
        self._push, self._remove, self._head = (client.register_script(s) for s in (_PUSH, _REMOVE, _HEAD))
        self._positions, self._queued = client.register_script(_POSITIONS), client.register_script(_QUEUED)
        self._demand = client.register_script(_DEMAND)
        self._counts_script, self._length = client.register_script(_COUNTS), client.register_script(_LENGTH)
        self._contains, self._swap = client.register_script(_CONTAINS), client.register_script(_SWAP)
        self._unlock, self._load = client.register_script(_UNLOCK), client.register_script(_LOAD)
        self._turns, self._load_turns = client.register_script(_TURNS), client.register_script(_LOAD_TURNS)

    def _run(self, script: Any, *args: object) -> Any:
        try:
            return script(keys=[self._marker, self._jobs, self._counts, self._last, self._clocks, self._steps],
                          args=[self._base, *args])
        except redis.ResponseError as error:
            if str(error).startswith("QUEUE_LOST"):
                raise QueueLost() from None
            raise

    def _job(self, reply: Sequence[bytes | str] | None) -> QueuedJob | None:
        if not reply:
            return None
        turn = _text(reply[3]) if len(reply) > 3 else None
        job = job_of(_text(reply[0]), _text(reply[1]), _text(reply[2]), turn or None)
        return job._replace(steps=int(reply[4])) if len(reply) > 4 and reply[4] is not None else job

    # the MemoryQueues interface

    def __len__(self) -> int:
        return int(self._run(self._length))

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, str) and self._run(self._contains, job_id) == 1

    def push(self, job: QueuedJob) -> bool:
        """Add a job; False (and no change) when it is queued already."""
        return self._run(self._push, job.job_id, job.model_id, job.account, member_of(job), steps_of(job)) == 1

    def remove(self, job_id: str) -> QueuedJob | None:
        """Take a job out wherever it is; None when it is not queued."""
        return self._job(self._run(self._remove, job_id))

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        """The job that goes next to a worker serving these models, left in place."""
        return self._job(self._run(self._head, "0", "", *model_ids))

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None:
        """Take the job that goes next to a worker serving these models; its account's turn moves to
        `at_us` (or just after the latest turn). The job returned carries that turn."""
        if at_us is not None and not 0 <= at_us < TURN_US_LIMIT:
            raise ValueError(f"at_us {at_us} is outside 0..{TURN_US_LIMIT - 1}")
        return self._job(self._run(self._head, "1", "" if at_us is None else str(at_us), *model_ids))

    def position(self, job_id: str) -> int | None:
        """The 1-based place among queued jobs of its model, in the order the turns give."""
        return self.positions([job_id]).get(job_id)

    def positions(self, job_ids: Iterable[str]) -> dict[str, int]:
        """The positions of those of these jobs that are queued: one script for them all."""
        ids = list(job_ids)
        if not ids:
            return {}
        places = self._run(self._positions, *ids)
        return {job_id: int(place) for job_id, place in zip(ids, places, strict=True) if int(place) > 0}

    def demand(self) -> dict[str, tuple[int, int]]:
        """Per model with queued jobs: how many, and their steps summed (kept by the scripts)."""
        counts, steps = self._run(self._demand)
        summed = {_text(steps[i]): int(steps[i + 1]) for i in range(0, len(steps), 2)}
        return {_text(counts[i]): (int(counts[i + 1]), summed.get(_text(counts[i]), 0))
                for i in range(0, len(counts), 2)}

    def queued(self, model_id: str) -> list[QueuedJob]:
        """A model's queued jobs in dispatch order."""
        rotation, members, steps = self._run(self._queued, model_id)
        lines: dict[str, list[QueuedJob]] = {}
        for line, job_steps in zip(members, steps, strict=True):
            account, member = split_line_member(_text(line))
            lines.setdefault(account, []).append(job_of(member, model_id, account)._replace(steps=int(job_steps)))
        return merge_turns(lines[_text(account)] for account in rotation)

    def counts(self) -> dict[str, int]:
        """Queued jobs per model (models with none left out)."""
        flat = self._run(self._counts_script)
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def turns(self) -> list[Turn]:
        """Every account's last turn per model."""
        flat = self._run(self._turns)
        turns = []
        for i in range(0, len(flat), 2):
            account, model_id = split_line_member(_text(flat[i]))
            turns.append(Turn(model_id, account, int(_text(flat[i + 1]))))
        return sorted(turns)

    def rebuild(self, jobs: Iterable[QueuedJob], turns: Iterable[Turn] = ()) -> None:
        """Replace the contents with `jobs` (the database's queued rows) and `turns`; while another
        process is rebuilding, wait for its rows instead (see `rebuild_from`)."""
        self.rebuild_from(lambda: jobs, lambda: turns)

    # losing and rebuilding

    def is_lost(self) -> bool:
        """Whether the queue needs a rebuild (never built, or Redis lost it)."""
        return not self.client.exists(self._marker)

    def recover(self, load: Callable[[], Iterable[QueuedJob]],
                load_turns: Callable[[], Iterable[Turn]] | None = None) -> bool:
        """After `QueueLost`: rebuild from `load()` unless the queue is whole again (another process
        rebuilt it) or another process is rebuilding it (then wait for that). True when this call
        rebuilt. Retry the failed operation afterwards."""
        return self._rebuild(load, load_turns, only_if_lost=True)

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]],
                     load_turns: Callable[[], Iterable[Turn]] | None = None) -> bool:
        """Replace the contents with `load()` and `load_turns()` (which read the database's queued
        rows and turns once the queue is closed to other processes), or wait for another process's
        rebuild in progress. True when this call rebuilt. Raises `QueueRebuildTimedOut` after
        `wait_seconds` of waiting."""
        return self._rebuild(load, load_turns, only_if_lost=False)

    def _rebuild(self, load: Callable[[], Iterable[QueuedJob]], load_turns: Callable[[], Iterable[Turn]] | None,
                 *, only_if_lost: bool) -> bool:
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
                    if self._rebuild_locked(load, load_turns or (lambda: ()), token):
                        return True
                finally:
                    self._unlock(keys=[self._lock], args=[token])
            if self._clock() >= deadline:
                raise QueueRebuildTimedOut()
            waited = True
            self._sleep(self._poll_seconds)

    def _rebuild_locked(self, load: Callable[[], Iterable[QueuedJob]], load_turns: Callable[[], Iterable[Turn]],
                        token: str) -> bool:
        """Close the queue, read `load()` and `load_turns()`, stage them, swap them in; False when the
        lock expired meanwhile."""
        self.client.delete(self._marker)
        staging = f"{self.prefix}:build:{token}"
        staged_base = f"{staging}:"
        staged = [f"{staging}:jobs", f"{staging}:counts", f"{staging}:turns", f"{staging}:clocks", f"{staging}:steps"]
        jobs: dict[str, QueuedJob] = {}
        for job in load():
            jobs[job.job_id] = job  # the last row of a job id wins, as in MemoryQueues.rebuild
        last: dict[tuple[str, str], int] = {}
        for turn in load_turns():
            if not 0 <= turn.turn_us < TURN_US_LIMIT:
                raise ValueError(f"turn_us {turn.turn_us} is outside 0..{TURN_US_LIMIT - 1}")
            pair = (turn.model_id, turn.account)
            last[pair] = max(last.get(pair, turn.turn_us), turn.turn_us)
        by_model: dict[str, list[tuple[bytes, int]]] = {}
        oldest: dict[tuple[str, str], int] = {}
        for job in jobs.values():
            by_model.setdefault(job.model_id, []).append(((framed(job.account) + member_of(job)).encode(),
                                                          int(steps_of(job))))
            pair = (job.model_id, job.account)
            oldest[pair] = min(oldest.get(pair, job.submitted_us), job.submitted_us)
        rotation: dict[str, list[str]] = {}
        for (model_id, account), submitted in oldest.items():
            rotation.setdefault(model_id, []).extend((str(turn_key(last.get((model_id, account)), submitted)), account))
        clocks: dict[str, int] = {}
        for (model_id, _), given in last.items():
            clocks[model_id] = max(clocks.get(model_id, 0), given)
        kinds = ("q:", "o:", "t:")
        staged_keys = [*staged, *(staged_base + kind + model_id for model_id in by_model for kind in kinds)]
        try:
            for model_id, members in by_model.items():
                model_keys = [staged_base + kind + model_id for kind in kinds]
                for start in range(0, len(members), REBUILD_CHUNK_JOBS):
                    # one framed string per chunk: redis-py packs 200,000 separate arguments 4x slower
                    blob = b"".join(b"%04d%06d%s" % (len(member), steps, member)
                                    for member, steps in members[start:start + REBUILD_CHUNK_JOBS])
                    self._load(keys=[*model_keys, staged[0], staged[1], staged[4]],
                               args=[model_id, blob, STAGING_TTL_MS, *(rotation[model_id] if start == 0 else [])])
            pairs = [item for (model_id, account), turn in last.items() for item in (framed(account) + model_id, turn)]
            for start in range(0, len(pairs), 2 * REBUILD_CHUNK_JOBS):
                self._load_turns(keys=[staged[2]], args=[STAGING_TTL_MS, *pairs[start:start + 2 * REBUILD_CHUNK_JOBS]])
            if clocks:
                self._load_turns(keys=[staged[3]], args=[STAGING_TTL_MS, *(i for kv in clocks.items() for i in kv)])
            return self._swap(keys=[self._lock, self._marker, self._jobs, self._counts, self._last, self._clocks,
                                    self._steps, *staged],
                              args=[token, self._base, staged_base, *by_model]) == 1
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

    def __init__(self, queues: RedisQueues, load: Callable[[], Iterable[QueuedJob]],
                 load_turns: Callable[[], Iterable[Turn]] | None = None) -> None:
        self.redis = queues
        self.load = load
        self.load_turns = load_turns

    def _retry(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except QueueLost:
            self.redis.recover(self.load, self.load_turns)
            return call()

    def __len__(self) -> int:
        return int(self._retry(self.redis.__len__))

    def __contains__(self, job_id: object) -> bool:
        return bool(self._retry(lambda: job_id in self.redis))

    def rebuild(self, jobs: Iterable[QueuedJob], turns: Iterable[Turn] = ()) -> None:
        self.redis.rebuild(jobs, turns)

    def rebuild_from(self, load: Callable[[], Iterable[QueuedJob]],
                     load_turns: Callable[[], Iterable[Turn]] | None = None) -> None:
        """Rebuild from `load()` and `load_turns()` (the database's queued rows and turns; an API
        process starting), unless another process is rebuilding it; both are kept to rebuild again
        whenever Redis loses the queue."""
        self.load, self.load_turns = load, load_turns
        self.redis.rebuild_from(load, load_turns)

    def push(self, job: QueuedJob) -> bool:
        return bool(self._retry(lambda: self.redis.push(job)))

    def remove(self, job_id: str) -> QueuedJob | None:
        return self._retry(lambda: self.redis.remove(job_id))

    def peek_for(self, model_ids: Iterable[str]) -> QueuedJob | None:
        models = list(model_ids)
        return self._retry(lambda: self.redis.peek_for(models))

    def pop_for(self, model_ids: Iterable[str], *, at_us: int | None = None) -> QueuedJob | None:
        models = list(model_ids)
        return self._retry(lambda: self.redis.pop_for(models, at_us=at_us))

    def position(self, job_id: str) -> int | None:
        return self._retry(lambda: self.redis.position(job_id))

    def positions(self, job_ids: Iterable[str]) -> dict[str, int]:
        ids = list(job_ids)
        return self._retry(lambda: self.redis.positions(ids))

    def demand(self) -> dict[str, tuple[int, int]]:
        return self._retry(self.redis.demand)

    def queued(self, model_id: str) -> list[QueuedJob]:
        return self._retry(lambda: self.redis.queued(model_id))

    def counts(self) -> dict[str, int]:
        return self._retry(self.redis.counts)

    def turns(self) -> list[Turn]:
        return self._retry(self.redis.turns)
