"""How lock scripts reach Redis: EVALSHA, loaded again when the server forgot them.

On a plain redis-py client the EVALSHA is packed by :mod:`django_redis_mutex.scripts`
and written to a pooled connection directly; it must say exactly what
redis-py would have sent, and step aside (back to ``client.evalsha``) for
clients whose commands someone else must see or shape: subclasses, and
``execute_command`` wrapped by tracing.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from django_redis_mutex import Mutex, mutex, scripts
from django_redis_mutex.client import get_client

from .helpers import forget_scripts_but


def test_a_lock_loads_its_scripts_again_after_script_flush(raw: redis.Redis) -> None:
    with mutex("flushed"):
        pass
    raw.script_flush()

    with mutex("flushed") as lock:
        raw.script_flush()
    assert not lock.locked()


def test_an_async_lock_loads_its_scripts_again_after_script_flush(raw: redis.Redis) -> None:
    async def main() -> None:
        async with mutex("flushed-async"):
            raw.script_flush()
        async with mutex("flushed-async"):
            pass

    asyncio.run(main())
    assert not Mutex("flushed-async").locked()


def forget_extend(client: redis.Redis) -> None:
    forget_scripts_but(client, *(s for s in scripts.SCRIPTS if s is not scripts.EXTEND))


def test_an_acknowledged_script_is_loaded_again_when_the_server_forgot_it(raw: redis.Redis) -> None:
    forget_extend(raw)

    reply = scripts.run_acknowledged(raw, scripts.EXTEND, ["drm-test:{x}"], ["t", 100], 0, 0.1)

    assert reply == (0, 0)
    assert raw.script_exists(scripts.EXTEND.sha) == [True]


def test_an_async_acknowledged_script_is_loaded_again_when_the_server_forgot_it(
    raw: redis.Redis, redis_url: str
) -> None:
    async def main() -> tuple[object, int]:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await scripts.arun_acknowledged(
                client, scripts.EXTEND, ["drm-test:{x}"], ["t", 100], 0, 0.1
            )
        finally:
            await client.aclose()

    forget_extend(raw)

    assert asyncio.run(main()) == (0, 0)
    assert raw.script_exists(scripts.EXTEND.sha) == [True]


keys = st.lists(st.text(min_size=1, max_size=40), min_size=0, max_size=7)
args = st.lists(
    st.one_of(st.text(max_size=60), st.integers(-(2**63), 2**63), st.binary(max_size=20)),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(keys=keys, args=args)
def test_a_packed_evalsha_is_byte_for_byte_what_redis_py_sends(
    keys: list[str], args: list[object]
) -> None:
    connection = redis.Connection()

    expected = b"".join(
        connection.pack_command("EVALSHA", scripts.RELEASE.sha, len(keys), *keys, *args)
    )

    assert scripts._pack(scripts.RELEASE, keys, args) == expected


def test_a_plain_client_is_sent_to_directly(raw: redis.Redis) -> None:
    assert scripts._direct_pool(raw) is raw.connection_pool
    assert scripts._direct_pool(get_client("default")) is not None


def test_a_subclassed_client_goes_through_evalsha(redis_url: str) -> None:
    class Traced(redis.Redis):
        pass

    client = Traced.from_url(redis_url)
    try:
        assert scripts._direct_pool(client) is None
        assert scripts.run(client, scripts.EXTEND, ["drm-test:{x}"], ["t", 100]) == 0
    finally:
        client.close()


def test_a_wrapped_execute_command_sees_every_lock_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    original = redis.Redis.execute_command

    @functools.wraps(original)
    def traced(self: redis.Redis, *args: object, **options: object) -> object:
        seen.append(str(args[0]))
        return original(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)

    with mutex("traced"):
        pass

    assert seen.count("EVALSHA") == 2


def test_a_client_that_retries_takes_one_connection_per_script(redis_url: str) -> None:
    # redis-py retries by default when it builds its own pool; the script then
    # goes through client.evalsha, without holding a second connection meanwhile.
    client = redis.Redis.from_url(redis_url, max_connections=1, retry_on_timeout=True)
    try:
        assert scripts._direct_pool(client) is not None
        assert scripts.run(client, scripts.EXTEND, ["drm-test:{x}"], ["t", 100]) == 0
    finally:
        client.close()


# Busy for 100 ms, so its reply is not there yet when the next command is sent.
_SLOW = scripts.LuaScript(
    "slow",
    summary="Keep the server busy for 100 ms.",
    keys=(),
    argv=(),
    returns="'slow'",
    source="local t = redis.call('TIME'); local e = t[1] * 1000000 + t[2] + 100000\n"
    "while true do local n = redis.call('TIME')\n"
    "  if n[1] * 1000000 + n[2] > e then break end end\n"
    "return 'slow'",
)
_ECHO = scripts.LuaScript(
    "echo", summary="Echo.", keys=(), argv=("text",), returns="the text", source="return ARGV[1]"
)


def test_an_interrupt_between_send_and_read_leaves_no_reply_behind(
    raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert scripts._direct_pool(raw) is raw.connection_pool
    scripts.run(raw, _SLOW, [], [])
    scripts.run(raw, _ECHO, [], ["loaded"])
    connection_class = raw.connection_pool.connection_class

    def interrupted(self: redis.Connection, *args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt  # as a signal handler's exception would, before the read

    monkeypatch.setattr(connection_class, "read_response", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scripts.run(raw, _SLOW, [], [])
    monkeypatch.undo()

    assert scripts.run(raw, _ECHO, [], ["mine"]) == b"mine"
