"""Lock-order checking (``--lock-order``), run the way a user's test suite runs it.

As in ``test_pytest_plugin.py``, each test writes a small project and its tests
with ``pytester`` and runs pytest on them in a subprocess, where the plugin is
loaded from the installed package and its fixtures start a redis-server of
their own. The tests take real locks on it. The recorder, and where a handle's
lock class comes from, are then checked on their own.
"""

from __future__ import annotations

import re

import pytest

from django_redis_mutex import Mutex, mutex, semaphore
from django_redis_mutex.lockorder import LockClass, Recorder

from .helpers import ROOT
from .test_docs import blocks_of, python_blocks
from .test_pytest_plugin import USER_SETTINGS, run

pytest_plugins = ["pytester"]

# Two code paths of a shop: restock takes the inventory, then each product;
# reprice takes one product, then the inventory.
SHOP = """
from django_redis_mutex import mutex


@mutex("product:{pk}")
def count(pk):
    return 1


@mutex("inventory")
def restock(pks):
    return sum(count(pk) for pk in pks)


@mutex("product:{pk}")
def reprice(pk, price):
    with mutex("inventory"):
        return price
"""


@pytest.fixture
def shop(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A user project: its settings and a module of locked code paths."""
    pytester.makepyfile(user_settings=USER_SETTINGS, shop=SHOP)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "user_settings")
    return pytester


def assert_a_then_b_inverted(result: pytest.RunResult, first: str, second: str, *then: str) -> None:
    """Assert test_orders failed: 'a' then 'b' taken by ``first``, the reverse by ``second``."""
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*lock order inversion: 'a' then 'b' at",
            f"*test_shop.py::test_orders ({first})",
            "*in a_then_b",
            "*but 'b' then 'a' at",
            f"*test_shop.py::test_orders ({second})",
            *then,
        ]
    )


def test_two_tests_taking_two_locks_in_opposite_orders_fail_the_run(
    shop: pytest.Pytester,
) -> None:
    shop.makepyfile(
        test_shop="""
        from shop import reprice, restock

        def test_restock(redis_mutex_cache):
            assert restock([1]) == 1

        def test_reprice(redis_mutex_cache):
            assert reprice(2, 10) == 10
        """
    )
    result = run(shop, "--lock-order", "-ra")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*lock order inversion: 'inventory' then 'product:{pk}' at",
            "*test_shop.py::test_restock (thread MainThread)",
            '*File "*test_shop.py", line *, in test_restock',
            "*assert restock(*) == 1",
            '*File "*shop.py", line *, in restock',
            "*return sum(count(pk) for pk in pks)",
            "*but 'product:{pk}' then 'inventory' at",
            "*test_shop.py::test_reprice (thread MainThread)",
            '*File "*shop.py", line *, in reprice',
            '*with mutex("inventory"):',
        ]
    )
    # The test that took the second order is the one that fails.
    result.stdout.fnmatch_lines(["FAILED test_shop.py::test_reprice - *lock order inversion*"])
    result.stdout.fnmatch_lines(
        [
            "*= lock order inversions =*",
            "'inventory' and 'product:{pk}': taken in both orders "
            "(failed test_shop.py::test_reprice)",
        ]
    )


def test_the_same_order_everywhere_passes(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        from django_redis_mutex import mutex
        from shop import count, restock

        def test_restock(redis_mutex_cache):
            assert restock([1, 2]) == 2

        def test_count_under_the_inventory(redis_mutex_cache):
            with mutex("inventory"):
                assert count(3) == 1
        """
    )
    result = run(shop, "--lock-order")
    result.assert_outcomes(passed=2)
    assert "lock order" not in result.stdout.str()


def test_a_name_template_is_one_class_whatever_the_values(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        from shop import reprice, restock

        def test_reprice_one_product_then_restock_others(redis_mutex_cache):
            assert reprice(1, 10) == 10
            assert restock([2, 3]) == 2
        """
    )
    result = run(shop, "--lock-order")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*lock order inversion: 'product:{pk}' then 'inventory' at*", "*in reprice*"]
    )


def test_handles_built_with_literal_names_are_classes_of_their_own(
    shop: pytest.Pytester,
) -> None:
    shop.makepyfile(
        test_shop="""
        from django_redis_mutex import Mutex

        def test_one_order(redis_mutex_cache):
            with Mutex("product:1"), Mutex("product:2"):
                pass

        def test_other_names(redis_mutex_cache):
            with Mutex("product:2"), Mutex("product:3"):
                pass

        def test_grouped_by_hand(redis_mutex_cache):
            first, second = Mutex("product:2"), Mutex("product:1")
            first.lock_class = second.lock_class = "product:{pk}"
            with first, second:  # one class: never an order against itself
                pass
        """
    )
    run(shop, "--lock-order").assert_outcomes(passed=3)


def test_a_reentrant_nested_block_of_a_held_lock_adds_no_order(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        from django_redis_mutex import mutex

        def test_inventory_then_product_then_inventory_again(redis_mutex_cache):
            with mutex("inventory"):
                with mutex("product:{pk}"):
                    with mutex("inventory"):  # joins the hold it has
                        pass

        def test_inventory_then_product(redis_mutex_cache):
            with mutex("inventory"), mutex("product:{pk}"):
                pass
        """
    )
    run(shop, "--lock-order").assert_outcomes(passed=2)


def test_threads_holding_one_lock_each_are_separate_owners(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        import threading

        from django_redis_mutex import mutex

        def test_one_thread_holds_a_while_another_takes_b(redis_mutex_cache):
            holding, done = threading.Event(), threading.Event()

            def hold_a():
                with mutex("a"):
                    holding.set()
                    done.wait(10)

            thread = threading.Thread(target=hold_a)
            thread.start()
            try:
                assert holding.wait(10)
                with mutex("b"):
                    pass
            finally:
                done.set()
                thread.join()

        def test_b_then_a(redis_mutex_cache):
            with mutex("b"), mutex("a"):
                pass
        """
    )
    run(shop, "--lock-order").assert_outcomes(passed=2)


def test_an_inversion_between_a_thread_and_the_main_thread_is_found(
    shop: pytest.Pytester,
) -> None:
    shop.makepyfile(
        test_shop="""
        import threading

        from django_redis_mutex import mutex

        def a_then_b():
            with mutex("a"), mutex("b"):
                pass

        def test_orders(redis_mutex_cache):
            thread = threading.Thread(target=a_then_b, name="worker")
            thread.start()
            thread.join()
            with mutex("b"), mutex("a"):
                pass
        """
    )
    assert_a_then_b_inverted(run(shop, "--lock-order"), "thread worker", "thread MainThread")


def test_two_tasks_of_one_loop_are_separate_owners(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        import asyncio

        from django_redis_mutex import mutex

        def test_one_task_holds_a_while_another_takes_b(redis_mutex_cache):
            async def main():
                holding, done = asyncio.Event(), asyncio.Event()

                async def hold_a():
                    async with mutex("a"):
                        holding.set()
                        await done.wait()

                async def take_b():
                    await holding.wait()
                    async with mutex("b"):
                        pass
                    done.set()

                await asyncio.gather(hold_a(), take_b())

            asyncio.run(main())

        def test_b_then_a(redis_mutex_cache):
            async def main():
                async with mutex("b"), mutex("a"):
                    pass

            asyncio.run(main())
        """
    )
    run(shop, "--lock-order").assert_outcomes(passed=2)


def test_an_inversion_between_two_tasks_is_found(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        import asyncio

        from django_redis_mutex import mutex

        async def a_then_b():
            async with mutex("a"), mutex("b"):
                pass

        async def b_then_a():
            async with mutex("b"), mutex("a"):
                pass

        def test_orders(redis_mutex_cache):
            async def main():
                await asyncio.create_task(a_then_b(), name="first")
                await asyncio.create_task(b_then_a(), name="second")

            asyncio.run(main())
        """
    )
    assert_a_then_b_inverted(run(shop, "--lock-order"), "task first", "task second", "*in b_then_a")


def test_shared_locks_and_semaphore_permits_count_like_locks(shop: pytest.Pytester) -> None:
    shop.makepyfile(
        test_shop="""
        from django_redis_mutex import mutex, semaphore

        def test_catalog_then_export(redis_mutex_cache):
            with mutex("catalog", shared=True), semaphore("exports", 2):
                pass

        def test_export_then_catalog(redis_mutex_cache):
            with semaphore("exports", 2), mutex("catalog", shared=True):
                pass
        """
    )
    result = run(shop, "--lock-order")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*lock order inversion: 'catalog' then semaphore 'exports' at",
            "*but semaphore 'exports' then 'catalog' at",
        ]
    )


INVERTED = """
from shop import reprice, restock

def test_restock(redis_mutex_cache):
    assert restock([1]) == 1

def test_reprice(redis_mutex_cache):
    assert reprice(2, 10) == 10
"""


def test_off_by_default(shop: pytest.Pytester) -> None:
    shop.makepyfile(test_shop=INVERTED)
    result = run(shop)
    result.assert_outcomes(passed=2)
    assert "lock order" not in result.stdout.str()


def test_the_ini_option_turns_it_on(shop: pytest.Pytester) -> None:
    shop.makeini("[pytest]\nlock_order = true\n")
    shop.makepyfile(test_shop=INVERTED)
    run(shop).assert_outcomes(passed=1, failed=1)
    run(shop, "-o", "lock_order=false").assert_outcomes(passed=2)


def test_an_inversion_in_a_failing_test_keeps_its_failure_and_fails_the_run(
    shop: pytest.Pytester,
) -> None:
    shop.makepyfile(
        test_shop="""
        from shop import reprice, restock

        def test_restock(redis_mutex_cache):
            assert restock([1]) == 1

        def test_reprice(redis_mutex_cache):
            assert reprice(2, 10) == 11
        """
    )
    result = run(shop, "--lock-order")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*assert 10 == 11*"])
    result.stdout.fnmatch_lines(
        [
            "*= lock order inversions =*",
            "lock order inversion: 'inventory' then 'product:{pk}' at",
        ]
    )


def test_the_documented_example_is_caught_as_the_page_shows(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = ROOT / "docs" / "lock-order.rst"
    [example] = python_blocks(page)
    [shown] = [block for block in blocks_of(page) if block.language == "text"]
    pytester.makepyfile(user_settings=USER_SETTINGS, test_shop=example.code)
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "user_settings")
    run(pytester).assert_outcomes(passed=2)
    result = run(pytester, "--lock-order")
    result.assert_outcomes(passed=1, failed=1)
    # The page's output, line for line; the run's paths are absolute.
    expected = [
        re.sub(r"([*?[])", r"[\1]", line).replace('File "test_shop.py"', 'File "*test_shop.py"')
        for line in shown.code.splitlines()
        if not line.startswith(("___", "==="))
    ]
    result.stdout.fnmatch_lines(expected, consecutive=False)


# The recorder alone, without Redis: what it keeps.


class FakeHold:
    """What the recorder reads of a hold."""

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.active = True
        self.releasing = False


def test_each_order_keeps_only_the_first_place_it_was_seen() -> None:
    recorder = Recorder()
    a, b = LockClass("lock", "a"), LockClass("lock", "b")
    for _ in range(3):
        first, then = FakeHold("owner"), FakeHold("owner")
        recorder.taken(first, a)
        recorder.taken(then, b)
        first.active = then.active = False
    [order] = recorder.orders()
    assert (order.first, order.then) == (a, b)
    assert "test_each_order_keeps_only_the_first_place_it_was_seen" in order.stack


def test_a_hold_given_back_orders_nothing_after_it() -> None:
    recorder = Recorder()
    held = FakeHold("owner")
    recorder.taken(held, LockClass("lock", "a"))
    held.active = False
    recorder.taken(FakeHold("owner"), LockClass("lock", "b"))
    assert recorder.orders() == []


def test_owners_that_hold_nothing_are_forgotten() -> None:
    recorder = Recorder()
    for owner in range(1000):
        hold = FakeHold(owner)
        recorder.taken(hold, LockClass("lock", "a"))
        hold.active = False
    assert len(recorder._held) <= 64


def test_two_classes_taken_in_opposite_orders_are_one_inversion() -> None:
    recorder = Recorder()
    a, b = LockClass("lock", "a"), LockClass("semaphore", "b")
    recorder.taken(FakeHold("first"), a)
    recorder.taken(FakeHold("first"), b)
    recorder.taken(FakeHold("second"), b)
    recorder.taken(FakeHold("second"), a)
    [inversion] = recorder.inversions
    text = str(inversion)
    assert text.startswith("lock order inversion: 'a' then semaphore 'b' at\n")
    assert "but semaphore 'b' then 'a' at\n" in text


# Where a handle's class comes from.


def reorder_name(pk: int) -> str:
    return f"reorder:{pk}"


def test_a_handle_of_a_name_template_is_of_the_templates_class() -> None:
    assert mutex("product:{pk}")._handle("product:7").lock_class == "product:{pk}"
    assert semaphore("export:{kind}", 2)._handle("export:csv").lock_class == "export:{kind}"


def test_a_handle_of_a_callable_name_is_of_its_qualified_name() -> None:
    handle = mutex(reorder_name)._handle("reorder:7")
    assert handle.lock_class == f"{__name__}.reorder_name"


def test_a_handle_built_directly_is_of_its_names_class_unless_told() -> None:
    lock = Mutex("product:7")
    assert lock.lock_class == "product:7"
    lock.lock_class = "product:{pk}"
    assert lock.lock_class == "product:{pk}"
