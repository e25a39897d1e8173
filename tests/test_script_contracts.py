"""Each lock script's contract (its KEYS, ARGV and reply, as data) matches its Lua.

Callers and the documentation read the contract; Redis runs the Lua. A script
that reads a KEYS or ARGV its contract does not list, or a contract listing
more than its script reads, fails here, as does a script the package runs
that is missing from the registry. Each script then runs once on a real
Redis with just the keys and arguments its contract asks for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from django_redis_mutex import scripts

PACKAGE = Path(scripts.__file__).parent
INDEXED = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")
# One argument of each kind a contract names (the name before any ':').
SAMPLE_ARGV = {
    "token": "t1",
    "ttl ms": 1000,
    "owner JSON": "{}",
    "join": 1,
    "limit": 2,
    "successor": "t2",
    "fence": 5,
    "floor": 7,
}


def highest(source: str, table: str) -> int:
    """Return the highest index of ``table`` (KEYS or ARGV) that ``source`` reads, 0 for none."""
    return max((int(n) for t, n in INDEXED.findall(source) if t == table), default=0)


def sample(name: str) -> object:
    return SAMPLE_ARGV[name.strip("[]").split(":", 1)[0]]


@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda script: script.name)
def test_a_script_reads_exactly_the_keys_and_argv_of_its_contract(
    script: scripts.LuaScript,
) -> None:
    # Every index is a literal, so the highest one read is the arity.
    assert not re.findall(r"\b(?:KEYS|ARGV)\[(?!\d+\])", script.source)
    assert highest(script.source, "KEYS") == len(script.keys)
    assert highest(script.source, "ARGV") == len(script.argv)


@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda script: script.name)
def test_only_trailing_keys_and_argv_are_optional(script: scripts.LuaScript) -> None:
    for names in (script.keys, script.argv):
        required = scripts.required(names)
        assert all(name.startswith("[") for name in names[required:]), names


def test_every_script_the_package_runs_is_in_the_registry() -> None:
    named: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"\bscripts\.([A-Z][A-Z_]*)\b", text))
        for imported in re.findall(r"from \.+scripts import \(?([^)\n]*)", text):
            named |= {name.strip() for name in imported.split(",")}
        if path.name != "scripts.py":
            assert "LuaScript(" not in text, f"{path.name} defines a script of its own"
    used = {name for name in named if isinstance(getattr(scripts, name, None), scripts.LuaScript)}
    defined = {
        name for name, value in vars(scripts).items() if isinstance(value, scripts.LuaScript)
    }
    assert used, "no script use found: the search above no longer matches the code"
    assert used <= defined
    assert {script.name.upper() for script in scripts.SCRIPTS} == defined
    assert all(getattr(scripts, script.name.upper()) is script for script in scripts.SCRIPTS)


def role(name: str) -> str:
    """Return what a contract's name for a key or argument is: the words before any ':'."""
    return name.strip("[]").split(":", 1)[0]


@pytest.fixture
def lock_keys(
    raw: redis.Redis, mutex_prefix: str
) -> Iterator[Callable[[tuple[str, ...]], list[str]]]:
    """Return the keys of one test lock for a contract's key names, in one hash slot.

    A role names the same key in every script (the lock, its queue, one
    wake-up list), as the lock's own keys do.
    """
    made: set[str] = set()

    def keys(names: tuple[str, ...]) -> list[str]:
        found = [f"{mutex_prefix}:{{contract}}:{role(name)}" for name in names]
        made.update(found)
        return found

    yield keys
    if made:
        raw.delete(*made)


def take(raw: redis.Redis, keys: Callable[[tuple[str, ...]], list[str]], token: str) -> None:
    """Take the test lock for ``token``, or (held already) join its line."""
    scripts.run(raw, scripts.ACQUIRE, keys(scripts.ACQUIRE.keys), [token, 5000, "{}", 1])


@pytest.mark.parametrize("arity", ["required", "all"])
@pytest.mark.parametrize("state", ["free", "held", "contended"])
@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda script: script.name)
def test_redis_runs_a_script_given_what_its_contract_asks_for(
    raw: redis.Redis,
    lock_keys: Callable[[tuple[str, ...]], list[str]],
    script: scripts.LuaScript,
    state: str,
    arity: str,
) -> None:
    # The sample token (t1) holds the lock, and its successor (t2) waits behind it.
    if state != "free":
        take(raw, lock_keys, "t1")
    if state == "contended":
        take(raw, lock_keys, "t2")
    key_names, argv_names = script.keys, script.argv
    if arity == "required":
        key_names = key_names[: scripts.required(key_names)]
        argv_names = argv_names[: scripts.required(argv_names)]

    reply = scripts.run(raw, script, lock_keys(key_names), [sample(n) for n in argv_names])

    assert reply is not None  # a Lua error (a missing key or argument) would have raised
