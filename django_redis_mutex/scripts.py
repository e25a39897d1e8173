"""The Lua scripts that make every lock operation one atomic round trip.

Every script of a lock takes one key, the lock itself, and derives the names
of the lock's other keys from it; all of them carry the same Redis Cluster
hash tag (see :mod:`django_redis_mutex.keys`), so they live in one slot::

    KEYS[1]            lock      hash: token, fence, owner (JSON), acquired (ms), name
    KEYS[1]:fence      string: the last fencing token handed out for this name
    KEYS[1]:queue      zset: waiting tokens, scored by arrival (FIFO order)
    KEYS[1]:leases     zset: waiting tokens, scored by the ms their wait lease ends
    KEYS[1]:waiting    hash: waiting token -> "<ttl ms>|<owner JSON>"

Passing one key instead of five halves what each call sends (measured: the
argument packing was the client's largest cost per cycle).

A waiter is woken by a push onto its own list ``<lock key>:wake:<token>``
(same hash tag, so same slot; the scripts derive its name from KEYS[1]). The
lock is handed over *inside* the release script to the first live waiter, so a
releasing process cannot barge back in ahead of the queue and a woken waiter
never has to race for the lock.

Scripts are loaded once per server: callers send EVALSHA and fall back to
SCRIPT LOAD only when the server answers NOSCRIPT (see :func:`run`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

__all__ = [
    "ACQUIRE",
    "CANCEL",
    "EXTEND",
    "FENCE_RETENTION",
    "HANDOFF_LEASE",
    "RAISE_FENCE",
    "RELEASE",
    "RESET",
    "WAIT_LEASE",
    "LuaScript",
    "arun",
    "lease_ms",
    "run",
]

# A waiter's place in line lasts this long unless it checks in again, so a
# waiter that died is skipped after at most this long. Waiters check in every
# half lease. Also the life of an unread wake-up list.
WAIT_LEASE = 2.0
# A lock handed to a waiter starts with at most this lease (the watchdog then
# renews it to the full TTL): a waiter that died in its queue slot stalls the
# others for this long, not for a whole TTL.
HANDOFF_LEASE = 2 * WAIT_LEASE
# How long a fence counter outlives the last acquisition of its name. After it
# expires the next fence starts from the server clock, which is still larger.
FENCE_RETENTION = 24 * 3600.0

# Helpers shared by the scripts that can hand the lock to a waiter.
_COMMON = (
    (
        f"local WAIT_LEASE = {int(WAIT_LEASE * 1000)}\n"
        f"local FENCE_RETENTION = {int(FENCE_RETENTION * 1000)}\n"
        f"local HANDOFF_LEASE = {int(HANDOFF_LEASE * 1000)}\n"
        "local WAKE_PREFIX = KEYS[1] .. ':wake:'\n"
        "local FENCE_KEY = KEYS[1] .. ':fence'\n"
        "local QUEUE = KEYS[1] .. ':queue'\n"
        "local LEASES = KEYS[1] .. ':leases'\n"
        "local WAITING = KEYS[1] .. ':waiting'\n"
    )
    + r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Fencing token: strictly greater than the previous one for this name, and
-- never below the server clock in microseconds, so it keeps growing even after
-- the counter key itself expired (a name unused for FENCE retention).
local function next_fence(now)
  local text = string.format('%.0f', now)
  local last = redis.call('SET', FENCE_KEY, text, 'PX', FENCE_RETENTION, 'GET')
  if last and tonumber(last) >= now then
    -- Same microsecond, or the server clock stepped back: count on from the last.
    text = string.format('%.0f', tonumber(last) + 1)
    redis.call('SET', FENCE_KEY, text, 'PX', FENCE_RETENTION)
  end
  return text
end

local function grant(token, ttl, owner, name, now)
  local fence = next_fence(now)
  redis.call('HSET', KEYS[1], 'token', token, 'fence', fence, 'owner', owner,
             'acquired', string.format('%.0f', math.floor(now / 1000)), 'name', name)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return fence
end

local function forget_waiter(token)
  redis.call('ZREM', QUEUE, token)
  redis.call('ZREM', LEASES, token)
  redis.call('HDEL', WAITING, token)
end

local function prune_dead_waiters(now_ms)
  local dead = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now_ms)
  for _, token in ipairs(dead) do forget_waiter(token) end
end

-- Give the free lock to the first live waiter and wake it with its fence.
local function hand_off(name, now)
  prune_dead_waiters(math.floor(now / 1000))
  local head = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  if not head then return false end
  local info = redis.call('HGET', WAITING, head) or ''
  forget_waiter(head)
  local sep = string.find(info, '|', 1, true)
  local ttl, owner = 30000, '{}'
  if sep then
    ttl = tonumber(string.sub(info, 1, sep - 1))
    owner = string.sub(info, sep + 1)
  end
  local fence = grant(head, math.min(ttl, HANDOFF_LEASE), owner, name, now)
  local wake = WAKE_PREFIX .. head
  redis.call('RPUSH', wake, fence)
  redis.call('PEXPIRE', wake, WAIT_LEASE)
  return head
end
"""
)


@dataclass(frozen=True)
class LuaScript:
    """A Lua source and its SHA1, computed once at import."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# ACQUIRE
# KEYS[1] the lock (the others are derived from it, as above).
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] owner JSON, ARGV[4] lock name,
# ARGV[5] 1 to join the queue when contended (blocking) or 0 (try once).
# Returns {1, fence} when the caller now holds the lock, {1, fence, pttl ms}
# when it had been handed over already (with the shorter hand-off lease), else
# {0, pttl ms of the holder, holder owner JSON}.
ACQUIRE = LuaScript(
    "acquire",
    _COMMON
    + r"""
local token, ttl, owner, name = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local now = now_us()
if redis.call('EXISTS', KEYS[1], QUEUE) == 0 then
  -- Free and nobody waiting: the common, uncontended case, in one lookup.
  return {1, grant(token, ttl, owner, name, now)}
end
local holder = redis.call('HGET', KEYS[1], 'token')
if holder == token then
  forget_waiter(token)
  redis.call('DEL', WAKE_PREFIX .. token)
  return {1, redis.call('HGET', KEYS[1], 'fence'), redis.call('PTTL', KEYS[1])}
end
local now_ms = math.floor(now / 1000)
if not holder then
  prune_dead_waiters(now_ms)
  local head = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  if (not head) or head == token then
    forget_waiter(token)
    return {1, grant(token, ttl, owner, name, now)}
  end
  -- The lock expired (no release woke anyone) and a live waiter is first in
  -- line: give it the lock now instead of letting it sleep out its timer.
  hand_off(name, now)
end
if ARGV[5] == '1' then
  redis.call('ZADD', QUEUE, 'NX', now, token)  -- NX: keep our place in line
  redis.call('ZADD', LEASES, now_ms + WAIT_LEASE, token)
  redis.call('HSET', WAITING, token, ARGV[2] .. '|' .. owner)
  -- Waiters check in every half lease, so the queue outlives its last waiter
  -- by at most one lease.
  redis.call('PEXPIRE', QUEUE, WAIT_LEASE)
  redis.call('PEXPIRE', LEASES, WAIT_LEASE)
  redis.call('PEXPIRE', WAITING, WAIT_LEASE)
end
return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[1], 'owner') or ''}
""",
)

# RELEASE
# KEYS[1] the lock (the others are derived from it, as above).  ARGV[1] token.
# Returns 0 when the caller did not hold the lock (nothing is touched),
# 1 when released with nobody waiting, 2 when handed to the next waiter.
RELEASE = LuaScript(
    "release",
    _COMMON
    + r"""
local found = redis.call('HMGET', KEYS[1], 'token', 'name')
if found[1] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', QUEUE) == 0 then return 1 end
if hand_off(found[2] or '', now_us()) then return 2 end
return 1
""",
)

# EXTEND
# KEYS[1] lock.  ARGV[1] token, ARGV[2] new ttl ms.
# Returns 1 when the lease was set to ttl from now, 0 when the caller does not
# hold the lock (it is never re-created: a renewal must not resurrect a lock).
EXTEND = LuaScript(
    "extend",
    r"""
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""",
)

# CANCEL: a waiter gives up (timeout, interrupt, cancellation).
# KEYS[1] the lock (the others are derived from it, as above).  ARGV[1] token, ARGV[2] lock name.
# Returns {1, fence, pttl ms} when the lock had already been handed to the
# caller (it now holds it and must use or release it), else {0}. If the lock is free and
# others wait, the next one is handed the lock so nobody sleeps on a free lock.
CANCEL = LuaScript(
    "cancel",
    _COMMON
    + r"""
local token = ARGV[1]
forget_waiter(token)
redis.call('DEL', WAKE_PREFIX .. token)
if redis.call('HGET', KEYS[1], 'token') == token then
  return {1, redis.call('HGET', KEYS[1], 'fence'), redis.call('PTTL', KEYS[1])}
end
if redis.call('EXISTS', KEYS[1]) == 0 then hand_off(ARGV[2], now_us()) end
return {0}
""",
)

# RESET: force release whoever holds the lock (operator action).
# KEYS[1] the lock (the others are derived from it, as above).  No ARGV.
# Returns 1 when a lock was held and removed, else 0. The next waiter, if any,
# is handed the lock and woken, as on a normal release.
RESET = LuaScript(
    "reset",
    _COMMON
    + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local name = redis.call('HGET', KEYS[1], 'name') or ''
redis.call('DEL', KEYS[1])
hand_off(name, now_us())
return 1
""",
)


# RAISE_FENCE: after a quorum acquisition, make every master's counter at least
# the fence handed out, so the next majority (which overlaps this one) counts on
# from above it.
# KEYS[1] fence counter.  ARGV[1] the fence.  Returns 1 if the counter moved.
RAISE_FENCE = LuaScript(
    "raise_fence",
    f"local FENCE_RETENTION = {int(FENCE_RETENTION * 1000)}\n"
    + r"""
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', FENCE_RETENTION)
return 1
""",
)


def lease_ms(seconds: float) -> int:
    """Return a lease in whole milliseconds for a script argument (at least 1)."""
    return max(1, int(seconds * 1000))


def run(client: Any, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
    """Run ``script`` with EVALSHA, loading it once if the server does not know it."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.source)
        return client.evalsha(script.sha, len(keys), *keys, *args)


async def arun(client: Any, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
    """Async twin of :func:`run`."""
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        await client.script_load(script.source)
        return await client.evalsha(script.sha, len(keys), *keys, *args)
