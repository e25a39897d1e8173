"""The I/O half of every lock operation: run the steps a lock decides on.

A lock operation (acquire with its wait, release, extend, confirm, a read of
its state) is written once, in :mod:`django_redis_mutex.lock` and
:mod:`django_redis_mutex.quorum`, as a generator that yields what to do next
(run a script, send a plain read, ask every quorum master, block on a wake-up
list, sleep) and receives what came of it. The generator holds every decision
and does no I/O; :func:`run_steps` drives it with blocking redis-py calls and
:class:`AsyncDriver` with redis.asyncio, so the sync and async paths cannot
drift apart.

Every answer carries the time its command was *sent*: a lease granted or
renewed by a command is counted from then, never from when the reply was read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import RedisError, ResponseError

from . import scripts
from .client import (
    UNAVAILABLE,
    blocking_read_timeout,
    get_async_client,
    get_blocking_client,
    get_client,
    get_member_client,
    socket_timeout,
)

__all__ = [
    "REDIS_TICK",
    "Acknowledged",
    "AsyncDriver",
    "Commands",
    "Each",
    "Fanned",
    "Pop",
    "Script",
    "Sleep",
    "Steps",
    "finish_despite_cancels",
    "run_in_child",
    "run_steps",
]

T = TypeVar("T")

logger = logging.getLogger("django_redis_mutex")


class Script(NamedTuple):
    """Run one Lua script on one Redis; the answer is ``(sent, reply)``.

    A ``best_effort`` script (a wake-up that a later check-in makes up for)
    that fails is logged and answered with ``(sent, None)``: the operation it
    follows has already succeeded in Redis, and its caller must learn that.
    """

    alias: str
    script: scripts.LuaScript
    keys: Sequence[str]
    args: Sequence[Any]
    best_effort: bool = False


class Acknowledged(NamedTuple):
    """Run one Lua script, then WAIT up to ``timeout`` s for ``replicas`` to acknowledge it.

    Both go out on one connection in one round trip (WAIT counts that
    connection's last write). The answer is ``(sent, reply, acknowledged)``.
    """

    alias: str
    script: scripts.LuaScript
    keys: Sequence[str]
    args: Sequence[Any]
    replicas: int
    timeout: float


class Each(NamedTuple):
    """Run one script on every listed quorum master at once, each within ``timeout``.

    ``calls`` pairs each master's alias with the keys it takes; the answer is a
    :class:`Fanned`.
    """

    script: scripts.LuaScript
    calls: tuple[tuple[str, tuple[str, ...]], ...]
    args: list[Any]
    timeout: float


class Fanned(NamedTuple):
    """What the masters answered to an :class:`Each`: replies, and errors by alias."""

    sent: float
    replies: dict[str, Any]
    errors: dict[str, BaseException]


class Pop(NamedTuple):
    """Block up to ``wait`` seconds on a wake-up list; the answer is the value or None."""

    alias: str
    key: str
    wait: float
    longest: float  # the longest wait this acquisition ever asks for


class Commands(NamedTuple):
    """Send plain commands to one Redis in one round trip; the answer is their replies in order.

    A pipeline without a transaction: for reads and writes that need no
    script because nothing has to happen at one instant (deadlock detection's
    waits-for records and its walk over the locks), and whose keys may lie in
    different cluster slots. Always best effort: a batch that fails is logged
    and answered with None, as a best-effort :class:`Script` is. A ``timeout``
    bounds the round trip as a quorum master's is (see :class:`Each`): a
    master that hangs must not hold up the lock's other masters.
    """

    alias: str
    commands: tuple[tuple[Any, ...], ...]
    timeout: float | None = None


class Sleep(NamedTuple):
    """Sleep locally (the last Redis timer tick before a holder's expiry, a quorum retry)."""

    seconds: float


Op = Script | Each | Pop | Sleep | Acknowledged | Commands
Steps = Generator[Op, Any, T]

# Answers that mean a master could not be asked (not that it refused).
_MASTER_ERRORS = (*UNAVAILABLE, ResponseError)


class NoAnswer(TimeoutError):
    """A quorum master did not answer within its deadline."""


def run_steps(steps: Steps[T]) -> T:
    """Drive ``steps`` with blocking calls and return what it returns."""
    try:
        op = next(steps)
        while True:
            op = steps.send(_do(op))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        steps.close()


def _do(op: Op) -> Any:
    if isinstance(op, Script):
        client = get_client(op.alias)
        sent = time.monotonic()
        if op.best_effort:
            try:
                return sent, scripts.run(client, op.script, op.keys, op.args)
            except (RedisError, OSError) as exc:
                _gave_up(op, exc)
                return sent, None
        return sent, scripts.run(client, op.script, op.keys, op.args)
    if isinstance(op, Pop):
        client = get_blocking_client(op.alias, op.longest)
        wait = _pop_wait(client, op.wait)
        if wait is None:
            time.sleep(op.wait)
            return None
        try:
            return client.blpop([op.key], timeout=wait)
        except ResponseError as exc:
            if not _unblocked(exc):
                raise
            return None
    if isinstance(op, Each):
        return _each(op)
    if isinstance(op, Commands):
        return _commands(op)
    if isinstance(op, Acknowledged):
        # Reads outlast the WAIT even under a short SOCKET_TIMEOUT.
        client = get_blocking_client(op.alias, op.timeout)
        sent = time.monotonic()
        reply, acknowledged = scripts.run_acknowledged(
            client, op.script, op.keys, op.args, op.replicas, op.timeout
        )
        return sent, reply, acknowledged
    time.sleep(op.seconds)
    return None


def _gave_up(op: Script | Commands, exc: BaseException) -> None:
    what = f"the {op.script.name} script" if isinstance(op, Script) else "commands"
    logger.warning(
        "Could not run %s on %r (a later check-in makes up for it): %s", what, op.alias, exc
    )


def _commands(op: Commands) -> list[Any] | None:
    try:
        if op.timeout is None:
            client = get_client(op.alias)
        else:
            client = get_member_client(op.alias, op.timeout)
        pipe = client.pipeline(transaction=False)
        for command in op.commands:
            pipe.execute_command(*command)
        return list(pipe.execute())
    except (RedisError, OSError) as exc:
        _gave_up(op, exc)
        return None


def _unblocked(exc: ResponseError) -> bool:
    """Return True when Redis ended a blocking pop without popping anything.

    A server that stops being a master (CLUSTER FAILOVER, a Sentinel failover,
    REPLICAOF) answers the clients blocked on it with ``UNBLOCKED``, as does
    CLIENT UNBLOCK ... ERROR. The wait is over, not the acquisition: the
    waiter checks in, and its script goes to whichever node holds the lock now.
    """
    return str(exc).startswith("UNBLOCKED")


# Redis ends a blocking pop only on its timer tick (hz 10: every 100 ms).
REDIS_TICK = 0.1


def _pop_wait(client: Any, wait: float) -> float | None:
    """Return how long a blocking pop on ``client`` may wait, or None to sleep instead.

    A client whose reads could not be lengthened (Sentinel) keeps its socket
    timeout: a pop is cut below it, and a timeout too short for even two timer
    ticks makes the waiter sleep and check in rather than fail.
    """
    limit = socket_timeout(client)
    if limit is None or wait < limit * 0.8:
        return wait
    if limit * 0.8 < 2 * REDIS_TICK:
        return None
    return limit * 0.8


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=16, thread_name_prefix="django-redis-mutex-quorum"
                )
    return _executor


def _after_fork_in_child() -> None:
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ask(alias: str, op: Each, keys: tuple[str, ...]) -> Any:
    return scripts.run(get_member_client(alias, op.timeout), op.script, list(keys), op.args)


def _answer(client: Any, connection: Any, op: Each, keys: tuple[str, ...], packed: bool) -> Any:
    """Return a master's answer to the EVALSHA sent on ``connection`` (``packed`` by us).

    A master that forgot the script loads it on that same connection.
    """

    def command(*args: Any) -> Any:
        connection.send_command(*args)
        return client.parse_response(connection, args[0])

    return scripts.loading(
        lambda: command("EVALSHA", op.script.sha, len(keys), *keys, *op.args),
        lambda: command("SCRIPT", "LOAD", op.script.source),
        sent=connection.read_response
        if packed
        else lambda: client.parse_response(connection, "EVALSHA"),
    )


def _each(op: Each) -> Fanned:
    """Ask every master at once: send to all, then read each answer.

    Masters on plain connection pools get the request written to their
    sockets one after another and are read back in turn, so the round trips
    overlap without a thread; each read is bounded by the member client's
    short socket timeout. Other clients (Sentinel, Cluster) are asked from a
    thread pool.
    """
    replies: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    sent = time.monotonic()
    in_flight: list[tuple[str, Any, Any, tuple[str, ...], bool]] = []
    threaded: dict[concurrent.futures.Future[Any], str] = {}
    for alias, keys in op.calls:
        client = get_member_client(alias, op.timeout)
        pool = getattr(client, "connection_pool", None)
        if pool is None or not hasattr(pool, "get_connection"):
            threaded[_pool().submit(_ask, alias, op, keys)] = alias
            continue
        connection = None
        packed = scripts.packed_evalsha(client, op.script, keys, op.args)
        try:
            connection = pool.get_connection()
            if packed is None:
                connection.send_command("EVALSHA", op.script.sha, len(keys), *keys, *op.args)
            else:
                connection.send_packed_command([packed])
        except _MASTER_ERRORS as exc:
            errors[alias] = exc
            if connection is not None:
                connection.disconnect()
                pool.release(connection)
            continue
        in_flight.append((alias, client, connection, keys, packed is not None))
    for alias, client, connection, keys, direct in in_flight:
        try:
            replies[alias] = _answer(client, connection, op, keys, direct)
        except _MASTER_ERRORS as exc:
            errors[alias] = exc
            connection.disconnect()
        except BaseException:
            connection.disconnect()
            raise
        finally:
            client.connection_pool.release(connection)
    if threaded:
        # Each request is bounded by its client's socket timeout; the margin
        # only covers a busy thread pool.
        budget = max(0.0, sent + 2 * op.timeout + 0.5 - time.monotonic())
        done, pending = concurrent.futures.wait(threaded, timeout=budget)
        for future in pending:
            errors[threaded[future]] = NoAnswer(f"no answer within {op.timeout}s")
        for future in done:
            alias = threaded[future]
            failure = future.exception()
            if failure is None:
                replies[alias] = future.result()
            elif isinstance(failure, _MASTER_ERRORS):
                errors[alias] = failure
            else:
                raise failure
    return Fanned(sent, replies, errors)


class AsyncDriver:
    """Drive steps on the running event loop; tells whether a script is in flight.

    A caller cancelled while a script is in flight lets that round trip finish
    (its reply says whether the lock was granted) before giving the lock back,
    instead of cutting it off and never learning what Redis did.
    """

    def __init__(self) -> None:
        self.in_script = False
        # Set when the caller was cancelled: end before the next step.
        self.stop = False

    async def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` on the running loop and return what it returns."""
        try:
            op = next(steps)
            while True:
                if self.stop:
                    raise asyncio.CancelledError("The acquisition was cancelled.")
                op = steps.send(await self._do(op))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            steps.close()

    async def _do(self, op: Op) -> Any:
        if isinstance(op, Script):
            self.in_script = True
            sent = time.monotonic()
            try:
                client = await get_async_client(op.alias)
                sent = time.monotonic()
                return sent, await scripts.arun(client, op.script, op.keys, op.args)
            except (RedisError, OSError) as exc:
                if not op.best_effort:
                    raise
                _gave_up(op, exc)
                return sent, None
            finally:
                self.in_script = False
        if isinstance(op, Pop):
            client = await get_async_client(
                op.alias, read_timeout=blocking_read_timeout(op.alias, op.longest)
            )
            wait = _pop_wait(client, op.wait)
            if wait is None:
                await asyncio.sleep(op.wait)
                return None
            try:
                return await client.blpop([op.key], timeout=wait)
            except ResponseError as exc:
                if not _unblocked(exc):
                    raise
                return None
        if isinstance(op, Each):
            self.in_script = True
            try:
                return await _aeach(op)
            finally:
                self.in_script = False
        if isinstance(op, Commands):
            return await _acommands(op)
        if isinstance(op, Acknowledged):
            self.in_script = True
            try:
                client = await get_async_client(
                    op.alias, read_timeout=blocking_read_timeout(op.alias, op.timeout)
                )
                sent = time.monotonic()
                reply, acknowledged = await scripts.arun_acknowledged(
                    client, op.script, op.keys, op.args, op.replicas, op.timeout
                )
                return sent, reply, acknowledged
            finally:
                self.in_script = False
        await asyncio.sleep(op.seconds)
        return None


async def _acommands(op: Commands) -> list[Any] | None:
    try:
        # Without a timeout this is the alias's own async client.
        client = await get_async_client(
            op.alias, read_timeout=op.timeout, connect_timeout=op.timeout
        )
        pipe = client.pipeline(transaction=False)
        for command in op.commands:
            pipe.execute_command(*command)
        return list(await pipe.execute())
    except (RedisError, OSError) as exc:
        _gave_up(op, exc)
        return None


async def run_in_child(
    steps: Steps[T],
    abandon: Callable[[], Awaitable[None]],
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """Drive acquisition ``steps`` in a child task: a cancellation of the caller is never lost.

    redis-py sends through ``asyncio.wait_for``, which before Python 3.12 can
    swallow a cancel() landing just as a send completes; a waiter would then
    sit out its timeout and might take the lock for a task that is gone.
    Waiting on the child with ``asyncio.wait`` always sees the cancel. A
    script in flight is let finish, so its reply says whether Redis granted
    the lock; a blocking wait is cut at once. Only then does ``abandon()``
    (leave the line, give back what was granted) run, to its end: further
    cancels (an AnyIO-style scope delivers one at every await) wait for both,
    and one CancelledError is raised after. ``abandon()`` runs too when the
    steps fail, except with one of ``passthrough`` (Redis not answering: a
    cancel would only wait out another timeout).
    """
    driver = AsyncDriver()
    child = asyncio.ensure_future(driver.run(steps))
    try:
        await asyncio.wait({child})
    except BaseException:
        driver.stop = True
        if not driver.in_script:
            child.cancel()
        await finish_despite_cancels(_abandon_after(child, abandon))
        raise
    try:
        return child.result()
    except passthrough:
        raise
    except BaseException:
        await finish_despite_cancels(abandon())
        raise


async def _abandon_after(
    child: asyncio.Future[Any], abandon: Callable[[], Awaitable[None]]
) -> None:
    """Wait for ``child`` to end, then run ``abandon()``.

    Never abandon while the child's script may still be on its way: a
    give-back that overtook it would leave the lock to a token nobody has.
    """
    await asyncio.wait({child})
    if not child.cancelled():
        child.exception()  # retrieved, so asyncio does not warn
    await abandon()


async def finish_despite_cancels(work: Awaitable[Any]) -> None:
    """Await ``work`` to its end however many cancels arrive meanwhile; then raise one of them.

    A give-back cut short leaves a lock or permit held for its whole lease by
    an owner that is gone: better to finish it and deliver the cancel after.
    """
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if task.cancelled():
                raise
            cancelled = exc
    if not task.cancelled():
        task.result()
    if cancelled is not None:
        raise cancelled


async def _aeach(op: Each) -> Fanned:
    async def one(alias: str, keys: tuple[str, ...]) -> Any:
        # Every read and connect bounded by the master's deadline, like the
        # sync member clients (not a wait_for around the whole exchange, which
        # would count a first connection and a script load against it).
        client = await get_async_client(alias, read_timeout=op.timeout, connect_timeout=op.timeout)
        return await scripts.arun(client, op.script, list(keys), op.args)

    sent = time.monotonic()
    # Shielded: each request goes out from a task of its own, one loop step
    # later. A caller cancelled meanwhile (in a release, say) would cut them
    # all before any was sent, where one Redis's script is written before the
    # first await; so they all go out, and the cancel reaches the caller at once.
    results = await asyncio.shield(
        asyncio.gather(*(one(alias, keys) for alias, keys in op.calls), return_exceptions=True)
    )
    replies: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    for (alias, _), result in zip(op.calls, results, strict=True):
        if isinstance(result, _MASTER_ERRORS):
            errors[alias] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            replies[alias] = result
    return Fanned(sent, replies, errors)
