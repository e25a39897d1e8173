"""The Lua scripts of counting semaphores (see :mod:`django_redis_mutex.semaphore`).

One semaphore's keys (``<sem>`` is ``<namespace>:semaphore:{<escaped name>}``,
so all of them share one Redis Cluster hash tag) are passed, in this order::

    KEYS[1] <sem>:holders  zset: holder token -> the ms (server clock) its lease ends
    KEYS[2] <sem>:owners   hash: holder token -> owner JSON (for display)
    KEYS[3] <sem>:queue    zset: waiting token -> arrival (µs, FIFO order)
    KEYS[4] <sem>:leases   zset: waiting token -> the ms its place in line lapses
    KEYS[5] <sem>:waiting  hash: waiting token -> "<ttl ms>|<owner JSON>"
    KEYS[6] <sem>:limit    string: the limit last used (for display)
    KEYS[7] <sem>:wake:<token>  list: one waiter's wake-up (only where stated)

Every script first drops holders whose lease ended (by the server clock), so a
dead holder's permit comes back when its lease ends, and not before. Free
permits go to the live waiters first in line, inside the script, so a newcomer
never takes a permit ahead of the queue. A script may push a wake-up only to a
list in its KEYS. A holder learns, when granted, which waiter was first in
line then, and its release declares that waiter's list: when that waiter is
the one handed the permit, the release wakes it itself. Other waiters handed
permits (by a release whose expected waiter left or was served by another
holder, a cancel, a reset, an acquisition that found leases ended) are
returned by the script, and the client sends :data:`SEM_WAKE` for each. A wake-up lost with a
client that died between the two costs the waiter at most one check-in (every
half wait lease), whose :data:`SEM_ACQUIRE` finds the permit already granted.

Every key expires: the holder keys with the last lease, the queue keys a wait
lease after the last check-in, the limit with whichever is later.
"""

from __future__ import annotations

from .scripts import HANDOFF_LEASE, WAIT_LEASE, LuaScript

__all__ = [
    "SEM_ACQUIRE",
    "SEM_CANCEL",
    "SEM_EXTEND",
    "SEM_MARK_TRANSACTION",
    "SEM_RELEASE",
    "SEM_RESET",
    "SEM_WAKE",
]

_COMMON = (
    f"local WAIT_LEASE = {int(WAIT_LEASE * 1000)}\n"
    f"local HANDOFF_LEASE = {int(HANDOFF_LEASE * 1000)}\n"
    + r"""
local clock = redis.call('TIME')
-- µs as text for the queue's arrival score (a double holds it, '%.14g' would not).
local now_text = clock[1] .. string.sub('000000', #clock[2] + 1) .. clock[2]
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function prune_holders()
  local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, token in ipairs(dead) do
    redis.call('ZREM', KEYS[1], token)
    redis.call('HDEL', KEYS[2], token)
  end
end

local function forget_waiter(token)
  redis.call('ZREM', KEYS[3], token)
  redis.call('ZREM', KEYS[4], token)
  redis.call('HDEL', KEYS[5], token)
end

local function prune_dead_waiters()
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, token in ipairs(dead) do forget_waiter(token) end
end

local function grant(token, ttl, owner)
  redis.call('ZADD', KEYS[1], now + ttl, token)
  redis.call('HSET', KEYS[2], token, owner)
end

-- Give free permits to the first live waiters in line. A waiter other than
-- me gets the short hand-off lease (it may have died in line; its next
-- check-in starts its full lease). The waiter expected (whose wake-up list
-- the caller declared as KEYS[7]) is woken here; return the tokens of the
-- others, which the caller must wake, and whether me was granted.
local function hand_out(limit, me, my_ttl, my_owner, expected)
  prune_dead_waiters()
  local woken, mine = {}, false
  while redis.call('ZCARD', KEYS[1]) < limit do
    local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not head then break end
    local info = redis.call('HGET', KEYS[5], head) or ''
    forget_waiter(head)
    if head == me then
      grant(head, my_ttl, my_owner)
      mine = true
    else
      local ttl, owner = HANDOFF_LEASE, '{}'
      local sep = string.find(info, '|', 1, true)
      if sep then
        ttl = math.min(tonumber(string.sub(info, 1, sep - 1)), HANDOFF_LEASE)
        owner = string.sub(info, sep + 1)
      end
      grant(head, ttl, owner)
      if expected and head == expected then
        redis.call('RPUSH', KEYS[7], '1')
        redis.call('PEXPIRE', KEYS[7], WAIT_LEASE)
      else
        woken[#woken + 1] = head
      end
    end
  end
  return woken, mine
end

-- Expiries: holder keys live as long as the last lease; the limit as long as
-- that or the queue, whichever is later. Return ms until the first lease ends
-- (0 when nobody holds a permit).
local function settle(limit)
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  local keep = 0
  if last[2] then
    keep = tonumber(last[2]) - now
    redis.call('PEXPIRE', KEYS[1], keep)
    redis.call('PEXPIRE', KEYS[2], keep)
  else
    redis.call('DEL', KEYS[1], KEYS[2])
  end
  if redis.call('EXISTS', KEYS[3]) == 1 and keep < WAIT_LEASE then keep = WAIT_LEASE end
  if keep > 0 then
    redis.call('SET', KEYS[6], limit, 'PX', keep)
  else
    redis.call('DEL', KEYS[6])
  end
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if first[2] then return tonumber(first[2]) - now end
  return 0
end
"""
)

# SEM_ACQUIRE: take a permit, or (ARGV[4] == '1') take or keep a place in line.
# KEYS[1..6] as above; KEYS[7] the caller's wake-up list.
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] owner JSON, ARGV[4] 1 to wait in line or
# 0 to try once, ARGV[5] limit.
# Returns {1, successor, woken...} when the caller now holds a permit for ttl ms
# from now (also when it had been handed one while away), successor being the
# token first in line at that moment or ''; else {0, ms until the first
# holder's lease ends, woken...}; woken are the waiters this script handed
# permits to, which the caller must wake with SEM_WAKE.
SEM_ACQUIRE = LuaScript(
    "semaphore_acquire",
    _COMMON
    + r"""
local token, ttl, owner, limit = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
prune_holders()
local woken, mine = {}, false
if redis.call('ZSCORE', KEYS[1], token) then
  -- Handed a permit since our last check-in: its full lease starts now.
  grant(token, ttl, owner)
  mine = true
else
  woken, mine = hand_out(limit, token, ttl, owner)
  -- hand_out stops at a full semaphore or an empty line: a permit left over
  -- is free for a newcomer without passing anyone.
  if not mine and redis.call('ZCARD', KEYS[1]) < limit then
    grant(token, ttl, owner)
    mine = true
  end
end
if mine then
  forget_waiter(token)
  redis.call('DEL', KEYS[7])
elseif ARGV[4] == '1' then
  if redis.call('ZADD', KEYS[3], 'NX', now_text, token) == 1 then
    -- A new place in line: an old wake-up must not be taken for a new one.
    redis.call('DEL', KEYS[7])
  end
  redis.call('ZADD', KEYS[4], now + WAIT_LEASE, token)
  redis.call('HSET', KEYS[5], token, ARGV[2] .. '|' .. owner)
  -- Waiters check in every half lease: the line outlives its last waiter by
  -- at most one lease.
  redis.call('PEXPIRE', KEYS[3], WAIT_LEASE)
  redis.call('PEXPIRE', KEYS[4], WAIT_LEASE)
  redis.call('PEXPIRE', KEYS[5], WAIT_LEASE)
end
local first = settle(limit)
local reply = {0, first}
if mine then reply = {1, redis.call('ZRANGE', KEYS[3], 0, 0)[1] or ''} end
for _, handed in ipairs(woken) do reply[#reply + 1] = handed end
return reply
""",
)

# SEM_RELEASE: give a permit back and hand free permits to the line.
# KEYS[1..6] as above; KEYS[7] (optional) the wake-up list of the waiter the
# holder expects to be next (first in line when it was granted its permit).
# ARGV[1] token, ARGV[2] limit, ARGV[3] (with KEYS[7]) that waiter's token.
# The expected waiter, if handed a permit, is woken here, not returned.
# Returns {1, woken...} when the caller held a permit, {0, woken...} when it
# did not (its lease had ended, or it was reset); woken as for SEM_ACQUIRE.
SEM_RELEASE = LuaScript(
    "semaphore_release",
    _COMMON
    + r"""
prune_holders()
local held = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local woken = hand_out(tonumber(ARGV[2]), nil, 0, '', ARGV[3])
settle(tonumber(ARGV[2]))
local reply = {held}
for _, handed in ipairs(woken) do reply[#reply + 1] = handed end
return reply
""",
)

# SEM_CANCEL: a waiter gives up (timeout, interrupt, cancellation). A permit
# handed to it meanwhile is given back and passed on.
# KEYS[1..6] as above; KEYS[7] the caller's wake-up list.
# ARGV[1] token, ARGV[2] limit.
# Returns {woken...} as for SEM_ACQUIRE.
SEM_CANCEL = LuaScript(
    "semaphore_cancel",
    _COMMON
    + r"""
prune_holders()
forget_waiter(ARGV[1])
redis.call('DEL', KEYS[7])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local woken = hand_out(tonumber(ARGV[2]), nil, 0, '')
settle(tonumber(ARGV[2]))
return woken
""",
)

# SEM_EXTEND: renew one permit's lease (the watchdog, extend()).
# KEYS[1..6] as above.  ARGV[1] token, ARGV[2] ttl ms, ARGV[3] limit.
# Returns 1 when the lease now ends ttl ms from now, 0 when the caller holds no
# permit (a renewal never re-creates one whose lease ended).
SEM_EXTEND = LuaScript(
    "semaphore_extend",
    _COMMON
    + r"""
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
settle(tonumber(ARGV[3]))
return 1
""",
)

# SEM_RESET: free every permit (operator action) and hand them to the line.
# KEYS[1..6] as above.  No ARGV.
# Returns {permits freed, woken...}; woken as for SEM_ACQUIRE. The limit used is
# the stored one (it lives as long as the line does).
SEM_RESET = LuaScript(
    "semaphore_reset",
    _COMMON
    + r"""
prune_holders()
local freed = redis.call('ZCARD', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
local limit = tonumber(redis.call('GET', KEYS[6]) or '0')
local woken = hand_out(limit, nil, 0, '')
settle(limit)
local reply = {freed}
for _, handed in ipairs(woken) do reply[#reply + 1] = handed end
return reply
""",
)

# SEM_WAKE: push the wake-up of a waiter another script handed a permit to,
# only while it still holds that permit.
# KEYS[1] holders, KEYS[2] the waiter's wake-up list.  ARGV[1] its token.
# Returns 1 when pushed, 0 when the waiter holds no permit.
SEM_WAKE = LuaScript(
    "semaphore_wake",
    f"local WAIT_LEASE = {int(WAIT_LEASE * 1000)}\n"
    + r"""
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], WAIT_LEASE)
return 1
""",
)


# SEM_MARK_TRANSACTION: record in a holder's owner record that its block has
# ended and the permit is kept until its database transaction ends (for
# listings), while the holder still holds its permit.
# KEYS[1] holders, KEYS[2] owners.  ARGV[1] its token, ARGV[2] the marked owner JSON.
# Returns 1 when written, 0 when the token holds no permit.
SEM_MARK_TRANSACTION = LuaScript(
    "semaphore_mark_transaction",
    r"""
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
""",
)
