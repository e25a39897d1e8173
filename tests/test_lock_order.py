"""Lock-order checking: the recorder of the orders in which owners take lock classes."""

from __future__ import annotations

from django_redis_mutex import Mutex, mutex, semaphore
from django_redis_mutex.lockorder import LockClass, Recorder


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
