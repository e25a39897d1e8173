"""``manage.py locks``: list, reset, reset-all, and one-line errors.

Everything runs against the session's real redis-server. The reset-all test
fills the same database with 10,000 keys that are not this alias's locks
(lookalike keys, cache entries, another alias's locks) and checks that only
the locks went.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from io import StringIO
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings as django_settings
from django.core.cache import caches
from django.core.management import CommandError, call_command

from django_redis_mutex import (
    HeldLock,
    LockLost,
    LockNotOwned,
    Mutex,
    Semaphore,
    held_locks,
    held_semaphores,
)
from django_redis_mutex.management.commands.locks import describe_redis
from django_redis_mutex.testing import free_port

from .helpers import held_shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def locks(*args: str) -> str:
    """Run the command in this process and return its stdout."""
    out = StringIO()
    call_command("locks", *args, stdout=out)
    return out.getvalue()


def redis_address() -> str:
    """Return the session Redis as the command names it: scheme, host, port and db only."""
    url = urlsplit(django_settings.CACHES["default"]["LOCATION"])
    return f"redis://{url.hostname}:{url.port}/{url.path.lstrip('/') or 0}"


@pytest.fixture
def held(settings: Any) -> Iterator[list[Mutex]]:
    """Collect handles a test acquires, and release those still held at the end.

    Depends on ``settings`` so the release runs before test-added aliases go away.
    """
    handles: list[Mutex] = []
    yield handles
    for handle in handles:
        with contextlib.suppress(LockNotOwned):
            handle.release()


def hold(held: list[Mutex], name: str, **options: Any) -> Mutex:
    lock = Mutex(name, **options)
    assert lock.acquire(blocking=False)
    held.append(lock)
    return lock


@pytest.fixture
def other_alias(settings: Any, mutex_prefix: str) -> str:
    """Add cache alias "other": the same Redis database, another KEY_PREFIX."""
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        "other": {**default, "KEY_PREFIX": "other", "MUTEX": {"PREFIX": mutex_prefix}},
    }
    return "other"


# -- listing ---------------------------------------------------------------


def test_table_lists_held_lock_with_owner(held: list[Mutex]) -> None:
    hold(held, "inventory", label="nightly import")
    out = locks()
    source, header, row, footer = out.splitlines()
    assert source == f"Cache 'default' at {redis_address()}:"
    assert header.split() == [
        "NAME",
        "HOST",
        "PID",
        "THREAD",
        "LABEL",
        "HELD",
        "FOR",
        "TIME",
        "LEFT",
        "FENCE",
        "WAITERS",
    ]
    assert row.startswith("inventory ")
    assert "nightly import" in row
    assert f" {os.getpid()} " in row
    assert f" {threading.current_thread().name} " in row
    assert f" {held[0].fence} " in row
    assert footer == "1 lock held in cache 'default'."


def test_table_says_so_when_nothing_is_held() -> None:
    assert locks() == (
        f"Cache 'default' at {redis_address()}:\nNo locks are held in cache 'default'.\n"
    )


def test_filtered_table_when_nothing_is_held_names_the_filter() -> None:
    assert locks("--label", "deploy").splitlines()[1:] == [
        "No locks are held in cache 'default', so none matches the filter (label 'deploy')."
    ]


def test_semaphore_lines_write_time_left_as_the_lock_table_does(
    held: list[Mutex], permits: list[Semaphore]
) -> None:
    hold(held, "inventory", ttl=30)
    take_permit(permits, "exports", 2)
    lines = locks().splitlines()
    lock_left = lines[2].split()[7:9]  # TIME LEFT, after HELD FOR
    [permit_line] = [line for line in lines if line.endswith(" left")]
    assert lock_left[1] == "s" and float(lock_left[0]) > 0
    assert re.search(r"  \d+\.\d s left$", permit_line), permit_line


def test_table_names_each_master_of_a_quorum(settings: Any) -> None:
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        "m1": {**default, "KEY_PREFIX": "m1"},
        "m2": {**default, "KEY_PREFIX": "m2"},
        "q": {**default, "MUTEX": {**default["MUTEX"], "QUORUM": ["m1", "m2"]}},
    }
    address = redis_address()
    assert locks("--using", "q").splitlines() == [
        f"Cache 'q' (a quorum of 'm1' at {address}; 'm2' at {address}):",
        "No locks are held in cache 'q'.",
    ]


def test_redis_is_described_without_its_password(settings: Any) -> None:
    # Describing builds the client but never connects, so no server is needed.
    settings.CACHES = {
        **settings.CACHES,
        "secret": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://locks:s3cret@127.0.0.1:1/3",
        },
    }
    assert describe_redis("secret") == "redis://127.0.0.1:1/3"


def test_json_is_an_array_of_heldlock_fields(held: list[Mutex]) -> None:
    first = hold(held, "b-lock", ttl=20, label="worker")
    second = hold(held, "a-lock")
    data = json.loads(locks("--json"))
    assert [item["name"] for item in data] == ["a-lock", "b-lock"]
    # Every HeldLock field, plus "ttl": time_left under its old name, for one release,
    # and the kind that tells a lock from a semaphore.
    assert all(set(item) == {f.name for f in fields(HeldLock)} | {"ttl", "kind"} for item in data)
    assert {item["kind"] for item in data} == {"lock"}
    item = data[1]
    assert item["owner"] == {
        "host": item["owner"]["host"],
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "label": "worker",
        "transaction": [],  # not kept for a database transaction
    }
    assert item["fence"] == first.fence
    assert data[0]["fence"] == second.fence
    assert 0 < item["time_left"] <= 20
    assert item["ttl"] == item["time_left"]
    assert item["waiters"] == 0
    assert item["acquired_at"].endswith("+00:00")


def test_help_says_when_the_deprecated_ttl_of_json_goes() -> None:
    result = _manage("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert 'A lock\'s "ttl" repeats "time_left" and is deprecated: it is removed in 0.2.0.' in text


def test_json_of_nothing_held_is_an_empty_array() -> None:
    assert json.loads(locks("--json")) == []


# -- reset -----------------------------------------------------------------


def test_reset_releases_held_names_then_fails_naming_those_not_held(held: list[Mutex]) -> None:
    lock = hold(held, "payments")
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("locks", "--reset", "payments", "never-taken", stdout=out)
    assert str(raised.value) == "No lock 'never-taken' is held in cache 'default'; nothing reset."
    assert out.getvalue().splitlines() == ["Released 'payments'."]
    assert not Mutex("payments").locked()
    with pytest.raises(LockNotOwned):
        lock.release()


def test_reset_of_a_semaphore_name_points_to_reset_semaphore(permits: list[Semaphore]) -> None:
    permit = take_permit(permits, "exports", 2)
    with pytest.raises(CommandError, match=r"has permits held: use --reset-semaphore 'exports'"):
        locks("--reset", "exports")
    assert [h.token for s in held_semaphores() for h in s.holders] == [permit.token]


@pytest.mark.parametrize(
    "args",
    [["--reset", "never-taken"], ["--reset-semaphore", "never-taken"]],
    ids=["lock", "semaphore"],
)
def test_reset_of_a_name_not_held_exits_1_for_locks_and_semaphores_alike(args: list[str]) -> None:
    result = _manage(*args)
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("CommandError: No ") and "'never-taken' is held in cache" in line


def test_reset_leaves_other_locks_held(held: list[Mutex]) -> None:
    hold(held, "payments")
    keep = hold(held, "inventory")
    locks("--reset", "payments")
    assert keep.owned()
    assert [h.name for h in held_locks()] == ["inventory"]


def test_reset_all_noinput_keeps_every_key_that_is_not_a_lock(
    raw: redis.Redis, held: list[Mutex], other_alias: str, mutex_prefix: str
) -> None:
    tag = mutex_prefix  # makes every key below unique to this test
    unrelated: list[str] = []
    pipe = raw.pipeline(transaction=False)
    lock_like = {"token": "abc", "fence": "1", "owner": "{}", "acquired": "1", "name": "x"}
    for i in range(10_000):
        shape = i % 8
        if shape == 0:
            key = f"unrelated:{tag}:{i}"
            pipe.set(key, i)
        elif shape == 1:  # a namespace that merely starts with ours
            key = f"tests:{tag}x:{{n{i}}}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 2:  # our MUTEX PREFIX without the cache KEY_PREFIX
            key = f"{tag}:{{n{i}}}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 3:  # inside our namespace, but not a lock key
            key = f"tests:{tag}:n{i}"
            pipe.hset(key, mapping=lock_like)
        elif shape == 4:  # shaped like a django cache key
            key = f"tests:1:{tag}:{{n{i}}}"
            pipe.set(key, i)
        elif shape == 5:
            key = f"mutex:{{{tag}{i}}}"
            pipe.rpush(key, i)
        elif shape == 6:
            key = f"*:{tag}:[{i}]"
            pipe.sadd(key, i)
        else:
            key = f"other:{tag}:{{n{i}}}:queue"
            pipe.zadd(key, {"w": i})
        unrelated.append(key)
    pipe.execute()
    default_cache, other_cache = caches["default"], caches[other_alias]
    cache_keys = [f"{tag}-entry-{i}" for i in range(50)]
    for i, key in enumerate(cache_keys):
        default_cache.set(key, i, timeout=300)
        other_cache.set(key, -i, timeout=300)
    other_lock = hold(held, "shared-name", using=other_alias)
    for name in ("shared-name", "reports", "{braces}*?"):
        hold(held, name, label="to reset")

    try:
        out = locks("--reset-all", "--noinput")

        assert out == "Released 3 locks in cache 'default'.\n"
        assert held_locks() == []
        assert raw.exists(*unrelated) == len(unrelated)
        assert [default_cache.get(key) for key in cache_keys] == list(range(50))
        assert [other_cache.get(key) for key in cache_keys] == [-i for i in range(50)]
        assert other_lock.owned()
        assert [h.name for h in held_locks(using=other_alias)] == ["shared-name"]
    finally:
        for start in range(0, len(unrelated), 1000):
            raw.delete(*unrelated[start : start + 1000])
        default_cache.delete_many(cache_keys)
        other_cache.delete_many(cache_keys)


def test_reset_all_asks_for_confirmation_and_proceeds_on_yes(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    hold(held, "a")
    hold(held, "b")
    prompts: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt: prompts.append(prompt) or "yes")
    out = locks("--reset-all")
    assert len(prompts) == 1
    assert "every lock in cache 'default' (2 locks held now)" in prompts[0]
    assert prompts[0].endswith("Type 'yes' to continue, or 'no' to cancel: ")
    assert out == "Released 2 locks in cache 'default'.\n"
    assert held_locks() == []


def test_reset_all_keeps_locks_when_not_confirmed(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = hold(held, "a")
    monkeypatch.setattr(builtins, "input", lambda prompt: "no")
    out = locks("--reset-all")
    assert out == "Reset cancelled.\n"
    assert lock.owned()


def test_reset_and_json_cannot_be_combined() -> None:
    with pytest.raises(CommandError, match="not allowed with argument"):
        locks("--json", "--reset", "a")


# -- errors ----------------------------------------------------------------


def test_unknown_alias_is_a_command_error() -> None:
    with pytest.raises(CommandError, match=r"Cache alias 'nope' is not configured"):
        locks("--using", "nope")


def test_non_redis_cache_is_a_command_error(settings: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    with pytest.raises(CommandError, match=r"'local' uses BACKEND .*LocMemCache.*not a Redis"):
        locks("--using", "local", "--reset-all", "--noinput")


def test_unreachable_redis_is_a_command_error(settings: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "down": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1},
        },
    }
    with pytest.raises(CommandError, match=r"Redis for cache 'down' is unavailable: .*refused"):
        locks("--using", "down")


def test_command_line_error_is_one_line_on_stderr_without_traceback() -> None:
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        DJANGO_REDIS_MUTEX_TEST_URL=f"redis://127.0.0.1:{free_port()}/0",
        PYTHONPATH=ROOT,
    )
    result = subprocess.run(
        [sys.executable, "-m", "django", "locks", "--reset", "a"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("CommandError: Redis for cache 'default' is unavailable: ")


# -- filters ---------------------------------------------------------------


def age(raw: redis.Redis, lock: Mutex, seconds: float) -> None:
    """Make a held lock read as taken ``seconds`` ago, as one taken then would.

    An ``acquired`` time (ms) in the lock's hash is what ``held_for`` counts
    from; writing an earlier one ages the real lock without a test that sleeps
    for minutes.
    """
    raw.hset(lock.keys.lock, "acquired", int((time.time() - seconds) * 1000))


def test_host_filter_lists_only_that_hosts_locks(hold_on_host: Any, held: list[Mutex]) -> None:
    web1 = hold_on_host("cache:warm", "web1")
    hold_on_host("cache:rebuild", "web2")
    hold(held, "local", label="here")
    out = locks("--host", "WEB1")
    _source, _header, row, footer = out.splitlines()
    assert row.split()[:3] == ["cache:warm", "web1", str(web1.pid)]
    assert footer == "1 of 3 locks held in cache 'default' matches the filter (host 'WEB1')."


def test_json_lists_only_locks_matching_every_filter(hold_on_host: Any, held: list[Mutex]) -> None:
    web1 = hold_on_host("a", "web1", label="deploy")
    hold_on_host("b", "web1", label="cron")
    hold_on_host("c", "web2", label="deploy")
    data = json.loads(locks("--json", "--host", "web1", "--label", "deploy"))
    assert [(item["name"], item["owner"]["pid"]) for item in data] == [("a", web1.pid)]
    assert [item["name"] for item in json.loads(locks("--json", "--pid", str(web1.pid)))] == ["a"]


def test_older_than_selects_locks_held_at_least_that_long(
    raw: redis.Redis, held: list[Mutex]
) -> None:
    age(raw, hold(held, "stale"), 2 * 3600)
    age(raw, hold(held, "recent"), 5 * 60)
    hold(held, "fresh")
    selected = {
        duration: [item["name"] for item in json.loads(locks("--json", "--older-than", duration))]
        for duration in ("1h30m", "240", "4m", "0")
    }
    assert selected == {
        "1h30m": ["stale"],
        "240": ["recent", "stale"],
        "4m": ["recent", "stale"],
        "0": ["fresh", "recent", "stale"],
    }


def test_filter_matching_nothing_says_how_many_are_held(held: list[Mutex]) -> None:
    hold(held, "a", label="cron")
    assert locks("--label", "deploy").splitlines()[1:] == [
        "No held lock in cache 'default' matches the filter (label 'deploy'); 1 lock held."
    ]


def test_reset_all_with_host_resets_only_that_hosts_locks(
    hold_on_host: Any, held: list[Mutex]
) -> None:
    stale = [hold_on_host(f"deploy:{i}", "web1") for i in range(2)]
    other = hold_on_host("deploy:web2", "web2")
    local = hold(held, "local")
    out = locks("--reset-all", "--host", "web1", "--noinput")
    lines = out.splitlines()
    # The selection, as a table, then the count.
    assert [line.split()[0] for line in lines[2:4]] == ["deploy:0", "deploy:1"]
    assert lines[4:] == [
        "2 of 4 locks held in cache 'default' match the filter (host 'web1').",
        "Released 2 selected locks in cache 'default'.",
    ]
    assert [h.name for h in held_locks()] == ["deploy:web2", "local"]
    assert local.owned()
    assert [holder.let_go() for holder in stale] == ["lost", "lost"]
    assert other.let_go() == "released"


def test_filtered_reset_all_shows_selection_before_asking(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    hold(held, "batch:1", label="batch")
    keep = hold(held, "web", label="request")
    out = StringIO()
    shown_at_prompt: list[str] = []

    def answer(prompt: str) -> str:
        shown_at_prompt.append(out.getvalue() + prompt)
        return "yes"

    monkeypatch.setattr(builtins, "input", answer)
    call_command("locks", "--reset-all", "--label", "batch", stdout=out)
    [screen] = shown_at_prompt
    assert "batch:1" in screen and "web " not in screen
    assert "force-release the 1 lock listed above" in screen
    assert out.getvalue().endswith("Released 1 selected lock in cache 'default'.\n")
    assert [h.name for h in held_locks()] == ["web"]
    assert keep.owned()


def test_filtered_reset_all_keeps_locks_when_not_confirmed(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = hold(held, "batch:1", label="batch")
    monkeypatch.setattr(builtins, "input", lambda prompt: "no")
    assert locks("--reset-all", "--label", "batch").endswith("Reset cancelled.\n")
    assert lock.owned()


def test_filtered_reset_all_leaves_a_lock_that_changed_hands_after_listing(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = hold(held, "batch:1", label="batch")
    successor: list[Mutex] = []

    def hand_over_then_confirm(prompt: str) -> str:
        # While the operator reads the selection, the holder finishes and a new
        # holder, matching the same filter, takes the lock.
        first.release()
        successor.append(hold(held, "batch:1", label="batch"))
        return "yes"

    monkeypatch.setattr(builtins, "input", hand_over_then_confirm)
    out = locks("--reset-all", "--label", "batch")
    assert out.splitlines()[-2:] == [
        "'batch:1' was released or changed hands since it was listed; left alone.",
        "Released 0 of the 1 selected lock in cache 'default'.",
    ]
    assert successor[0].owned()


def test_filtered_reset_all_with_nothing_selected_asks_nothing(
    held: list[Mutex], monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = hold(held, "a", label="cron")
    monkeypatch.setattr(builtins, "input", lambda prompt: pytest.fail("asked to confirm"))
    assert locks("--reset-all", "--label", "deploy").splitlines()[-1] == "Nothing to reset."
    assert lock.owned()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "10x"], "--older-than '10x' is not a duration: write seconds (90)"),
        (["--older-than", "1m30h"], "--older-than '1m30h' is not a duration"),
        (["--older-than", "-5"], "--older-than '-5' is not a duration"),
        (["--older-than", "inf"], "--older-than 'inf' is not a duration"),
        (["--older-than", ""], "--older-than is empty; give a value to match."),
        (["--pid", "abc"], "--pid 'abc' is not a process id: give a whole number of at least 1."),
        (["--pid", "0"], "--pid 0 is not a process id"),
        (["--pid", "-3"], "--pid '-3' is not a process id"),
        (["--host", ""], "--host is empty; give a value to match."),
        (["--label", "  "], "--label is empty; give a value to match."),
        (["--reset", "a", "--host", "web1"], "--reset takes lock names; the filters"),
    ],
)
def test_bad_filter_is_a_command_error_naming_it(
    args: list[str], message: str, held: list[Mutex]
) -> None:
    lock = hold(held, "a")
    for extra in ([], ["--reset-all", "--noinput"]):
        if "--reset" in args and extra:
            continue
        with pytest.raises(CommandError) as raised:
            locks(*args, *extra)
        assert str(raised.value).startswith(message)
    assert lock.owned()


def _manage(*args: str, **popen: Any) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=ROOT,
    )
    return subprocess.run(
        [sys.executable, "-m", "django", "locks", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        **popen,
    )


def _close_stdin() -> None:
    os.close(0)


# How cron, CI or a script runs the command: stdin at its end, or no stdin at all.
NO_TERMINAL = [
    pytest.param({"stdin": subprocess.DEVNULL}, id="stdin-dev-null"),
    pytest.param({"stdin": subprocess.DEVNULL, "preexec_fn": _close_stdin}, id="stdin-closed"),
]


@pytest.mark.parametrize("popen", NO_TERMINAL)
@pytest.mark.parametrize("filters", [[], ["--host", "web1"]], ids=["all", "filtered"])
def test_reset_all_without_a_terminal_fails_in_one_line_naming_noinput(
    popen: dict[str, Any], filters: list[str], hold_on_host: Any
) -> None:
    kept = hold_on_host("deploy:web1", "web1")
    result = _manage("--reset-all", *filters, **popen)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "CommandError: Confirmation needs a terminal, and standard input is closed or at "
        "its end; pass --noinput to reset without asking."
    ]
    assert kept.let_go() == "released"


def test_reset_all_by_host_from_the_command_line(hold_on_host: Any) -> None:
    gone = hold_on_host("deploy:web1", "web1")
    kept = hold_on_host("deploy:web2", "web2")
    result = _manage("--reset-all", "--host", "web1", "--noinput")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[2].split()[:2] == ["deploy:web1", "web1"]
    assert lines[-1] == "Released 1 selected lock in cache 'default'."
    assert gone.let_go() == "lost"
    assert kept.let_go() == "released"


def test_bad_duration_from_the_command_line_is_one_line_on_stderr() -> None:
    result = _manage("--older-than", "soon")
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("CommandError: --older-than 'soon' is not a duration: ")


# -- semaphores ------------------------------------------------------------


@pytest.fixture
def permits(settings: Any) -> Iterator[list[Semaphore]]:
    """Collect semaphore handles a test acquires; give back those still held at the end."""
    handles: list[Semaphore] = []
    yield handles
    for handle in handles:
        if handle.token is not None:
            with contextlib.suppress(LockLost, LockNotOwned):
                handle.release()


def take_permit(permits: list[Semaphore], name: str, limit: int, **options: Any) -> Semaphore:
    """Take one permit of ``name`` (no watchdog: a reset is not undone by a renewal)."""
    handle = Semaphore(name, limit, ttl=60, watchdog=False, **options)
    assert handle.acquire(blocking=False)
    permits.append(handle)
    return handle


def test_json_lists_semaphores_after_locks_with_kind_limit_and_holders(
    held: list[Mutex], permits: list[Semaphore]
) -> None:
    hold(held, "reports")
    take_permit(permits, "exports", 3, label="nightly")
    take_permit(permits, "exports", 3, label="hourly")
    data = json.loads(locks("--json"))
    assert [(item["kind"], item["name"]) for item in data] == [
        ("lock", "reports"),
        ("semaphore", "exports"),
    ]
    exports = data[1]
    assert (exports["limit"], exports["waiters"]) == (3, 0)
    assert sorted(h["owner"]["label"] for h in exports["holders"]) == ["hourly", "nightly"]
    assert {h["owner"]["pid"] for h in exports["holders"]} == {os.getpid()}
    assert all(0 < h["time_left"] <= 60 for h in exports["holders"])
    assert {h["token"] for h in exports["holders"]} == {p.token for p in permits}


def test_json_with_a_filter_lists_locks_only(hold_on_host: Any, permits: list[Semaphore]) -> None:
    web1 = hold_on_host("deploy:web1", "web1")
    take_permit(permits, "exports", 2)
    data = json.loads(locks("--json", "--host", "web1"))
    assert [(item["kind"], item["name"]) for item in data] == [("lock", "deploy:web1")]
    assert web1.let_go() == "released"


def test_reset_semaphore_frees_every_permit_and_keeps_the_lock_of_that_name(
    held: list[Mutex], permits: list[Semaphore]
) -> None:
    lock = hold(held, "jobs")
    first = take_permit(permits, "jobs", 2)
    take_permit(permits, "jobs", 2)
    assert not Semaphore("jobs", 2).acquire(blocking=False)  # both permits taken
    out = locks("--reset-semaphore", "jobs")
    assert out.splitlines() == ["Reset semaphore 'jobs': freed 2 permits."]
    assert held_semaphores() == []
    assert lock.owned()
    with pytest.raises(LockNotOwned):
        first.release()
    fresh = [Semaphore("jobs", 2, watchdog=False) for _ in range(2)]
    assert all(handle.acquire(blocking=False) for handle in fresh)
    permits.extend(fresh)


def test_reset_of_a_lock_leaves_the_semaphore_of_that_name(
    held: list[Mutex], permits: list[Semaphore]
) -> None:
    hold(held, "jobs")
    permit = take_permit(permits, "jobs", 1)
    assert locks("--reset", "jobs").splitlines() == ["Released 'jobs'."]
    assert [(s.name, [h.token for h in s.holders]) for s in held_semaphores()] == [
        ("jobs", [permit.token])
    ]


def test_reset_semaphore_of_a_name_not_held_fails_after_resetting_the_others(
    permits: list[Semaphore],
) -> None:
    take_permit(permits, "exports", 1)
    out = StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("locks", "--reset-semaphore", "exports", "exprots", stdout=out)
    assert str(raised.value) == (
        "No permit of semaphore 'exprots' is held in cache 'default'; nothing reset."
    )
    assert out.getvalue().splitlines() == ["Reset semaphore 'exports': freed 1 permit."]
    assert held_semaphores() == []


def test_reset_semaphore_of_a_lock_name_points_to_reset(held: list[Mutex]) -> None:
    lock = hold(held, "payments")
    with pytest.raises(CommandError, match=r"A lock of that name is held: use --reset 'payments'"):
        locks("--reset-semaphore", "payments")
    assert lock.owned()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--reset-semaphore", ""], "Lock name must not be empty"),
        (["--reset-semaphore", "a", "--host", "web1"], "--reset-semaphore takes semaphore names"),
        (["--reset-semaphore", "a", "--reset", "a"], "argument --reset: not allowed with"),
    ],
)
def test_bad_reset_semaphore_is_a_command_error(args: list[str], message: str) -> None:
    with pytest.raises(CommandError) as raised:
        locks(*args)
    assert message in str(raised.value)


def test_reset_semaphore_of_a_name_not_held_exits_non_zero_from_the_command_line() -> None:
    result = _manage("--reset-semaphore", "never-taken")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "CommandError: No permit of semaphore 'never-taken' is held in cache 'default'; "
        "nothing reset."
    ]


def test_reset_all_releases_locks_and_leaves_semaphores_saying_so(
    held: list[Mutex], permits: list[Semaphore]
) -> None:
    lock = hold(held, "reports")
    permit = take_permit(permits, "exports", 2)
    out = locks("--reset-all", "--noinput")
    assert out.splitlines() == [
        "Released 1 lock in cache 'default'.",
        "1 semaphore with permits held left alone "
        "(--reset-all releases locks only; use --reset-semaphore NAME).",
    ]
    assert not lock.owned()
    assert [h.token for s in held_semaphores() for h in s.holders] == [permit.token]


def test_quorum_alias_lists_and_resets_its_semaphores_and_a_member_is_refused(
    settings: Any, permits: list[Semaphore]
) -> None:
    default = settings.CACHES["default"]
    settings.CACHES = {
        **settings.CACHES,
        "m1": {**default, "KEY_PREFIX": "m1"},
        "m2": {**default, "KEY_PREFIX": "m2"},
        "q": {**default, "MUTEX": {**default["MUTEX"], "QUORUM": ["m1", "m2"]}},
    }
    first = take_permit(permits, "exports", 3, using="q", label="nightly")
    second = take_permit(permits, "exports", 3, using="q", label="hourly")
    take_permit(permits, "exports", 3, using="m1")  # on one master: not the quorum's
    [entry] = json.loads(locks("--json", "--using", "q"))
    assert (entry["kind"], entry["name"], entry["limit"]) == ("semaphore", "exports", 3)
    assert sorted(h["token"] for h in entry["holders"]) == sorted([first.token, second.token])
    lines = locks("--using", "q").splitlines()
    permit_lines = lines[lines.index("Semaphores in cache 'q':") + 1 :]
    assert permit_lines[0] == "  exports  2/3 permits held"
    assert sorted(line.split()[0] for line in permit_lines[1:]) == ["hourly", "nightly"]
    with pytest.raises(CommandError, match=r"member of quorum 'q'; reset the semaphore through"):
        locks("--using", "m1", "--reset-semaphore", "exports")
    assert len(held_semaphores("q")[0].holders) == 2
    out = locks("--using", "q", "--reset-semaphore", "exports")
    # Every master is reset, each in its own namespace: m1's own permit too.
    assert out.splitlines() == ["Reset semaphore 'exports': freed 3 permits."]
    assert held_semaphores("q") == [] and held_semaphores("m1") == []


# -- shared locks ----------------------------------------------------------


def test_table_marks_a_shared_lock_and_lists_each_holder(held: list[Mutex]) -> None:
    hold(held, "inventory", label="nightly import")
    with held_shared("report", "pdf export", "csv export") as handles:
        out = locks()
        fences = [handle.fence for handle in handles]
    _source, header, *rows, footer = out.splitlines()
    assert header.split()[0] == "NAME"
    assert rows[0].startswith("inventory ")
    shared_first, shared_second = rows[1:]
    assert shared_first.startswith("report (shared) ")
    assert shared_second.startswith("  + shared ")
    for row, fence, thread in zip(rows[1:], fences, ("reader-1", "reader-2"), strict=True):
        cells = row.split()
        assert str(os.getpid()) in cells and thread in cells and str(fence) in cells
    assert "pdf export" in shared_first and "csv export" in shared_second
    # The waiters are counted on the lock's first line only.
    assert shared_first.split()[-2:] == [str(fences[0]), "0"]
    assert shared_second.split()[-1] == str(fences[1])
    assert footer == "2 locks held in cache 'default' (1 shared, by 2 holders)."


def test_json_of_a_shared_lock_carries_every_holder(held: list[Mutex]) -> None:
    hold(held, "inventory")
    with held_shared("report", "pdf export", "csv export", ttl=30) as handles:
        data = json.loads(locks("--json"))
        fences = [handle.fence for handle in handles]
    exclusive, shared = data
    assert (exclusive["name"], exclusive["shared"], exclusive["holders"]) == (
        "inventory",
        False,
        [],
    )
    assert (shared["kind"], shared["name"], shared["shared"]) == ("lock", "report", True)
    assert set(shared) == {f.name for f in fields(HeldLock)} | {"ttl", "kind"}
    holders = shared["holders"]
    assert [h["owner"]["label"] for h in holders] == ["pdf export", "csv export"]
    assert [h["owner"]["thread"] for h in holders] == ["reader-1", "reader-2"]
    assert [h["fence"] for h in holders] == fences
    assert all(0 < h["time_left"] <= 30 and h["acquired_at"].endswith("+00:00") for h in holders)
    # The lock's own fields are its earliest holder's, its time left the longest.
    assert (shared["owner"], shared["fence"]) == (holders[0]["owner"], fences[0])
    assert shared["time_left"] == max(h["time_left"] for h in holders)


def test_label_filter_lists_only_the_matching_holder_of_a_shared_lock() -> None:
    with held_shared("report", "pdf export", "csv export") as (_first, second):
        out = locks("--label", "csv export")
        data = json.loads(locks("--json", "--label", "csv export"))
        fence = second.fence
    rows = out.splitlines()[2:-1]
    assert len(rows) == 1 and rows[0].startswith("report (shared) ")
    assert "csv export" in rows[0] and "pdf export" not in out
    assert [[h["fence"] for h in item["holders"]] for item in data] == [[fence]]


def test_filtered_reset_all_frees_only_the_matching_holder_of_a_shared_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shown_at_prompt: list[str] = []
    out = StringIO()

    def answer(prompt: str) -> str:
        shown_at_prompt.append(out.getvalue() + prompt)
        return "yes"

    monkeypatch.setattr(builtins, "input", answer)
    with held_shared("report", "pdf export", "csv export") as (first, second):
        call_command("locks", "--reset-all", "--label", "pdf export", stdout=out)
        [screen] = shown_at_prompt
        # The selection names the matching holder only, and says the others stay.
        assert "pdf export" in screen and "csv export" not in screen
        assert f" {first.fence} " in screen and f" {second.fence} " not in screen
        assert "the 1 lock listed above (of a shared lock, only the holders listed)" in screen
        assert out.getvalue().endswith("Released 1 selected lock in cache 'default'.\n")
        assert not first.owned()
        assert second.owned()
        [left] = held_locks()
        assert [h.fence for h in left.holders] == [second.fence]
        assert not Mutex("report").acquire(blocking=False)  # still held shared: no writer
    writer = Mutex("report", watchdog=False)
    assert writer.acquire(blocking=False)  # every reader gone: a writer gets in
    writer.release()


def test_reset_of_a_shared_lock_frees_every_holder() -> None:
    with held_shared("report", "pdf export", "csv export") as handles:
        assert locks("--reset", "report").splitlines() == ["Released 'report'."]
        assert [handle.owned() for handle in handles] == [False, False]
        assert held_locks() == []


def test_stats_lists_each_lock_class_with_its_figures() -> None:
    from django.test import override_settings

    from django_redis_mutex import stats

    from .helpers import caches_with
    from .test_stats import contend_in_threads

    with override_settings(CACHES=caches_with(STATS=True)):
        contend_in_threads(7)
        stats.flush()
        output = locks("--stats", "--minutes", "5")
    heading, row, summary = output.splitlines()[1:]
    assert heading.split()[:4] == ["LOCK", "CLASS", "ACQUIRED", "WAITED"]
    assert row.split()[:5] == ["product:{pk}", "2", "1", "(50%)", "1"]
    assert summary == "1 lock class in the last 5 minutes."


def test_stats_says_when_the_alias_does_not_count() -> None:
    assert locks("--stats").splitlines()[-1] == (
        "0 lock classes in the last 60 minutes (STATS is off for cache 'default')."
    )


def test_stats_takes_no_reset_flag() -> None:
    with pytest.raises(CommandError, match=r"--stats .* no reset flag"):
        locks("--stats", "--reset", "inventory")
