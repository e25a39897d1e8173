"""``@mutex`` on Django callables: function and class-based views, async views, model methods.

Views are requested through Django's real handlers (the test Client for WSGI,
the AsyncClient for ASGI) with MutexMiddleware installed; each guarded view
answers with the locks held while it ran (see tests/testapp/views.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.http import HttpResponse
from django.test import AsyncClient, Client

from django_redis_mutex import LockContended, Mutex, mutex
from django_redis_mutex.signals import lock_acquired
from tests.testapp.models import Counter

from .helpers import held_elsewhere


@pytest.fixture
def lock_defaults(settings: Any) -> Callable[..., None]:
    """Return a function changing the default alias's MUTEX settings for this test."""

    def change(**values: Any) -> None:
        default = settings.CACHES["default"]
        settings.CACHES = {
            **settings.CACHES,
            "default": {**default, "MUTEX": {**default["MUTEX"], **values}},
        }

    return change


@pytest.fixture
def acquired_names() -> Iterator[list[str]]:
    """Names of the locks acquired (not merely re-entered) during the test."""
    names: list[str] = []

    def record(sender: str, name: str, **kwargs: Any) -> None:
        names.append(name)

    lock_acquired.connect(record, weak=False)
    yield names
    lock_acquired.disconnect(record)


def aget(path: str, **extra: Any) -> HttpResponse:
    """GET ``path`` through Django's ASGI handler."""
    return asyncio.run(AsyncClient().get(path, **extra))  # type: ignore[no-any-return]


# -- views -----------------------------------------------------------------


def test_function_view_runs_under_its_lock(client: Client) -> None:
    response = client.get("/report/")
    assert response.json() == {"held": ["report"]}


def test_view_lock_is_released_when_the_view_returns(client: Client) -> None:
    client.get("/orders/42/")
    assert not Mutex("order:42").locked()


def test_view_lock_name_is_filled_from_url_arguments(client: Client) -> None:
    response = client.get("/orders/42/")
    assert response.json() == {"held": ["order:42"]}


def test_class_based_view_method_decorated_directly(client: Client) -> None:
    response = client.get("/items/7/")
    assert response.json() == {"held": ["item:7"]}


def test_class_based_view_decorated_with_method_decorator(client: Client) -> None:
    response = client.get("/decorated-items/7/")
    assert response.json() == {"held": ["item:7"]}


def test_async_function_view_under_asgi() -> None:
    response = aget("/async-report/")
    assert response.json() == {"held": ["report"]}


def test_async_function_view_under_wsgi(client: Client) -> None:
    response = client.get("/async-report/")
    assert response.json() == {"held": ["report"]}


def test_async_class_based_view_under_asgi() -> None:
    response = aget("/async-items/3/")
    assert response.json() == {"held": ["item:3"]}


def test_missing_placeholder_fails_when_called_not_when_decorated(client: Client) -> None:
    @mutex("order:{order_id}")
    def view(request: Any) -> HttpResponse:
        return HttpResponse()

    with pytest.raises(ValueError, match=r"names \{order_id\}, which is not an argument of"):
        view(object())


def test_missing_placeholder_in_a_view_is_a_500_not_a_503(client: Client) -> None:
    with pytest.raises(ValueError, match=r"'order:\{order_id\}' names \{order_id\}"):
        client.get("/missing-placeholder/")


# -- views whose lock is held elsewhere --------------------------------------


def test_view_held_on_its_filled_name_returns_503_json(
    client: Client, lock_defaults: Callable[..., None]
) -> None:
    lock_defaults(TIMEOUT=0.1)
    with held_elsewhere("order:42", ttl=7):
        busy = client.get("/orders/42/")
        free = client.get("/orders/43/")
    assert busy.status_code == 503
    body = busy.json()
    assert body == {"error": "locked", "lock": "order:42", "retry_after": body["retry_after"]}
    assert busy["Retry-After"] == str(body["retry_after"])
    assert free.status_code == 200
    assert free.json() == {"held": ["order:42", "order:43"]}


def test_class_based_view_held_elsewhere_returns_503_html_for_browsers(
    client: Client, lock_defaults: Callable[..., None]
) -> None:
    lock_defaults(TIMEOUT=0.1)
    with held_elsewhere("item:7"):
        response = client.get("/decorated-items/7/", headers={"accept": "text/html"})
    assert response.status_code == 503
    assert response["Content-Type"].startswith("text/html")
    assert "<code>item:7</code>" in response.content.decode()
    assert int(response["Retry-After"]) >= 1


def test_async_view_held_elsewhere_returns_503_json_under_asgi(
    lock_defaults: Callable[..., None],
) -> None:
    lock_defaults(TIMEOUT=0.1)
    with held_elsewhere("item:3"):
        response = aget("/async-items/3/")
    assert response.status_code == 503
    assert response.json()["lock"] == "item:3"
    assert response["Retry-After"] == str(response.json()["retry_after"])


def test_async_view_held_elsewhere_returns_503_html_under_asgi(
    lock_defaults: Callable[..., None],
) -> None:
    lock_defaults(TIMEOUT=0.1)
    with held_elsewhere("report"):
        response = aget("/async-report/", headers={"accept": "text/html"})
    assert response.status_code == 503
    assert "<code>report</code>" in response.content.decode()


# -- model methods -----------------------------------------------------------


@pytest.mark.django_db
def test_model_method_locks_its_own_row(acquired_names: list[str]) -> None:
    counter = Counter.objects.create(name="hits")
    assert counter.bump() == 1
    assert acquired_names == [f"counter:{counter.pk}"]
    assert not Mutex(f"counter:{counter.pk}").locked()


@pytest.mark.django_db
def test_model_method_refuses_while_its_row_is_locked_elsewhere(
    lock_defaults: Callable[..., None],
) -> None:
    lock_defaults(TIMEOUT=0.1)
    counter = Counter.objects.create(name="hits")
    with held_elsewhere(f"counter:{counter.pk}"), pytest.raises(LockContended) as raised:
        counter.bump()
    assert raised.value.name == f"counter:{counter.pk}"
    counter.refresh_from_db()
    assert counter.value == 0


@pytest.mark.django_db
def test_model_method_on_another_row_is_not_blocked(lock_defaults: Callable[..., None]) -> None:
    lock_defaults(TIMEOUT=0.1)
    first = Counter.objects.create(name="first")
    second = Counter.objects.create(name="second")
    with held_elsewhere(f"counter:{first.pk}"):
        assert second.bump() == 1


@pytest.mark.django_db
def test_view_and_model_method_on_the_same_lock_do_not_deadlock(
    client: Client, lock_defaults: Callable[..., None], acquired_names: list[str]
) -> None:
    # A deadlock would show as a 503 after this short timeout, not as a hang.
    lock_defaults(TIMEOUT=1)
    counter = Counter.objects.create(name="hits")
    response = client.get(f"/counters/{counter.pk}/bump/")
    assert response.status_code == 200
    assert response.json() == {"value": 1}
    assert acquired_names == [f"counter:{counter.pk}"]
