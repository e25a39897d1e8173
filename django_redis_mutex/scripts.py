"""The Lua scripts that make every lock operation one atomic round trip.

The keys of one lock and their layout are described in
:mod:`django_redis_mutex.keys` (:class:`~django_redis_mutex.keys.LockKeys`).
Every script is given every key it may touch, in KEYS, and touches no other:
on a Redis Cluster whose slot is being migrated, a script whose keys are not
all on one node is then redirected (ASK, TRYAGAIN) instead of running on part
of the lock's state. Each script states what it takes and answers as data
(see :class:`LuaScript`; :data:`SCRIPTS` lists them all): the scripts that
know the queue take the four keys of
:attr:`~django_redis_mutex.keys.LockKeys.script_keys`, in that order, then one
wake-up list.

Hand-off. A waiter blocks on its own list ``<lock>:wake:<token>``. A release
hands the lock to the first live waiter inside the script, so a releasing
process cannot barge back in ahead of the queue. The script can push that
waiter's wake-up only when its list is among the KEYS: the releasing holder
declares the list of the successor it expects, which it learned when it was
handed the lock (a wake-up carries the fence and the token of the waiter next
in line at that moment). When the first in line is someone else (the holder
got the lock uncontended, or its successor left or died), the script hands
the lock over all the same and returns the new holder's token, and the client
sends :data:`WAKE` for it as a second step. A wake-up lost with a client that
died between those steps costs the waiter at most one check-in: its next
ACQUIRE finds the lock already granted to it.

Shared holders (tokens starting with ``s``) are admitted by ACQUIRE_SHARED
while no exclusive holder has the lock and no exclusive waiter is first in
line; every other script serves both kinds, telling them apart by the token.
A hand-off to a shared waiter also admits the shared waiters right behind it,
so those scripts may answer with several tokens to wake, space-separated.

A wake-up is pushed only while the lock is the waiter's (inside the granting
script, or by WAKE after checking), and a waiter that takes a new place in line
has its list cleared, so a wake-up it pops was pushed after its last refused
check-in: the hand-over's lease counted from that check-in never outlasts the
real one.

Scripts are loaded once per server: callers send EVALSHA and fall back to
SCRIPT LOAD only when the server answers NOSCRIPT (see :func:`loading`). On a
plain redis-py client the EVALSHA is packed here and written to a pooled
connection directly (see :func:`_direct_pool` for when): redis-py's generic
command path costs more than the rest of a lock cycle's own work.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import redis
from redis.exceptions import NoScriptError

T = TypeVar("T")

__all__ = [
    "ACQUIRE",
    "ACQUIRE_SHARED",
    "CANCEL",
    "EXTEND",
    "FENCE_RETENTION",
    "HANDOFF_LEASE",
    "HELD_ALONE",
    "MARK_TRANSACTION",
    "MIGRATION_PROBE",
    "READ_STATE",
    "RELEASE",
    "RESET",
    "SCRIPTS",
    "WAIT_LEASE",
    "WAKE",
    "LuaScript",
    "aloading",
    "arun",
    "arun_acknowledged",
    "lease_ms",
    "loading",
    "packed_evalsha",
    "required",
    "run",
    "run_acknowledged",
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
# expires the next fence starts from the server clock, which is larger unless
# the clock stepped back (or, on a quorum, lags the master that gave the last
# fence) by more than this. An hour covers any clock a working NTP keeps, and
# bounds what a project locking a million names a day keeps in Redis to the
# names of the last hour, not of the last day.
FENCE_RETENTION = 3600.0

# The suffix of the key the migration guard looks up: never written by anyone.
MIGRATION_PROBE = ":never"

# Redis Cluster, while a lock's slot migrates: Redis runs a script there only
# when every key it declares is still on the node, but a key the script then
# empties (the last waiter leaving the queue, a released lock) is no longer
# "local", and touching it again stops the script half-way, after its first
# writes. A path that may empty a key and go on looks first, before its first
# write: a key of the lock's slot that never exists is looked up, which Redis
# refuses only while the slot migrates, and the script answers TRYAGAIN
# (retried by the client, then LockBackendUnavailable) having changed nothing.
# The contended cycle's common paths (joining the line, handing an exclusive
# lock to a live waiter) empty nothing they touch again, and skip it. The
# answer is an error reply returned from the script's top level: Redis 6.2
# makes no TRYAGAIN reply of an error raised with error().
_MIGRATING = rf"""
local settled = false
local MIGRATING = 'TRYAGAIN the slot of this lock is being migrated'
local function slot_migrating()
  if settled then return false end
  local probe = redis.pcall('EXISTS', KEYS[1] .. '{MIGRATION_PROBE}')
  settled = not (type(probe) == 'table' and probe.err ~= nil)
  return not settled
end
-- Inside helpers, which cannot return the reply: every path that reaches one
-- looked at the top level already, so this only stops a path that did not.
local function ensure_settled()
  if slot_migrating() then error(MIGRATING) end
end
"""


# A quorum hold's fence, written to a master's fence counter (KEYS[2]) as a
# floor when the hold is renewed or given back there, or when an operator
# resets the lock: the next majority, which overlaps this hold's in a master
# that held it, counts on from above it (see quorum.py). Also keeps the
# counter of a long hold from expiring. No floor ('' or none): nothing.
_FLOOR = rf"""
local function raise_floor(floor)
  if not floor or floor == '' then return end
  if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(floor) then
    redis.call('SET', KEYS[2], floor, 'PX', {int(FENCE_RETENTION * 1000)})
  else
    redis.call('PEXPIRE', KEYS[2], {int(FENCE_RETENTION * 1000)})
  end
end
"""

# A shared holder's record, one field 'r:<token>' of the lock hash: '<lease end
# ms>|<fence>|<taken ms>|<owner JSON>' (keys.SharedRecord reads it in Python).
# Read here and nowhere else: its lease end as a number, then the rest as text.
_SHARED_RECORD = r"""
local function shared_record(record)
  local a = string.find(record, '|', 1, true)
  local b = string.find(record, '|', a + 1, true)
  local c = string.find(record, '|', b + 1, true)
  return tonumber(string.sub(record, 1, a - 1)), string.sub(record, a + 1, b - 1),
         string.sub(record, b + 1, c - 1), string.sub(record, c + 1)
end
-- The server clock in ms, to compare with a lease end.
local function clock_ms()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
"""

_CONSTANTS = (
    f"local WAIT_LEASE = {int(WAIT_LEASE * 1000)}\n"
    f"local FENCE_RETENTION = {int(FENCE_RETENTION * 1000)}\n"
    f"local HANDOFF_LEASE = {int(HANDOFF_LEASE * 1000)}\n"
    # How many shared holders the lock admits at once: a semaphore's limit, or
    # 0 for no bound (a shared lock). Set by the script body before any grant.
    "local LIMIT = 0\n"
)

# The server clock in µs, as text (the fence it becomes) and as a number (a
# double holds it exactly); the text is built by hand, string.format costs more.
_CLOCK = r"""
local clock = redis.call('TIME')
local now_text = clock[1] .. string.sub('000000', #clock[2] + 1) .. clock[2]
local now = tonumber(now_text)
"""

# Granting: needed on the uncontended path, so defined before it.
_GRANT = r"""
-- Fencing token: strictly greater than the previous one for this name, and
-- never below the server clock in microseconds, so it keeps growing after the
-- counter itself expired (a name unused for FENCE_RETENTION) and after a
-- failover to a replica that had not seen the last one. The second value says
-- whether the fence is the clock (then it also tells when the lock was taken).
local function next_fence()
  local last = redis.call('SET', KEYS[2], now_text, 'PX', FENCE_RETENTION, 'GET')
  if last and tonumber(last) >= now then
    -- Same microsecond, or the clock is behind the counter: count on from the last.
    local text = string.format('%.0f', tonumber(last) + 1)
    redis.call('SET', KEYS[2], text, 'PX', FENCE_RETENTION)
    return text, false
  end
  return now_text, true
end

-- Set by a release that hands an exclusive lock straight on: the lock's hash
-- is still the last holder's, {acquired = whether it has that field}, and the
-- next grant writes over it (fewer commands than a DEL and a fresh hash).
local kept_lock = nil

-- Write the lock for token. 'acquired' (ms) is stored only when the fence
-- cannot tell it; 'queued' when someone already waits, so a release looks.
local function grant(token, ttl, owner, queued)
  local fence, on_clock = next_fence()
  if on_clock and not queued and not kept_lock then
    redis.call('HSET', KEYS[1], 'token', token, 'fence', fence, 'owner', owner)
  else
    -- One write, whatever it holds: a hand-over pays for no second HSET.
    local fields = {'token', token, 'fence', fence, 'owner', owner}
    if not on_clock then
      fields[7], fields[8] = 'acquired', string.sub(now_text, 1, -4)
    end
    if queued then
      fields[#fields + 1], fields[#fields + 2] = 'queued', '1'
    end
    redis.call('HSET', KEYS[1], unpack(fields))
    if kept_lock then
      -- What the last holder's hash had and this one's must not (it had 'queued').
      if on_clock and kept_lock.acquired then redis.call('HDEL', KEYS[1], 'acquired') end
      if not queued then redis.call('HDEL', KEYS[1], 'queued') end
      kept_lock = nil
    end
  end
  redis.call('PEXPIRE', KEYS[1], ttl)
  return fence
end

-- Shared holders: one field 'r:<token>' each, '<lease end ms>|<fence>|<taken
-- ms>|<owner JSON>', in the same hash, which then has no 'token' field. The
-- hash lives as long as its longest lease; a lease that ended is dropped by
-- the next script that looks (live_readers), so one dead holder never keeps
-- the others' lock. A shared token starts with 's' (exclusive ones are hex).
local function is_shared(token)
  return string.byte(token, 1) == 115
end

-- A semaphore's hash also keeps its limit ('limit'), so the scripts that hand
-- permits on without being told it (a release, a reset) admit no more.
local function grant_shared(token, ttl, owner)
  local fence = next_fence()
  local now_ms = math.floor(now / 1000)
  ttl = tonumber(ttl)
  redis.call('HSET', KEYS[1], 'r:' .. token,
             (now_ms + ttl) .. '|' .. fence .. '|' .. now_ms .. '|' .. owner)
  if LIMIT > 0 then redis.call('HSET', KEYS[1], 'limit', LIMIT) end
  if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
  return fence
end
"""

# The queue: only the contended paths reach these definitions.
_QUEUE = (
    _SHARED_RECORD
    + r"""
-- A waiter's record in the waiting hash: '<place lease end ms>|<ttl ms>|<owner
-- JSON>'. A place whose lease ended (its waiter stopped checking in) is
-- dropped when it comes first in line; until then it only takes up a place.
local function forget_waiter(token)
  redis.call('ZREM', KEYS[3], token)
  redis.call('HDEL', KEYS[4], token)
end

-- A waiter's record read: (ms its place lapses, {hand-off lease ms, owner}),
-- or nil when there is none or it cannot be read. An older version wrote
-- '<ttl ms>|<owner JSON>' and kept the lease apart: such a place counts as live.
local function waiter_terms(record)
  local a = record and string.find(record, '|', 1, true)
  if not a then return nil end
  if string.byte(record, a + 1) == 123 then
    local ttl = tonumber(string.sub(record, 1, a - 1))
    return ttl and math.huge, {ttl, string.sub(record, a + 1)}
  end
  local b = string.find(record, '|', a + 1, true)
  local ttl = b and tonumber(string.sub(record, a + 1, b - 1))
  return ttl and tonumber(string.sub(record, 1, a - 1)), {ttl, string.sub(record, (b or 0) + 1)}
end

-- The first two in line, and the first one's record: {head, next, record}.
local function peek_line()
  local pair = redis.call('ZRANGE', KEYS[3], 0, 1)
  if pair[1] then pair[3] = redis.call('HGET', KEYS[4], pair[1]) end
  return pair
end

-- The first waiter in line whose place is still live, its terms, and the
-- token right behind it (a hint: that one may have lapsed); nil when nobody
-- live waits. Lapsed places met first are forgotten on the way. ``peeked``:
-- what peek_line read, if the caller looked already.
local function first_live(now_ms, peeked)
  while true do
    local line = peeked or peek_line()
    peeked = nil
    local head = line[1]
    if not head then return nil end
    local ends, terms = waiter_terms(line[3])
    if ends and ends > now_ms then return head, terms, line[2] end
    ensure_settled()  -- forgetting it may empty the line, read again next
    forget_waiter(head)
  end
end

local function first_in_line()
  return redis.call('ZRANGE', KEYS[3], 0, 0)[1]
end

-- The fields of a shared holder's record: lease end (ms), fence, pttl left.
local function reader_state(value, now_ms)
  local ends, fence = shared_record(value)
  return ends, fence, ends - now_ms
end

-- Drop the shared holders whose lease ended; return how many are left, and
-- the ms until the first of their leases ends (0 with none). A hash left with
-- no holder at all is deleted, so the lock reads as free.
local function live_readers(now_ms)
  -- An exclusive lock that ended leaves no hash: nothing to read.
  if redis.call('EXISTS', KEYS[1]) == 0 then return 0, 0 end
  local fields = redis.call('HGETALL', KEYS[1])
  local live, exclusive, first = 0, false, 0
  for i = 1, #fields, 2 do
    local field = fields[i]
    if string.sub(field, 1, 2) == 'r:' then
      local ends = reader_state(fields[i + 1], now_ms)
      if ends <= now_ms then
        redis.call('HDEL', KEYS[1], field)
      else
        live = live + 1
        if first == 0 or ends - now_ms < first then first = ends - now_ms end
      end
    elseif field == 'token' then
      exclusive = true
    end
  end
  if live == 0 and not exclusive and #fields > 0 then redis.call('DEL', KEYS[1]) end
  return live, first
end

-- For the answer to a caller refused while the lock is held shared: the live
-- shared holder whose hold says most about when the caller gets in (for a
-- semaphore the longest held, whose permit is due first; for a shared lock
-- the latest taken, the last to leave), as its owner JSON and ms held; nil
-- when no shared holder is live.
local function holder_in_the_way(now_ms)
  local fields = redis.call('HGETALL', KEYS[1])
  local owner, taken = nil, nil
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'r:' then
      local ends, _, since, holder = shared_record(fields[i + 1])
      since = tonumber(since)
      if ends > now_ms and (not taken
          or (LIMIT > 0 and since < taken) or (LIMIT == 0 and since > taken)) then
        owner, taken = holder, since
      end
    end
  end
  if owner then return owner, math.max(0, now_ms - taken) end
  return nil, -1
end

-- A waiter leaves the line with its terms: (hand-off lease, owner).
local function leave_line(token, terms)
  forget_waiter(token)
  return math.min(terms[1], HANDOFF_LEASE), terms[2]
end

-- Give the lock to waiter head (first live in line, its terms, the token
-- behind it) with the hand-off lease: an exclusive waiter only when the lock is
-- free; a shared one (with the live shared waiters right behind it, as many as
-- LIMIT leaves room for beside the live shared holders) when no exclusive
-- holder has it. Wake the expected waiter here ({its token, its wake-up list}:
-- a list among the caller's KEYS, or nil); return false when nobody was
-- admitted, true when nobody else needs waking, else the other granted tokens,
-- space-separated, for the caller to send WAKE; and how many got in.
local function hand_to(head, terms, after, expected, live)
  local granted = {}
  if is_shared(head) then
    local room = math.huge
    if LIMIT > 0 then room = LIMIT - live end
    if room < 1 then return false, 0 end
    if kept_lock then
      -- Shared holders' records never share the hash with an exclusive one's.
      ensure_settled()
      redis.call('DEL', KEYS[1])
      kept_lock = nil
    end
    local now_ms = math.floor(now / 1000)
    repeat
      local ttl, owner = leave_line(head, terms)
      granted[#granted + 1] = {head, grant_shared(head, ttl, owner)}
      head, terms = first_live(now_ms)
    until not head or not is_shared(head) or #granted >= room
    after = head
    if after then redis.call('HSET', KEYS[1], 'queued', '1') end
  else
    local ttl, owner = leave_line(head, terms)
    granted[1] = {head, grant(head, ttl, owner, after)}
  end
  local others = {}
  for _, entry in ipairs(granted) do
    if expected and entry[1] == expected[1] then
      redis.call('RPUSH', expected[2], entry[2] .. '|' .. (after or ''))
      redis.call('PEXPIRE', expected[2], WAIT_LEASE)
    else
      others[#others + 1] = entry[1]
    end
  end
  if #others == 0 then return true, #granted end
  return table.concat(others, ' '), #granted
end

-- Give the first live waiter what ``live`` shared holders leave of the lock
-- (all of it when 0; room beside them for shared waiters): as hand_to, false
-- when nobody can be admitted.
local function hand_off(expected, live, peeked)
  local head, terms, after = first_live(math.floor(now / 1000), peeked)
  if not head or (live > 0 and not is_shared(head)) then return false end
  return hand_to(head, terms, after, expected, live)
end
"""
)


# How ACQUIRE and ACQUIRE_SHARED start: the granting helpers, and the caller's
# token and owner record (ARGV[1] and ARGV[3]).
_GRANTING = (
    _CONSTANTS
    + _MIGRATING
    + _CLOCK
    + _GRANT
    + "local token, owner = ARGV[1], ARGV[3]\n"
    # What the script read of the lock hash and still holds true when it joins
    # the line (token, owner, queued), or nil: _JOIN_LINE then reads again.
    + "local seen = nil\n"
)


@dataclass(frozen=True)
class LuaScript:
    """A Lua source, its SHA1 (computed once at import) and its contract.

    The contract is what a caller passes and gets back: ``keys`` and ``argv``
    name KEYS[1], KEYS[2]... and ARGV[1]... in order, the optional ones (only
    ever trailing) in brackets; ``returns`` says what the reply means.
    """

    name: str
    summary: str
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    returns: str
    source: str
    sha: str = field(init=False)
    # "EVALSHA <sha>" in the Redis protocol, the start of every call.
    packed_head: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode()).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "packed_head", b"$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % sha.encode())


def required(names: tuple[str, ...]) -> int:
    """Return how many of a contract's KEYS or ARGV ``names`` a caller must pass."""
    return sum(1 for name in names if not name.startswith("["))


# The end of ACQUIRE and ACQUIRE_SHARED for a caller that did not get the lock:
# join the line (when blocking) and answer {0, pttl ms of the lock, holder
# owner JSON or '', woken, ms the holder has held it or -1}.
_JOIN_LINE = r"""
if ARGV[4] ~= '0' then
  if redis.call('ZADD', KEYS[3], 'NX', now_text, token) == 1 and ARGV[4] == '1' then
    -- A new place in line: a wake-up left from an earlier hand-over that lapsed
    -- must not be taken for a new one. A token in line for the first time
    -- ('2') was never handed anything.
    redis.call('DEL', KEYS[5])
  end
  redis.call('HSET', KEYS[4], token,
             (now_ms + WAIT_LEASE) .. '|' .. ARGV[2] .. '|' .. owner)
  -- Waiters check in every half lease, so the queue outlives its last waiter
  -- by at most one lease.
  redis.call('PEXPIRE', KEYS[3], WAIT_LEASE)
  redis.call('PEXPIRE', KEYS[4], WAIT_LEASE)
  -- The lock is held here (by someone else, or by the waiter just handed it).
  if not (seen and seen[3]) then redis.call('HSET', KEYS[1], 'queued', '1') end
end
local owner_seen = seen and seen[2]
if not seen then owner_seen = redis.call('HGET', KEYS[1], 'owner') end
-- How long the holder seen has had the lock, for the caller's Retry-After
-- estimate: an exclusive holder's from 'acquired' (ms), else its fence (the
-- clock in µs); shared holders' from their records.
local held = -1
if seen and seen[4] then
  local taken = tonumber(seen[5]) or math.floor(tonumber(seen[4]) / 1000)
  held = math.max(0, now_ms - taken)
elseif not owner_seen then
  owner_seen, held = holder_in_the_way(now_ms)
end
return {0, pttl or redis.call('PTTL', KEYS[1]), owner_seen or '', woken, held}
"""


# The keys every script that knows the queue takes first (LockKeys.script_keys).
_LOCK_KEYS = ("lock", "fence", "queue", "waiting")

# The uncontended answer is the bare fence: a string, not a table, is cheaper.
ACQUIRE = LuaScript(
    "acquire",
    summary="Take the lock, or (blocking) a place in line.",
    keys=(*_LOCK_KEYS, "wake: the caller's wake-up list"),
    argv=(
        "token",
        "ttl ms",
        "owner JSON",
        "join: 0 to try once; when refused, 1 to wait in line, 2 to wait in line for the"
        " token's first time (no wake-up of it can exist)",
    ),
    returns="the fence when the caller now holds the lock for its ttl and nobody waits;"
    " {1, fence, pttl ms (-1: its ttl), token first in line behind it or ''} when it holds"
    " it; else {0, pttl ms of the holder, holder's owner JSON, '' or the token of a waiter"
    " just handed the expired lock, to WAKE, ms the holder has held it (-1: not known)};"
    " while the lock is held shared, the holder is the longest held of a semaphore's and the"
    " latest taken of a shared lock's",
    source=_GRANTING
    + r"""
if redis.call('EXISTS', KEYS[1], KEYS[3]) == 0 then
  -- Free and nobody waiting: the common, uncontended case, in one lookup.
  return grant(token, ARGV[2], owner, false)
end
local ttl = tonumber(ARGV[2])
"""
    + _QUEUE
    + r"""
-- The holder's token, owner record and queued flag, read once: a refused
-- caller answers with the owner (and how long it has held the lock, from its
-- fence and acquired fields) and joins the line with the flag set.
seen = redis.call('HMGET', KEYS[1], 'token', 'owner', 'queued', 'fence', 'acquired')
local holder = seen[1]
if holder == token then
  -- Handed to us between two check-ins: our wake-up is no longer needed.
  redis.call('DEL', KEYS[5])
  return {1, redis.call('HGET', KEYS[1], 'fence'), redis.call('PTTL', KEYS[1]),
          first_in_line() or ''}
end
local now_ms = math.floor(now / 1000)
local woken = ''
-- Ended shared records or lapsed places dropped below can empty a key read again.
if not holder and slot_migrating() then return redis.error_reply(MIGRATING) end
if not holder and live_readers(now_ms) == 0 then
  local head, terms, after = first_live(now_ms)
  if (not head) or head == token then
    if head then forget_waiter(token) end
    redis.call('DEL', KEYS[5])
    return {1, grant(token, ttl, owner, after), -1, after or ''}
  end
  -- The lock expired (no release woke anyone) and a live waiter is first in
  -- line: give it the lock now instead of letting it sleep out its timer. Its
  -- wake-up list is not ours to touch: the caller wakes it.
  woken = hand_to(head, terms, after, nil, 0)
  seen = nil
end
local pttl = nil
"""
    + _JOIN_LINE,
)


# A shared holder gets in whenever no exclusive holder has the lock, no
# exclusive waiter is ahead of it in line (a writer that waits blocks new
# readers, so a stream of readers never starves it), and the limit leaves room.
# A refused semaphore caller is told the ms until the first holder's lease ends
# (the first permit that may come free), not the last.
ACQUIRE_SHARED = LuaScript(
    "acquire_shared",
    summary="ACQUIRE for a shared holder (its token starts with 's') or a semaphore's permit.",
    keys=ACQUIRE.keys,
    argv=(*ACQUIRE.argv, "[limit: how many may hold at once, 0 for a shared lock]"),
    returns="as ACQUIRE's, and a {1, ...} answer may carry a fifth item: the shared waiters"
    " admitted with the caller, space-separated, for it to WAKE",
    source=_GRANTING
    + r"""
LIMIT = tonumber(ARGV[5]) or 0
if redis.call('EXISTS', KEYS[1], KEYS[3]) == 0 then
  return grant_shared(token, ARGV[2], owner)
end
if slot_migrating() then return redis.error_reply(MIGRATING) end
local ttl = tonumber(ARGV[2])
"""
    + _QUEUE
    + r"""
local now_ms = math.floor(now / 1000)
local mine = redis.call('HGET', KEYS[1], 'r:' .. token)
if mine then
  local _, fence, left = reader_state(mine, now_ms)
  if left > 0 then
    -- Handed to us between two check-ins: our wake-up is no longer needed.
    redis.call('DEL', KEYS[5])
    return {1, fence, left, first_in_line() or ''}
  end
end
local woken, pttl = '', nil
local found = redis.call('HMGET', KEYS[1], 'token', 'owner', 'queued', 'fence', 'acquired')
if found[1] then
  -- Held exclusively: what the refusal tells, and still true when we join the line.
  seen = found
else
  local live, first = live_readers(now_ms)
  local head, terms, after = first_live(now_ms)
  if head and head ~= token and is_shared(head) then
    -- Shared waiters are first in line and nobody handed them the lock (an
    -- exclusive lease ended, a writer ahead of them left, a permit's lease
    -- ended): they go in first, up to the next exclusive waiter or the limit,
    -- so nobody passes anyone in line.
    local admitted
    woken, admitted = hand_to(head, terms, after, nil, live)
    woken = woken or ''
    live = live + admitted
    mine = redis.call('HGET', KEYS[1], 'r:' .. token)
    if mine then
      -- We were in that run. The others are in the reply's fifth item, to wake.
      local _, fence, left = reader_state(mine, now_ms)
      redis.call('DEL', KEYS[5])
      return {1, fence, left, first_in_line() or '', woken}
    end
    head, terms, after = first_live(now_ms)
  end
  local room = LIMIT == 0 or live < LIMIT
  if room and ((not head) or head == token) then
    if head then forget_waiter(token) end
    redis.call('DEL', KEYS[5])
    local fence = grant_shared(token, ttl, owner)
    if after then redis.call('HSET', KEYS[1], 'queued', '1') end
    return {1, fence, -1, after or '', woken}
  end
  if live == 0 and head and not is_shared(head) then
    -- Free, and an exclusive waiter is first in line: it gets the lock now.
    woken = hand_to(head, terms, after, nil, 0)
  elseif LIMIT > 0 then
    -- Full: the first permit may come free when the first lease ends.
    pttl = first
  end
end
"""
    + _JOIN_LINE,
)

# A shared holder's release hands the lock on when it was the last (to an
# exclusive waiter), or when a shared waiter is first in line (a semaphore's
# permit come free).
RELEASE = LuaScript(
    "release",
    summary="Give the lock (or a shared hold) back, handing it to the first live waiter.",
    keys=(*_LOCK_KEYS, "[wake: the wake-up list of the waiter the holder expects next]"),
    argv=(
        "token",
        "[successor: that waiter's token, with its wake-up list, or '']",
        "[floor: a quorum hold's fence, for the fence counter]",
    ),
    returns="0 when the caller did not hold the lock (nothing is touched), 1 when released"
    " with nobody to hand it to, 2 when handed to the expected waiter and woken, else the"
    " token(s) of the waiter(s) it was handed to, space-separated, to WAKE",
    source=_MIGRATING
    + _FLOOR
    + r"""
local found = redis.call('HMGET', KEYS[1], 'token', 'queued', 'limit', 'acquired')
local shared = nil
if found[1] ~= ARGV[1] then
  if found[1] then return 0 end
  shared = redis.call('HGET', KEYS[1], 'r:' .. ARGV[1])
  if not shared then return 0 end
  if slot_migrating() then return redis.error_reply(MIGRATING) end
elseif not found[2] then
  -- Nobody waits: the lock is all there is to delete.
  raise_floor(ARGV[3])
  redis.call('DEL', KEYS[1])
  return 1
end
"""
    + _CONSTANTS
    + _CLOCK
    + _GRANT
    + _QUEUE
    + r"""
LIMIT = tonumber(found[3]) or 0
local live = 0
if not shared then
  -- Someone waits: the next holder's grant writes over this hash (see grant).
  kept_lock = {acquired = found[4] ~= false}
else
  local now_ms = math.floor(now / 1000)
  -- A shared lease that ended is no longer the caller's, even while its
  -- record waits to be dropped: 0, as for an expired exclusive lock. The
  -- first waiter's next check-in finds the lock free.
  local ended = reader_state(shared, now_ms) <= now_ms
  redis.call('HDEL', KEYS[1], 'r:' .. ARGV[1])
  live = live_readers(now_ms)
  if ended then return 0 end
  raise_floor(ARGV[3])
  if not found[2] then return 1 end
end
local peeked = nil
if not shared then
  -- Nothing written yet. Forgetting a lapsed first waiter, or a fresh hash for
  -- a shared one, may touch an emptied key again, and a floor is a write
  -- before them: look at the slot first then.
  peeked = peek_line()
  local settle = ARGV[3] and ARGV[3] ~= ''
  if peeked[1] then
    local ends = waiter_terms(peeked[3])
    settle = settle or is_shared(peeked[1]) or not (ends and ends > math.floor(now / 1000))
  end
  if settle and slot_migrating() then return redis.error_reply(MIGRATING) end
  raise_floor(ARGV[3])
end
local successor = ARGV[2] ~= '' and ARGV[2]
local handed = hand_off(successor and {successor, KEYS[5]}, live, peeked)
if handed == false then
  -- Nobody live to take it: the lock is free.
  if kept_lock then redis.call('DEL', KEYS[1]) end
  return 1
end
if handed == true then return 2 end
return handed
""",
)

# A lock that is gone is never re-created: a renewal must not resurrect it.
EXTEND = LuaScript(
    "extend",
    summary="Set the caller's lease to ttl from now.",
    keys=("lock", "[fence: with a floor]"),
    argv=("token", "ttl ms", "[floor: a quorum hold's fence, for the fence counter]"),
    returns="1 when renewed, 0 when the caller does not hold the lock",
    source=_FLOOR
    + _SHARED_RECORD
    + r"""
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  raise_floor(ARGV[3])
  return 1
end
-- A shared holder: its own lease, in its record; the hash lives as long as
-- the longest. A lease that already ended is not brought back.
local field = 'r:' .. ARGV[1]
local record = redis.call('HGET', KEYS[1], field)
if not record then return 0 end
local now_ms = clock_ms()
local ends, fence, taken, owner = shared_record(record)
if ends <= now_ms then
  redis.call('HDEL', KEYS[1], field)
  return 0
end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], field, (now_ms + ttl) .. '|' .. fence .. '|' .. taken .. '|' .. owner)
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
raise_floor(ARGV[3])
return 1
""",
)

# A lock left free (or with room) while others wait is handed to the first of
# them, so nobody sleeps on a free lock.
CANCEL = LuaScript(
    "cancel",
    summary="Leave the line: the waiter gives up (timeout, interrupt, cancellation).",
    keys=ACQUIRE.keys,
    argv=("token", "[limit: a semaphore's, as for ACQUIRE_SHARED]"),
    returns="{1, fence, pttl ms, token first in line behind it or ''} when the lock had"
    " already been handed to the caller (it now holds it and must use or release it), else"
    " {0}, or {0, token(s)} of the waiter(s) handed the lock, to WAKE",
    source=_CONSTANTS
    + _MIGRATING
    + _CLOCK
    + _GRANT
    + _QUEUE
    + r"""
if slot_migrating() then return redis.error_reply(MIGRATING) end
local token = ARGV[1]
LIMIT = tonumber(ARGV[2]) or 0
forget_waiter(token)
redis.call('DEL', KEYS[5])
local holder = redis.call('HGET', KEYS[1], 'token')
if holder == token then
  return {1, redis.call('HGET', KEYS[1], 'fence'), redis.call('PTTL', KEYS[1]),
          first_in_line() or ''}
end
local now_ms = math.floor(now / 1000)
local mine = redis.call('HGET', KEYS[1], 'r:' .. token)
if mine then
  local _, fence, left = reader_state(mine, now_ms)
  if left > 0 then return {1, fence, left, first_in_line() or ''} end
end
if not holder then
  -- Free, or shared holders have it and shared waiters now first in line may
  -- join them.
  local handed = hand_off(nil, (live_readers(now_ms)))
  if handed then return {0, handed} end
end
return {0}
""",
)

# An operator's action: the waiters keep their places, and the first is handed
# the lock as on a release.
RESET = LuaScript(
    "reset",
    summary="Force release whoever holds the lock, or every permit of a semaphore.",
    keys=_LOCK_KEYS,
    argv=("[floor: on a quorum, the largest fence its masters' holders have]",),
    returns="{how many held it (an exclusive holder, or each shared holder or permit whose"
    " lease had not ended), '' or the token(s) of the waiter(s) handed the lock, to WAKE}",
    source=_MIGRATING
    + _FLOOR
    + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, ''} end
if slot_migrating() then return redis.error_reply(MIGRATING) end
raise_floor(ARGV[1])
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
"""
    + _CONSTANTS
    + _CLOCK
    + _GRANT
    + _QUEUE
    + r"""
local now_ms = math.floor(now / 1000)
local holders = 0
for i = 1, #fields, 2 do
  local field = fields[i]
  if field == 'token' then
    holders = holders + 1
  elseif field == 'limit' then
    LIMIT = tonumber(fields[i + 1]) or 0
  elseif string.sub(field, 1, 2) == 'r:' and reader_state(fields[i + 1], now_ms) > now_ms then
    holders = holders + 1
  end
end
local woken = hand_off(nil, 0)
if type(woken) ~= 'string' then woken = '' end
return {holders, woken}
""",
)


# Pushed only while the lock is still the waiter's, so a late WAKE never
# announces a lock it lost since.
WAKE = LuaScript(
    "wake",
    summary="Wake a waiter a script handed the lock to but could not wake"
    " (its list was not among that script's KEYS).",
    keys=("lock", "queue", "wake: the waiter's wake-up list"),
    argv=("token: the waiter's",),
    returns="1 when pushed, 0 when the lock is no longer that waiter's",
    source=f"local WAIT_LEASE = {int(WAIT_LEASE * 1000)}\n"
    + _SHARED_RECORD
    + r"""
local found = redis.call('HMGET', KEYS[1], 'token', 'fence', 'r:' .. ARGV[1])
local fence = found[2]
if found[1] ~= ARGV[1] then
  -- A shared holder's.
  if found[1] or not found[3] then return 0 end
  fence = select(2, shared_record(found[3]))
end
local after = redis.call('ZRANGE', KEYS[2], 0, 0)[1] or ''
redis.call('RPUSH', KEYS[3], fence .. '|' .. after)
redis.call('PEXPIRE', KEYS[3], WAIT_LEASE)
return 1
""",
)


# In the owner record, so that listings on any host can say so. A hand-over
# writes the next holder's own record, which drops the mark.
MARK_TRANSACTION = LuaScript(
    "mark_transaction",
    summary="Record in the holder's owner record that its block has ended and the lock"
    " is kept until its database transaction ends.",
    keys=("lock",),
    argv=("token", "owner JSON: with the mark"),
    returns="1 when written, 0 when the caller no longer holds the lock",
    source=_SHARED_RECORD
    + r"""
if string.sub(ARGV[1], 1, 1) ~= 's' then
  if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
  return 1
end
-- A shared holder's record.
local field = 'r:' .. ARGV[1]
local record = redis.call('HGET', KEYS[1], field)
if not record then return 0 end
local ends, fence, taken = shared_record(record)
redis.call('HSET', KEYS[1], field, ends .. '|' .. fence .. '|' .. taken .. '|' .. ARGV[2])
return 1
""",
)


# Asked by a quorum acquisition that a master refused: a name means one lock,
# whether it is taken on one member or on the quorum.
HELD_ALONE = LuaScript(
    "held_alone",
    summary="Tell whether a lock taken on this Redis alone (not a quorum's, whose tokens"
    " start with 'q', or 'sq' held shared) holds the lock here.",
    keys=("lock",),
    argv=(),
    returns="1 if such a lock holds it (exclusive or shared), else 0",
    source=_SHARED_RECORD
    + r"""
local token = redis.call('HGET', KEYS[1], 'token')
if token then
  if string.sub(token, 1, 1) == 'q' then return 0 end
  return 1
end
local now_ms = clock_ms()
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local field = fields[i]
  if string.sub(field, 1, 2) == 'r:' and string.sub(field, 1, 4) ~= 'r:sq'
      and shared_record(fields[i + 1]) > now_ms then
    return 1
  end
end
return 0
""",
)


# A script rather than plain commands so that a quorum asks every master with
# it at once, each within its own deadline, as it does with its other scripts.
READ_STATE = LuaScript(
    "read_state",
    summary="Read who holds the lock on this Redis and for how long, at one instant,"
    " changing nothing.",
    keys=("lock",),
    argv=("token: the caller's, or ''",),
    returns="{exclusive holder's token or '', pttl ms of the lock (-2: no lock), its owner"
    " JSON or '', ms left of the token's hold here (0: none), the live shared holders'"
    " tokens, their owner JSONs, the largest fence of the holders here (0: none)}",
    source=_SHARED_RECORD
    + r"""
local found = redis.call('HMGET', KEYS[1], 'token', 'owner', 'fence')
local token = found[1]
local pttl = redis.call('PTTL', KEYS[1])
if token then
  local mine = 0
  if token == ARGV[1] then mine = pttl end
  return {token, pttl, found[2] or '', mine, {}, {}, found[3] or '0'}
end
-- Held shared, or not at all.
local now_ms = clock_ms()
local fields = redis.call('HGETALL', KEYS[1])
local tokens, owners, mine, fence = {}, {}, 0, '0'
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 2) == 'r:' then
    local ends, held, _, owner = shared_record(fields[i + 1])
    if ends > now_ms then
      tokens[#tokens + 1] = string.sub(fields[i], 3)
      owners[#owners + 1] = owner
      if tokens[#tokens] == ARGV[1] then mine = ends - now_ms end
      if tonumber(held) > tonumber(fence) then fence = held end
    end
  end
end
return {'', pttl, '', mine, tokens, owners, fence}
""",
)


# Every script the locks run, for what reads their contracts (the docs, the tests).
SCRIPTS = (
    ACQUIRE,
    ACQUIRE_SHARED,
    RELEASE,
    EXTEND,
    CANCEL,
    RESET,
    WAKE,
    MARK_TRANSACTION,
    HELD_ALONE,
    READ_STATE,
)


def lease_ms(seconds: float) -> int:
    """Return a lease in whole milliseconds for a script argument (at least 1)."""
    return max(1, int(seconds * 1000))


def loading(
    send: Callable[..., T],
    load: Callable[..., object],
    *args: Any,
    sent: Callable[..., T] | None = None,
) -> T:
    """Return ``send(*args)``; if the server answers NOSCRIPT, ``load(*args)`` and send again.

    A server forgets its scripts on a restart, a failover to a replica that
    never loaded them, or SCRIPT FLUSH: loading once more brings them back,
    and a second NOSCRIPT is an error. ``sent`` reads the answer to an EVALSHA
    already on its way, in place of the first ``send``. The arguments are
    passed through, not bound in closures: this runs on every lock call.
    """
    try:
        return (sent or send)(*args)
    except NoScriptError:
        load(*args)
        return send(*args)


async def aloading(
    send: Callable[..., Awaitable[T]], load: Callable[..., Awaitable[object]], *args: Any
) -> T:
    """Async twin of :func:`loading`."""
    try:
        return await send(*args)
    except NoScriptError:
        await load(*args)
        return await send(*args)


def _load(client: Any, script: LuaScript, *_: Any) -> Any:
    """Send SCRIPT LOAD for ``script`` (awaitable on an asyncio client)."""
    return client.script_load(script.source)


def run(client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Run ``script`` with EVALSHA, loading it once if the server does not know it."""
    return loading(_evalsha, _load, client, script, keys, args)


def _evalsha(client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    pool = _direct_pool(client)
    if pool is None:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    connection = pool.get_connection()
    if getattr(getattr(connection, "retry", None), "_retries", 1) != 0:
        # The connection retries failed commands: let redis-py do that, on a
        # connection of its own choosing (holding this one as well would take
        # two from the pool per call, and exhaust a bounded pool).
        pool.release(connection)
        return client.evalsha(script.sha, len(keys), *keys, *args)
    try:
        packed = _pack(script, keys, args)
        try:
            connection.send_packed_command([packed])
            return connection.read_response()
        except redis.ResponseError:
            raise  # the reply was read whole: the connection is ready for the next command
        except BaseException:
            # A send or read that fails midway disconnects itself, but an
            # exception landing between the two (a signal handler's, an
            # async one) would leave our reply unread on the connection, for
            # the next command to take as its own.
            connection.disconnect()
            raise
    finally:
        pool.release(connection)


_PLAIN_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)


def _direct_pool(client: Any) -> Any:
    """Return the pool to send EVALSHA through directly, or None to call ``client.evalsha``.

    Only a plain ``redis.Redis`` (not a subclass, not a single-connection
    client) over a plain connection pool with UTF-8 keys qualifies, and only
    while nothing wraps redis-py's ``execute_command`` (tracing and APM
    instrumentations do): their users must keep seeing our commands.
    """
    if type(client) is not redis.Redis or client.connection is not None:
        return None
    pool = client.connection_pool
    if type(pool) not in _PLAIN_POOLS:
        return None
    kwargs = pool.connection_kwargs
    if kwargs.get("encoding", "utf-8") != "utf-8" or kwargs.get("encoding_errors", "strict") != (
        "strict"
    ):
        return None
    execute = redis.Redis.execute_command
    if type(execute) is not types.FunctionType or execute.__module__ != "redis.client":
        return None
    if hasattr(execute, "__wrapped__"):
        return None
    return pool


def packed_evalsha(
    client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[Any]
) -> bytes | None:
    """Return EVALSHA of ``script`` packed for ``client``'s connections, or None.

    None when its commands must go through redis-py's own packing (see
    :func:`_direct_pool`); a quorum writes the packed request to each master's
    connection itself.
    """
    return None if _direct_pool(client) is None else _pack(script, keys, args)


@lru_cache(maxsize=4096)
def _packed_keys(keys: tuple[str, ...]) -> bytes:
    return b"".join(b"$%d\r\n%s\r\n" % (len(key.encode()), key.encode()) for key in keys)


def _pack(script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    """Return EVALSHA of ``script`` with ``keys`` and ``args`` in the Redis protocol.

    Encoded as redis-py encodes them on a UTF-8 connection: text as UTF-8,
    numbers as their repr.
    """
    count = b"%d" % len(keys)
    parts = [
        b"*%d\r\n" % (3 + len(keys) + len(args)),
        script.packed_head,
        b"$%d\r\n%s\r\n" % (len(count), count),
    ]
    rest: Sequence[Any] = (*keys, *args)
    if len(keys) >= 4:
        # The four keys every queue-aware call starts with, packed once per lock.
        parts.append(_packed_keys(tuple(keys[:4])))
        rest = (*keys[4:], *args)
    for item in rest:
        if isinstance(item, str):
            data = item.encode()
        elif isinstance(item, bytes):
            data = item
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            data = repr(item).encode()
        else:
            raise TypeError(f"Cannot send {type(item).__name__} to a lock script.")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def arun(client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Async twin of :func:`run`."""
    return await aloading(_send_evalsha, _load, client, script, keys, args)


def _send_evalsha(client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    return client.evalsha(script.sha, len(keys), *keys, *args)


# WAIT counts the replication offset of the calling connection's last write,
# so it must follow the script on the same connection: the two are sent as one
# non-transactional pipeline (one round trip, one pooled connection).


def _send_with_wait(*call: Any) -> Any:
    """Return the replies to a run_acknowledged() ``call`` (awaitable on an asyncio client)."""
    client, script, keys, args, replicas, timeout = call
    pipe = client.pipeline(transaction=False)
    pipe.evalsha(script.sha, len(keys), *keys, *args)
    pipe.wait(replicas, lease_ms(timeout))
    return pipe.execute(raise_on_error=False)


def _acknowledged(results: list[Any]) -> tuple[Any, int]:
    reply, acknowledged = results
    if isinstance(reply, Exception):
        raise reply
    if isinstance(acknowledged, Exception):
        raise acknowledged
    return reply, int(acknowledged)


def _run_with_wait(*call: Any) -> tuple[Any, int]:
    return _acknowledged(_send_with_wait(*call))


async def _arun_with_wait(*call: Any) -> tuple[Any, int]:
    return _acknowledged(await _send_with_wait(*call))


def run_acknowledged(
    client: Any,
    script: LuaScript,
    keys: Sequence[str],
    args: Sequence[Any],
    replicas: int,
    timeout: float,
) -> tuple[Any, int]:
    """Run ``script`` and WAIT up to ``timeout`` s for ``replicas`` to acknowledge its write.

    Return the script's reply and how many replicas acknowledged.
    """
    return loading(_run_with_wait, _load, client, script, keys, args, replicas, timeout)


async def arun_acknowledged(*call: Any) -> tuple[Any, int]:
    """Async twin of :func:`run_acknowledged`: the same arguments, an asyncio client."""
    return await aloading(_arun_with_wait, _load, *call)
