"""Every key a lock script touches is one it declared in KEYS (the Redis Cluster contract).

On a Redis Cluster whose slot is being migrated, Redis checks the keys a
script *declares* and redirects it (ASK, or TRYAGAIN when they are split
between the nodes); a key the script reaches on its own is just looked up on
the node it runs on, missing if it moved already, and written anew beside the
moved copy. So the contract is checked for the whole class of operations, not
for one script at a time:

* a random mix of every lock operation (uncontended and contended, hand-offs
  with and without a known successor, timeouts, interrupted waits, resets,
  extensions, renewals, listings, quorum locks) runs against a real
  redis-server while MONITOR records every command, and each command a script
  ran must touch only keys that script declared (``COMMAND GETKEYS`` says
  which keys a command touches);
* on a real Redis Cluster, part of a lock's keys is moved to another primary
  by hand (``SETSLOT MIGRATING/IMPORTING`` and ``MIGRATE``): every operation
  then either runs against the whole lock or fails with
  ``LockBackendUnavailable`` after redis-py's TRYAGAIN retries, and never
  leaves a second copy of a moved key on the source;
* with every key still on the source of a migrating slot, a script that
  empties a key and touches it again would stop half-way: each script runs
  there from states built for its paths that empty a key, and from random
  states (waiters, shared holders and semaphore permits, lapsed places and
  leases) with a random call, and must run whole or be refused with TRYAGAIN
  having changed nothing.

The random mix takes its seed from ``DECLARED_KEYS_SEED`` (random otherwise);
a failure names it.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.test import override_settings
from redis.exceptions import TryAgainError

from django_redis_mutex import (
    LockBackendUnavailable,
    LockNotOwned,
    Mutex,
    held_locks,
    mutex,
    reset,
    reset_all,
)
from django_redis_mutex import scripts as lock_scripts
from django_redis_mutex.keys import LockKeys, escape_name
from django_redis_mutex.testing import RedisClusterServers, RedisServer

from .helpers import wait_until
from .topologies import cluster_entry, extra_caches

SEED = int(os.environ.get("DECLARED_KEYS_SEED") or random.randrange(2**32))
QUORUM = ["q1", "q2", "q3"]
SCRIPT_NAMES = {script.sha: script.name for script in lock_scripts.SCRIPTS}
_STOP = b"declared-keys-monitor-stop"


# -- reading MONITOR ---------------------------------------------------------------------------


@dataclass
class Command:
    """One command a server executed, as MONITOR showed it."""

    source: str  # "lua" for a command a script ran, else the client's address
    args: list[bytes]

    @property
    def name(self) -> str:
        return self.args[0].decode().upper()


def parse_monitor_line(line: bytes) -> Command:
    """Return the command of one MONITOR line: ``<time> [<db> <source>] "ARG" "ARG" ...``.

    Arguments are quoted the way Redis prints them (``sdscatrepr``):
    backslash escapes for quotes, backslashes, ``\\n \\r \\t \\a \\b`` and
    ``\\xHH`` for other unprintable bytes.
    """
    open_at = line.index(b"[")
    close_at = line.index(b"]", open_at)
    source = line[open_at + 1 : close_at].split(b" ", 1)[1].decode()
    text = line[close_at + 1 :]
    escapes = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("a"): 7, ord("b"): 8}
    args: list[bytes] = []
    i = 0
    while i < len(text):
        if text[i] == ord(" "):
            i += 1
            continue
        assert text[i] == ord('"'), f"unexpected MONITOR line {line!r}"
        i += 1
        arg = bytearray()
        while text[i] != ord('"'):
            if text[i] == ord("\\"):
                escaped = text[i + 1]
                if escaped == ord("x"):
                    arg.append(int(text[i + 2 : i + 4], 16))
                    i += 4
                    continue
                arg.append(escapes.get(escaped, escaped))
                i += 2
                continue
            arg.append(text[i])
            i += 1
        args.append(bytes(arg))
        i += 1
    return Command(source, args)


class Monitor:
    """Record every command a redis-server executes, from MONITOR, until :meth:`stop`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.client = redis.Redis(port=port)
        self.connection = self.client.connection_pool.get_connection()
        self.connection.send_command("MONITOR")
        assert self.connection.read_response() in (b"OK", "OK")
        self.lines: list[bytes] = []
        self.thread = threading.Thread(target=self._read, name="monitor", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            line = self.connection.read_response()
            if _STOP in line:
                return
            self.lines.append(line)

    def stop(self) -> list[Command]:
        """Stop recording; return the commands seen, in the order the server ran them."""
        self.client.echo(_STOP)
        self.thread.join(30)
        assert not self.thread.is_alive(), "MONITOR never showed its stop marker"
        self.connection.disconnect()
        self.client.close()
        return [parse_monitor_line(line) for line in self.lines]


@dataclass
class ScriptRun:
    """One EVALSHA (or EVAL) and the commands it ran."""

    script: str
    declared: set[bytes]
    ran: list[Command] = field(default_factory=list)


def script_runs(commands: list[Command]) -> list[ScriptRun]:
    """Group the commands a script ran under the EVALSHA that ran it (MONITOR shows it first)."""
    runs: list[ScriptRun] = []
    current: ScriptRun | None = None
    for command in commands:
        if command.source == "lua":
            assert current is not None, f"{command.args!r} ran by no script in sight"
            current.ran.append(command)
        elif command.name in ("EVALSHA", "EVAL"):
            count = int(command.args[2])
            sha = command.args[1].decode()
            current = ScriptRun(SCRIPT_NAMES.get(sha, sha), set(command.args[3 : 3 + count]))
            runs.append(current)
        else:
            current = None
    return runs


class KeysOf:
    """``COMMAND GETKEYS`` on the server: which of a command's arguments are keys."""

    def __init__(self, port: int) -> None:
        self.client = redis.Redis(port=port)
        self.cache: dict[tuple[bytes, ...], set[bytes]] = {}

    def __call__(self, args: list[bytes]) -> set[bytes]:
        key = tuple(args)
        if key not in self.cache:
            connection = self.client.connection_pool.get_connection()
            try:
                connection.send_command("COMMAND", "GETKEYS", *args)
                try:
                    self.cache[key] = set(connection.read_response())
                except redis.ResponseError:  # TIME and the like take no key
                    self.cache[key] = set()
            finally:
                self.client.connection_pool.release(connection)
        return self.cache[key]

    def close(self) -> None:
        self.client.close()


def undeclared(runs: list[ScriptRun], keys_of: KeysOf) -> list[str]:
    """Return a line per command that touched a key its script did not declare."""
    found = []
    for run in runs:
        # The migration guard's lookup of a key that never exists, in the lock's slot.
        probes = {key + lock_scripts.MIGRATION_PROBE.encode() for key in run.declared}
        for command in run.ran:
            extra = keys_of(command.args) - run.declared
            if command.name == "EXISTS" and extra <= probes:
                continue
            if extra:
                found.append(
                    f"{run.script}: {b' '.join(command.args)!r} touched {sorted(extra)!r}, "
                    f"declared {sorted(run.declared)!r}"
                )
    return found


# -- the random mix ----------------------------------------------------------------------------


@pytest.fixture
def monitored(mutex_prefix: str) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A private redis-server as the default alias, and a quorum of its databases 1-3."""
    with RedisServer() as server:
        entries = copy.deepcopy(settings.CACHES)
        entries["default"]["LOCATION"] = server.url
        for index, alias in enumerate(QUORUM, start=1):
            entries[alias] = copy.deepcopy(entries["default"])
            entries[alias]["LOCATION"] = f"redis://127.0.0.1:{server.port}/{index}"
            entries[alias]["MUTEX"] = {"PREFIX": mutex_prefix}
        client = redis.Redis(port=server.port)
        try:
            with override_settings(CACHES=entries):
                yield server, client
        finally:
            client.close()


class Mix:
    """The operations of the random mix; each leaves no lock held and no thread running."""

    def __init__(self, raw: redis.Redis, rng: random.Random) -> None:
        self.raw = raw
        self.rng = rng
        self.errors: list[BaseException] = []

    def name(self) -> str:
        # Few names, so operations meet each other's leftovers (a queue, a fence).
        return self.rng.choice(["mix:a", "mix:b", "mix:{c}"])

    def queued(self, name: str) -> int:
        return int(self.raw.zcard(Mutex(name).keys.queue))

    def waiter(self, name: str, timeout: float = 10, hold: float = 0.0) -> threading.Thread:
        """Start a thread that waits for ``name``, holds it ``hold`` s, then releases it."""

        def run() -> None:
            try:
                lock = Mutex(name, timeout=timeout)
                if lock.acquire():
                    threading.Event().wait(hold)
                    lock.release()
            except BaseException as exc:  # reported by the test, not lost in the thread
                self.errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def join(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            thread.join(20)
            assert not thread.is_alive(), "a waiter never finished"

    def queue_behind(self, holder: Mutex, count: int, **waiter: Any) -> list[threading.Thread]:
        """Start ``count`` waiters for ``holder``'s lock, one at a time (so in a known order)."""
        threads = []
        already = self.queued(holder.name)
        for index in range(count):
            threads.append(self.waiter(holder.name, **waiter))
            wait_until(
                lambda n=already + index + 1: self.queued(holder.name) >= n,
                10,
                "a waiter to queue",
            )
        return threads

    # The operations. -------------------------------------------------------------------------

    def uncontended(self) -> None:
        with mutex(self.name()):
            pass

    def contended(self) -> None:
        # The first waiter is woken by WAKE (the holder got the lock uncontended
        # and knows no successor); each later one by the release script itself.
        holder = Mutex(self.name(), timeout=10)
        assert holder.acquire()
        threads = self.queue_behind(holder, self.rng.randint(2, 3), hold=0.01)
        holder.release()
        self.join(threads)

    def timeout(self) -> None:
        holder = Mutex(self.name(), timeout=10)
        assert holder.acquire()
        assert not Mutex(holder.name, timeout=0.15).acquire()  # CANCEL at the deadline
        holder.release()

    def reset(self) -> None:
        holder = Mutex(self.name(), timeout=10)
        assert holder.acquire()
        threads = self.queue_behind(holder, 1)
        assert reset(holder.name) is True  # RESET hands the lock to the waiter, WAKE wakes it
        self.join(threads)
        with pytest.raises(LockNotOwned):
            holder.release()

    def expired(self) -> None:
        # The holder's lease lapses with a waiter in line: the next ACQUIRE (a
        # newcomer's, or the waiter's own check-in) gives the lock to the waiter.
        holder = Mutex(self.name(), timeout=10, watchdog=False)
        assert holder.acquire()
        threads = self.queue_behind(holder, 1, hold=0.05)
        self.raw.pexpire(holder.keys.lock, 1)
        wait_until(lambda: not self.raw.exists(holder.keys.lock), 5, "the lease to lapse")
        newcomer = Mutex(holder.name, reentrant=False)
        if newcomer.acquire(blocking=False):
            newcomer.release()
        self.join(threads)

    def interrupted(self) -> None:
        # An async waiter cancelled while the lock is free and another waits:
        # CANCEL hands the lock to the other one.
        holder = Mutex(self.name(), timeout=10, watchdog=False)
        assert holder.acquire()
        started = threading.Event()
        stop = threading.Event()

        async def wait_then_give_up() -> None:
            task = asyncio.ensure_future(Mutex(holder.name, timeout=10).aacquire())
            started.set()
            await asyncio.to_thread(stop.wait, 10)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the cancelled waiter got the lock")

        def run() -> None:
            try:
                asyncio.run(wait_then_give_up())
            except BaseException as exc:
                self.errors.append(exc)

        first = threading.Thread(target=run, daemon=True)
        first.start()
        assert started.wait(5)
        wait_until(lambda: self.queued(holder.name) >= 1, 10, "the async waiter to queue")
        (second,) = self.queue_behind(holder, 1)
        self.raw.pexpire(holder.keys.lock, 1)
        wait_until(lambda: not self.raw.exists(holder.keys.lock), 5, "the lease to lapse")
        stop.set()
        self.join([first, second])

    def extend(self) -> None:
        with mutex(self.name()) as lock:
            lock.extend(5)
            assert lock.time_left() > 1

    def renewed(self) -> None:
        # The watchdog renews a third into the lease, in a pipeline of EXTENDs.
        with mutex(self.name(), ttl=1.5):
            threading.Event().wait(0.6)

    def listing(self) -> None:
        with mutex(self.name()) as lock:
            assert lock.name in {held.name for held in held_locks()}
        if self.rng.random() < 0.3:
            reset_all()

    def quorum(self) -> None:
        with mutex(self.name(), using=QUORUM) as lock:
            assert not Mutex(lock.name, using=QUORUM, reentrant=False).acquire(blocking=False)

    def member_held(self) -> None:
        # A plain lock on one member: the quorum wins the other two, then asks
        # that member who holds it (HELD_ALONE) and gives way.
        with mutex(self.name(), using=QUORUM[0]) as lock:
            assert not Mutex(lock.name, using=QUORUM).acquire(blocking=False)

    def in_transaction(self) -> None:
        # Kept until the COMMIT: the owner record is marked (MARK_TRANSACTION).
        with transaction.atomic(), mutex(self.name()):
            pass


@pytest.mark.django_db(transaction=True)
def test_every_key_a_script_touches_is_declared_in_its_keys(
    monitored: tuple[RedisServer, redis.Redis],
) -> None:
    server, raw = monitored
    mix = Mix(raw, random.Random(SEED))
    operations: list[Callable[[], None]] = [
        mix.uncontended,
        mix.contended,
        mix.timeout,
        mix.reset,
        mix.expired,
        mix.interrupted,
        mix.extend,
        mix.renewed,
        mix.listing,
        mix.quorum,
        mix.member_held,
        mix.in_transaction,
    ]
    plan = operations + [mix.rng.choice(operations) for _ in range(20)]
    mix.rng.shuffle(plan)
    monitor = Monitor(server.port)
    try:
        for operation in plan:
            operation()
    finally:
        commands = monitor.stop()
    assert mix.errors == [], f"seed {SEED}"
    assert held_locks() == []

    keys_of = KeysOf(server.port)
    try:
        runs = script_runs(commands)
        assert undeclared(runs, keys_of) == [], f"seed {SEED}"
    finally:
        keys_of.close()
    ran = {run.script for run in runs}
    assert ran >= {
        *("acquire", "release", "cancel", "reset", "extend", "wake"),
        *("held_alone", "mark_transaction"),
    }
    # Both ways of waking a waiter ran: inside RELEASE, and by WAKE.
    pushed_by = {run.script for run in runs if any(c.name == "RPUSH" for c in run.ran)}
    assert pushed_by >= {"release", "wake"}, f"seed {SEED}"


def test_monitor_lines_are_parsed_with_their_escapes() -> None:
    line = b'1.5 [0 lua] "HSET" "a \\"b\\"" "\\x00\\n\\\\" "{\\xc3\\xa9}"'

    command = parse_monitor_line(line)

    assert command.source == "lua"
    assert command.args == [b"HSET", b'a "b"', b"\x00\n\\", "{é}".encode()]


# -- a slot migration splitting a lock ---------------------------------------------------------

ALIAS = "cluster"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers(primaries=2) as running:
        yield running


@pytest.fixture
def cluster_caches(cluster: RedisClusterServers, mutex_prefix: str) -> Iterator[None]:
    with extra_caches({ALIAS: cluster_entry(cluster, mutex_prefix)}):
        yield


def node_ids(cluster: RedisClusterServers) -> dict[int, str]:
    return {node.port: command(node.port, "CLUSTER", "MYID").decode() for node in cluster.nodes}


def command(port: int, *args: Any) -> Any:
    client = redis.Redis(port=port)
    try:
        return client.execute_command(*args)
    finally:
        client.close()


class SplitSlot:
    """The slot of one lock, half moved from ``source`` to ``target`` (MIGRATING/IMPORTING)."""

    def __init__(self, cluster: RedisClusterServers, keys: LockKeys, name: str) -> None:
        from redis.crc import key_slot

        self.slot = key_slot(escape_name(name).encode())
        ids = node_ids(cluster)
        owner = command(cluster.nodes[0].port, "CLUSTER", "SLOTS")
        source_port = next(int(r[2][1]) for r in owner if int(r[0]) <= self.slot <= int(r[1]))
        self.source = source_port
        self.target = next(port for port in ids if port != source_port)
        self.ids = ids
        self.keys = keys

    def begin(self) -> None:
        command(self.target, "CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.ids[self.source])
        command(self.source, "CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.ids[self.target])

    def move(self, *keys: str) -> None:
        command(self.source, "MIGRATE", "127.0.0.1", self.target, "", 0, 5000, "KEYS", *keys)

    def on(self, port: int) -> set[str]:
        """Return the keys of the slot stored on ``port`` (asked without redirection)."""
        found = command(port, "CLUSTER", "GETKEYSINSLOT", self.slot, 100)
        return {key.decode() for key in found}

    def abort(self) -> None:
        """End the migration with every key where it was (``SETSLOT STABLE`` on both nodes)."""
        for port in (self.target, self.source):
            command(port, "CLUSTER", "SETSLOT", self.slot, "STABLE")

    def finish(self) -> None:
        left = sorted(self.on(self.source))
        if left:
            self.move(*left)
        for port in (self.target, self.source):
            command(port, "CLUSTER", "SETSLOT", self.slot, "NODE", self.ids[self.target])


def test_a_lock_split_by_a_slot_migration_is_refused_never_run_on_part_of_it(
    cluster: RedisClusterServers, cluster_caches: None
) -> None:
    name = f"split:{random.randrange(10**9)}"
    holder = Mutex(name, using=ALIAS, watchdog=False)
    assert holder.acquire()
    first_fence = holder.fence or 0
    keys = holder.keys
    split = SplitSlot(cluster, keys, name)
    split.begin()
    try:
        split.move(keys.fence)  # the lock stays on the source, its fence counter moved
        before = split.on(split.source)
        assert before == {keys.lock}

        with pytest.raises(LockBackendUnavailable):
            Mutex(name, using=ALIAS, reentrant=False).acquire(blocking=False)
        with pytest.raises(LockBackendUnavailable):
            holder.release()  # kept for a retry, as after any outage
        with pytest.raises(LockBackendUnavailable):
            reset(name, using=ALIAS)
        holder.extend(30)  # touches the lock key only, which is all on the source

        # Nothing ran on part of the lock: no fence, queue or wake-up key was
        # made on the source beside the moved ones.
        assert split.on(split.source) == before
        assert split.on(split.target) == {keys.fence}
    finally:
        split.finish()

    holder.release()  # the retry, now that the slot has moved
    successor = Mutex(name, using=ALIAS)
    assert successor.acquire(blocking=False)
    assert (successor.fence or 0) > first_fence
    successor.release()
    assert split.on(split.target) == {keys.fence}


# -- a migrating slot whose keys are all still on the source -----------------------------------
#
# Redis runs a script on a migrating slot when every key it declares is still on
# the source. A key the script then empties (the last waiter leaving the queue,
# the lock deleted before it is handed on) is no longer "local" there, and the
# next command on it stops the script half-way, its first writes done. Each case
# builds, with the lock scripts themselves, a state in which its script empties
# a key and goes on, or (for the scripts that never do) an ordinary contended
# lock; every lock script has a case.


def run_on(port: int, script: lock_scripts.LuaScript, keys: list[str], *args: Any) -> Any:
    return command(port, "EVAL", script.source, len(keys), *keys, *args)


def token(shared: bool = False) -> str:
    return ("s" if shared else "") + uuid.uuid4().hex


def join(port: int, keys: LockKeys, who: str, *, ttl: int = 30_000, limit: int = 0) -> Any:
    """Take the lock or a place in line for ``who`` (shared when its token says so)."""
    declared = [*keys.script_keys, keys.wake(who)]
    if who.startswith("s"):
        return run_on(port, lock_scripts.ACQUIRE_SHARED, declared, who, ttl, "{}", 1, limit)
    return run_on(port, lock_scripts.ACQUIRE, declared, who, ttl, "{}", 1)


def record_ended(port: int, keys: LockKeys, who: str) -> bool:
    """Whether the lease in shared holder ``who``'s record has ended by the server's clock."""
    record = command(port, "HGET", keys.lock, f"r:{who}")
    seconds, micros = command(port, "TIME")
    return int(record.split(b"|")[0]) <= int(seconds) * 1000 + int(micros) // 1000


def unpopped_wake_up(port: int, keys: LockKeys, who: str) -> None:
    """A wake-up ``who`` has not popped yet: its list is among the KEYS it declares."""
    command(port, "RPUSH", keys.wake(who), "0|")
    command(port, "PEXPIRE", keys.wake(who), 30_000)


def holder_and_waiter(port: int, keys: LockKeys) -> tuple[str, str]:
    holder, waiter = token(), token()
    join(port, keys, holder)
    join(port, keys, waiter)
    unpopped_wake_up(port, keys, waiter)
    return holder, waiter


Called = tuple[list[str], list[Any]]


def release_handing_over(port: int, keys: LockKeys) -> Called:
    holder, _ = holder_and_waiter(port, keys)
    # The waiter's leaving empties the queue; the lock is written over for it.
    return list(keys.script_keys), [holder]


def release_past_a_lapsed_place(port: int, keys: LockKeys) -> Called:
    holder, waiter = holder_and_waiter(port, keys)
    _ends, terms = command(port, "HGET", keys.waiting, waiter).split(b"|", 1)
    command(port, "HSET", keys.waiting, waiter, b"1|" + terms)
    # Forgetting the lapsed place empties the queue, which is read again.
    return list(keys.script_keys), [holder]


def quorum_release_past_a_lapsed_place(port: int, keys: LockKeys) -> Called:
    declared, (holder,) = release_past_a_lapsed_place(port, keys)
    # The floor raises the fence counter before the lapsed place is forgotten.
    return declared, [holder, "", 2**60]


def release_to_a_shared_waiter(port: int, keys: LockKeys) -> Called:
    holder, reader = token(), token(shared=True)
    join(port, keys, holder)
    join(port, keys, reader)  # refused: an exclusive holder has the lock
    # The lock is deleted, then written for the reader.
    return list(keys.script_keys), [holder]


def joining_the_line(port: int, keys: LockKeys) -> Called:
    holder_and_waiter(port, keys)
    caller = token()
    unpopped_wake_up(port, keys, caller)
    return [*keys.script_keys, keys.wake(caller)], [caller, 30_000, "{}", 1]


def reset_handing_over(port: int, keys: LockKeys) -> Called:
    holder_and_waiter(port, keys)
    return list(keys.script_keys), []


def cancel_of_the_last_waiter(port: int, keys: LockKeys) -> Called:
    reader, waiter = token(shared=True), token()
    join(port, keys, reader)
    join(port, keys, waiter)  # refused: a shared holder has the lock
    unpopped_wake_up(port, keys, waiter)
    # Leaving empties the queue, and the hand-off that follows reads it again.
    return [*keys.script_keys, keys.wake(waiter)], [waiter]


def permit_freed_for_the_only_waiter(port: int, keys: LockKeys) -> Called:
    brief, steady, waiter = token(shared=True), token(shared=True), token(shared=True)
    join(port, keys, brief, ttl=150, limit=2)
    join(port, keys, steady, limit=2)
    join(port, keys, waiter, limit=2)  # refused: both permits are taken
    unpopped_wake_up(port, keys, waiter)
    wait_until(lambda: record_ended(port, keys, brief), 10, "the brief permit's lease to end")
    # Admitted in the room the ended lease left, the waiter empties the queue, then reads it.
    return [*keys.script_keys, keys.wake(waiter)], [waiter, 30_000, "{}", 1, 2]


def ended_shared_lock_handed_on(port: int, keys: LockKeys) -> Called:
    reader, waiter, caller = token(shared=True), token(), token()
    join(port, keys, reader)
    join(port, keys, waiter)  # in line behind the shared holder
    # The holder renews for a shorter lease: its record ends, the hash lives on.
    assert run_on(port, lock_scripts.EXTEND, [keys.lock], reader, 150) == 1
    wait_until(lambda: record_ended(port, keys, reader), 10, "the renewed lease to end")
    unpopped_wake_up(port, keys, caller)
    # The ended record goes and the hash with it, then the lock is written for the waiter.
    return [*keys.script_keys, keys.wake(caller)], [caller, 30_000, "{}", 1]


def contended(
    keys_of: Callable[[LockKeys, str, str], list[str]], args_of: Callable[[str, str], list[Any]]
) -> Callable[[int, LockKeys], Called]:
    """A held lock with a waiter in line, for a script that empties no key it touches again."""

    def build(port: int, keys: LockKeys) -> Called:
        holder, waiter = holder_and_waiter(port, keys)
        return keys_of(keys, holder, waiter), args_of(holder, waiter)

    return build


CASES: dict[str, tuple[lock_scripts.LuaScript, Callable[[int, LockKeys], Called]]] = {
    "release handing over": (lock_scripts.RELEASE, release_handing_over),
    "release past a lapsed place": (lock_scripts.RELEASE, release_past_a_lapsed_place),
    "quorum release past a lapsed place": (
        lock_scripts.RELEASE,
        quorum_release_past_a_lapsed_place,
    ),
    "release to a shared waiter": (lock_scripts.RELEASE, release_to_a_shared_waiter),
    "joining the line": (lock_scripts.ACQUIRE, joining_the_line),
    "reset handing over": (lock_scripts.RESET, reset_handing_over),
    "cancel of the last waiter": (lock_scripts.CANCEL, cancel_of_the_last_waiter),
    "permit freed for the only waiter": (
        lock_scripts.ACQUIRE_SHARED,
        permit_freed_for_the_only_waiter,
    ),
    "ended shared lock handed on": (lock_scripts.ACQUIRE, ended_shared_lock_handed_on),
    "extend": (
        lock_scripts.EXTEND,
        contended(lambda k, h, w: [k.lock], lambda h, w: [h, 30_000]),
    ),
    "wake": (
        lock_scripts.WAKE,
        contended(lambda k, h, w: [k.lock, k.queue, k.wake(w)], lambda h, w: [w]),
    ),
    "mark_transaction": (
        lock_scripts.MARK_TRANSACTION,
        contended(lambda k, h, w: [k.lock], lambda h, w: [h, "{}"]),
    ),
    "held_alone": (lock_scripts.HELD_ALONE, contended(lambda k, h, w: [k.lock], lambda h, w: [])),
    "read_state": (
        lock_scripts.READ_STATE,
        contended(lambda k, h, w: [k.lock], lambda h, w: [h]),
    ),
    "extend with a floor": (
        lock_scripts.EXTEND,
        contended(lambda k, h, w: [k.lock, k.fence], lambda h, w: [h, 30_000, 2**60]),
    ),
}


def test_every_lock_script_has_a_migrating_slot_case() -> None:
    covered = {script.name for script, _ in CASES.values()}
    assert covered == {script.name for script in lock_scripts.SCRIPTS}


def slot_dump(port: int, slot: int) -> dict[bytes, bytes]:
    """Every key of ``slot`` stored on ``port``, with its serialized value."""
    stored = command(port, "CLUSTER", "GETKEYSINSLOT", slot, 100)
    return {key: command(port, "DUMP", key) for key in stored}


def dump_to_compare(port: int, slot: int) -> dict[bytes, bytes]:
    """slot_dump(), after giving every key of ``slot`` a minute to live.

    The line's keys live about 2 s (a place's lease); a machine slow enough
    between this dump and the next would see them expire and take that for a
    script that stopped half-way. Dumps hold values, not expiries, and no
    script's choice between running and being refused depends on one.
    """
    for key in command(port, "CLUSTER", "GETKEYSINSLOT", slot, 100):
        command(port, "PEXPIRE", key, 60_000)
    return slot_dump(port, slot)


@pytest.mark.parametrize("case", list(CASES))
def test_a_script_on_a_migrating_slot_runs_whole_or_is_refused_having_changed_nothing(
    cluster: RedisClusterServers, case: str
) -> None:
    name = f"migrating:{uuid.uuid4().hex}"
    keys = LockKeys.for_name("tests-migrating", name)
    split = SplitSlot(cluster, keys, name)
    script, build = CASES[case]
    declared, args = build(split.source, keys)
    assert all(command(split.source, "EXISTS", key) for key in declared), declared
    before = dump_to_compare(split.source, split.slot)
    split.begin()
    try:
        try:
            run_on(split.source, script, declared, *args)
        except redis.ResponseError as exc:
            # Refused before its first write, as a slot split between two nodes is.
            assert isinstance(exc, TryAgainError), f"{script.name} stopped half-way: {exc}"
            assert slot_dump(split.source, split.slot) == before
    finally:
        split.abort()
        command(split.source, "DEL", *split.on(split.source))


class RandomLockState:
    """A random state of one lock, built with its own scripts and edits of time passing."""

    def __init__(self, port: int, keys: LockKeys, rng: random.Random) -> None:
        self.port, self.keys, self.rng = port, keys, rng
        self.tokens: list[str] = []
        limit = rng.choice([0, 0, 2])  # a shared lock, or a semaphore of two permits
        self.limit = limit
        for _ in range(rng.randint(1, 6)):
            who = token(shared=bool(limit) or rng.random() < 0.4)
            join(port, keys, who, limit=limit)
            self.tokens.append(who)
        for who in self.tokens:
            if rng.random() < 0.4:
                self.lapse(who)

    def lapse(self, who: str) -> None:
        """Let ``who``'s place in line, or its shared hold, end (as if its lease ran out)."""
        record = command(self.port, "HGET", self.keys.waiting, who)
        if record is not None:
            _ends, terms = record.split(b"|", 1)
            command(self.port, "HSET", self.keys.waiting, who, b"1|" + terms)
            return
        held = command(self.port, "HGET", self.keys.lock, f"r:{who}")
        if held is not None:
            _ends, rest = held.split(b"|", 1)
            command(self.port, "HSET", self.keys.lock, f"r:{who}", b"1|" + rest)

    def call(self) -> tuple[lock_scripts.LuaScript, list[str], list[Any]]:
        """Pick one script call on this lock, by a token in the state or a newcomer."""
        rng, keys = self.rng, self.keys
        who = rng.choice([*self.tokens, token(), token(shared=True)])
        unpopped_wake_up(self.port, keys, who)
        with_wake = [*keys.script_keys, keys.wake(who)]
        floor = [2**60] if rng.random() < 0.5 else []
        choices: list[tuple[lock_scripts.LuaScript, list[str], list[Any]]] = [
            (lock_scripts.ACQUIRE, with_wake, [who, 30_000, "{}", 1]),
            (lock_scripts.ACQUIRE_SHARED, with_wake, [who, 30_000, "{}", 1, self.limit]),
            (lock_scripts.RELEASE, list(keys.script_keys), [who, "", *floor]),
            (lock_scripts.RELEASE, with_wake, [self.rng.choice(self.tokens), who]),
            (lock_scripts.CANCEL, with_wake, [who, self.limit]),
            (lock_scripts.RESET, list(keys.script_keys), floor),
            (lock_scripts.EXTEND, [keys.lock, keys.fence], [who, 30_000, *floor]),
        ]
        return rng.choice(choices)


def test_any_script_call_on_any_lock_state_runs_whole_or_is_refused_on_a_migrating_slot(
    cluster: RedisClusterServers,
) -> None:
    """The class behind the cases above: random states, a random call, the slot migrating."""
    rng = random.Random(SEED)
    ran = refused = 0
    for _ in range(250):
        name = f"random-state:{uuid.uuid4().hex}"
        keys = LockKeys.for_name("tests-migrating", name)
        split = SplitSlot(cluster, keys, name)
        state = RandomLockState(split.source, keys, rng)
        script, declared, args = state.call()
        if not all(command(split.source, "EXISTS", key) for key in declared):
            # Redis itself redirects a call whose declared keys are not all here.
            command(split.source, "DEL", *split.on(split.source))
            continue
        before = dump_to_compare(split.source, split.slot)
        split.begin()
        try:
            run_on(split.source, script, declared, *args)
            ran += 1
        except redis.ResponseError as exc:
            assert isinstance(exc, TryAgainError), (
                f"seed {SEED}: {script.name}{args} stopped half-way: {exc}"
            )
            assert slot_dump(split.source, split.slot) == before, f"seed {SEED}"
            refused += 1
        finally:
            split.abort()
            command(split.source, "DEL", *split.on(split.source))
    # Both outcomes came up: the mix reaches the guarded paths and the others.
    assert ran > 10 and refused > 10, f"seed {SEED}: {ran} ran whole, {refused} refused"
