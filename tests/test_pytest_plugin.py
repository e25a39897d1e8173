"""The pytest plugin shipped with the app, run the way a user's test suite runs it.

Each test writes a small Django project and its tests into a temporary
directory with ``pytester`` and runs pytest on it in a subprocess, so the
plugin is the one pytest loads from the installed package's ``pytest11``
entry point, with the user's settings, never anything of this suite's
conftest. The fixtures start their own redis-server, not the suite's.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from .helpers import ROOT
from .test_docs import python_blocks

pytest_plugins = ["pytester"]

# The user's test settings: "default" names a Redis nothing listens on (port 9),
# so a test passes only if the fixture moved the alias to its own server;
# "local" is not a Redis cache at all.
USER_SETTINGS = """
SECRET_KEY = "user-suite"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_redis_mutex"]
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:9/0",
        "KEY_PREFIX": "shop",
        "MUTEX": {"TTL": 20},
    },
    "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
"""

# Generous for a busy 2-core machine: each run starts Python, Django and Redis.
RUN_TIMEOUT = 120


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A directory holding the user's settings, with DJANGO_SETTINGS_MODULE naming them."""
    pytester.makepyfile(user_settings=USER_SETTINGS)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "user_settings")
    return pytester


def run(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    return project.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=RUN_TIMEOUT)


def test_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    found = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="pytest11")}
    assert found["django_redis_mutex"] == "django_redis_mutex.pytest_plugin"


def test_user_suite_locks_its_code_on_the_plugins_redis(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        reports="""
        from django_redis_mutex import held_locks, mutex

        @mutex("report:{day}", blocking=False)
        def build_report(day):
            return [held.name for held in held_locks()]
        """,
        test_reports="""
        import threading

        from django.conf import settings
        from django_redis_mutex import Mutex, held_locks

        from reports import build_report

        def test_report_holds_its_lock_while_it_runs(redis_mutex_cache):
            assert redis_mutex_cache == "default"
            assert build_report("monday") == ["report:monday"]
            assert held_locks() == []

        def test_a_second_worker_is_kept_out(redis_mutex_cache):
            with Mutex("report:monday") as lock:
                other = []
                thread = threading.Thread(
                    target=lambda: other.append(Mutex("report:monday").acquire(blocking=False))
                )
                thread.start()
                thread.join()
                assert other == [False]
                assert [held.fence for held in held_locks()] == [lock.fence]

        def test_alias_is_on_the_plugins_server_with_its_own_key_settings(
            redis_mutex_cache, redis_mutex_server
        ):
            entry = settings.CACHES["default"]
            assert entry["LOCATION"] == redis_mutex_server.url
            assert (entry["KEY_PREFIX"], entry["MUTEX"]) == ("shop", {"TTL": 20})
        """,
    )
    result = run(user_project)
    result.assert_outcomes(passed=3)


def test_keys_of_one_test_are_gone_in_the_next_and_no_others(
    user_project: pytest.Pytester,
) -> None:
    user_project.makepyfile(
        test_isolation="""
        import redis
        from django.core.cache import caches
        from django_redis_mutex import Mutex, held_locks

        FOREIGN = {"not-ours": "1", "mutex:{left-held}": "1", "other:1:greeting": "1"}

        def test_first_leaves_a_lock_a_cache_entry_and_foreign_keys(
            redis_mutex_cache, redis_mutex_server
        ):
            caches["default"].set("greeting", "hello", timeout=300)
            lock = Mutex("left-held", ttl=300, watchdog=False)
            assert lock.acquire(blocking=False)
            raw = redis.Redis(port=redis_mutex_server.port)
            raw.mset(FOREIGN)  # keys no alias of the app made
            assert raw.dbsize() >= len(FOREIGN) + 2

        def test_second_starts_clean_and_foreign_keys_survive(
            redis_mutex_cache, redis_mutex_server
        ):
            assert caches["default"].get("greeting") is None
            assert held_locks() == []
            raw = redis.Redis(port=redis_mutex_server.port)
            assert sorted(key.decode() for key in raw.scan_iter()) == sorted(FOREIGN)
        """
    )
    result = run(user_project)
    result.assert_outcomes(passed=2)


def test_a_semaphore_left_held_by_one_test_is_free_in_the_next(
    user_project: pytest.Pytester,
) -> None:
    user_project.makepyfile(
        test_semaphores="""
        import redis
        from django_redis_mutex import Semaphore
        from django_redis_mutex.client import namespace

        def lookalikes():
            # In the namespace, but not in the layout of any key the app writes.
            ns = namespace("default")
            return {f"{ns}:semaphore": "1", f"{ns}:semaphores:{{x}}:holders": "1"}

        def test_first_leaves_the_only_permit_held(redis_mutex_cache, redis_mutex_server):
            permit = Semaphore("exports", 1, ttl=300, watchdog=False)
            assert permit.acquire(blocking=False)
            raw = redis.Redis(port=redis_mutex_server.port)
            raw.mset(lookalikes())

        def test_second_takes_it(redis_mutex_cache, redis_mutex_server):
            permit = Semaphore("exports", 1, ttl=300, watchdog=False)
            assert permit.acquire(blocking=False)
            permit.release()
            raw = redis.Redis(port=redis_mutex_server.port)
            # The clean-up after the first test left the lookalikes alone.
            assert set(lookalikes()) <= {key.decode() for key in raw.scan_iter()}
        """
    )
    result = run(user_project)
    result.assert_outcomes(passed=2)


def test_overridden_alias_turns_a_local_memory_cache_into_redis(
    user_project: pytest.Pytester,
) -> None:
    user_project.makeconftest(
        """
        import pytest

        @pytest.fixture
        def redis_mutex_cache_alias():
            return "local"
        """
    )
    user_project.makepyfile(
        test_alias="""
        from django.conf import settings
        from django_redis_mutex import held_locks, mutex

        def test_lock_on_the_chosen_alias(redis_mutex_cache, redis_mutex_server):
            assert redis_mutex_cache == "local"
            assert settings.CACHES["local"]["LOCATION"] == redis_mutex_server.url
            with mutex("checkout", using="local"):
                assert [held.name for held in held_locks("local")] == ["checkout"]
            assert settings.CACHES["default"]["LOCATION"] == "redis://127.0.0.1:9/0"
        """
    )
    result = run(user_project)
    result.assert_outcomes(passed=1)


def test_plugin_starts_nothing_for_a_suite_that_does_not_use_it(
    user_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A redis-server that cannot start: had the plugin tried, the run would fail.
    monkeypatch.setenv("REDIS_SERVER_BIN", str(user_project.path / "no-redis-server"))
    user_project.makepyfile(test_plain="def test_arithmetic():\n    assert 1 + 1 == 2\n")
    run(user_project).assert_outcomes(passed=1)
    listing = run(user_project, "--fixtures")
    listing.stdout.fnmatch_lines(
        [
            "*fixtures defined from django_redis_mutex.pytest_plugin*",
            "redis_mutex_cache*",
        ]
    )


def test_without_django_settings_the_fixture_says_what_is_missing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(test_unset="def test_lock(redis_mutex_cache):\n    pass\n")
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*redis_mutex_cache needs Django settings: set DJANGO_SETTINGS*"])


def test_the_documented_example_passes_as_a_user_suite(user_project: pytest.Pytester) -> None:
    [example] = [
        block
        for block in python_blocks(ROOT / "docs" / "testing-your-code.rst")
        if "def test_" in block.code
    ]
    user_project.makepyfile(test_example=example.code)
    result = run(user_project)
    result.assert_outcomes(passed=example.code.count("\ndef test_"))
