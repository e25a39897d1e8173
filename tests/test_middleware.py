"""MutexMiddleware: a lock a view cannot get becomes a 503 with Retry-After.

Requests go through Django's real handlers: the test Client (WSGI) and the
AsyncClient (ASGI), with the middleware installed by tests/settings.py. The
contending holder is another thread with its own handle, so the request's own
thread (or task) is a different owner and cannot join its hold.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory

from django_redis_mutex import LockDeadlock
from django_redis_mutex.middleware import MutexMiddleware
from django_redis_mutex.testing import free_port
from tests.testapp import views

from .helpers import held_elsewhere

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def down_alias(settings: Any) -> Callable[..., None]:
    """Return a function adding cache alias "down": Redis on a port nothing listens on."""

    def configure(*, fail_open: bool = False) -> None:
        settings.CACHES = {
            **settings.CACHES,
            "down": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
                "MUTEX": {"FAIL_OPEN": fail_open},
            },
        }

    return configure


def aget(path: str, **extra: Any) -> HttpResponse:
    """GET ``path`` through Django's ASGI handler."""
    return asyncio.run(AsyncClient().get(path, **extra))  # type: ignore[no-any-return]


# -- contended locks -------------------------------------------------------


def test_free_lock_lets_view_run_under_the_lock(client: Client) -> None:
    response = client.get("/busy/")
    assert response.status_code == 200
    assert response.json() == {"held": ["busy"]}


def test_contended_view_returns_503_json_with_retry_after(client: Client) -> None:
    with held_elsewhere("busy", ttl=7):
        response = client.get("/busy/")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert body == {"error": "locked", "lock": "busy", "retry_after": body["retry_after"]}
    assert 5 <= body["retry_after"] <= 7
    assert response["Retry-After"] == str(body["retry_after"])


def test_a_shared_view_runs_beside_a_reader_and_answers_503_while_a_writer_holds(
    client: Client,
) -> None:
    with held_elsewhere("busy", shared=True):
        beside_a_reader = client.get("/busy/read/")
        writer_refused = client.get("/busy/")
    with held_elsewhere("busy", ttl=7):
        reader_refused = client.get("/busy/read/")
    assert beside_a_reader.status_code == 200
    assert beside_a_reader.json() == {"held": ["busy"]}
    assert writer_refused.status_code == 503
    assert reader_refused.status_code == 503
    assert 5 <= int(reader_refused["Retry-After"]) <= 7


def test_retry_after_is_at_least_one_second_for_a_lease_about_to_end(client: Client) -> None:
    # The holder's watchdog keeps a 0.9 s lease alive; what is left is always < 1 s.
    with held_elsewhere("busy", ttl=0.9):
        response = client.get("/busy/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response.json()["retry_after"] == 1


def test_retry_after_of_a_view_whose_holds_are_short_is_one_second(client: Client) -> None:
    """With STATS on, the view's own quick holds say "try again at once", not the lease."""
    from django.test import override_settings

    from .helpers import caches_with

    with override_settings(CACHES=caches_with(STATS=True)):
        for _ in range(10):
            assert client.get("/busy/").status_code == 200
        with held_elsewhere("busy", ttl=30):
            response = client.get("/busy/")
        from django_redis_mutex import stats

        stats.flush()
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response.json()["retry_after"] == 1


@pytest.mark.parametrize(
    "accept",
    [
        None,
        "*/*",
        "application/json",
        "text/*",
        "text/html;q=0",
        "application/json, text/html;q=0.5",
    ],
)
def test_clients_not_asking_for_html_get_json(client: Client, accept: str | None) -> None:
    headers = {} if accept is None else {"accept": accept}
    with held_elsewhere("busy"):
        response = client.get("/busy/", headers=headers)
    assert response.status_code == 503
    assert response.json()["error"] == "locked"


@pytest.mark.parametrize(
    "accept", ["text/html", BROWSER_ACCEPT, "application/json;q=0.5, text/html"]
)
def test_clients_naming_text_html_get_the_html_page(client: Client, accept: str) -> None:
    with held_elsewhere("busy", ttl=7):
        response = client.get("/busy/", headers={"accept": accept})
    assert response.status_code == 503
    assert response["Content-Type"].startswith("text/html")
    retry_after = int(response["Retry-After"])
    page = response.content.decode()
    assert "<h1>Someone else is working on this right now</h1>" in page
    assert f"Please try again in {retry_after} seconds." in page
    assert "<code>busy</code>" in page


def test_html_page_needs_no_javascript(client: Client) -> None:
    with held_elsewhere("busy"):
        response = client.get("/busy/", headers={"accept": "text/html"})
    page = response.content.decode().lower()
    assert "<script" not in page
    assert "onload" not in page


def test_html_page_is_rendered_from_the_project_template_when_overridden(
    client: Client, settings: Any, tmp_path: Path
) -> None:
    override = tmp_path / "django_redis_mutex" / "503.html"
    override.parent.mkdir()
    override.write_text("<p>Our own page: {{ lock }} in {{ retry_after }}s</p>")
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [str(tmp_path)]}]
    with held_elsewhere("busy", ttl=1):
        response = client.get("/busy/", headers={"accept": "text/html"})
    assert response.status_code == 503
    assert response.content.decode() == "<p>Our own page: busy in 1s</p>"


def test_html_page_escapes_the_lock_name(rf: RequestFactory) -> None:
    middleware = MutexMiddleware(lambda request: HttpResponse())
    request = rf.get("/", headers={"accept": "text/html"})
    response = middleware.unavailable(request, lock="<b>order</b>", retry_after=3)
    page = response.content.decode()
    assert "<code>&lt;b&gt;order&lt;/b&gt;</code>" in page
    assert "<b>" not in page


def test_html_page_says_one_second_in_the_singular(rf: RequestFactory) -> None:
    middleware = MutexMiddleware(lambda request: HttpResponse())
    request = rf.get("/", headers={"accept": "text/html"})
    page = middleware.unavailable(request, lock="busy", retry_after=1).content.decode()
    assert "Please try again in 1 second." in page


def test_503_varies_on_accept_and_is_never_cached(client: Client) -> None:
    with held_elsewhere("busy"):
        response = client.get("/busy/")
    assert "Accept" in response["Vary"]
    assert "no-store" in response["Cache-Control"]


def test_contended_503_is_logged_as_warning_not_error(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with held_elsewhere("busy"), caplog.at_level(logging.INFO, logger="django.request"):
        client.get("/busy/")
    [record] = [r for r in caplog.records if r.name == "django.request"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("Service Unavailable (lock 'busy' is held, retry after")
    assert record.status_code == 503  # type: ignore[attr-defined]


# -- Redis unavailable -----------------------------------------------------


def test_unreachable_redis_returns_503_without_lock_name(
    client: Client, down_alias: Callable[..., None]
) -> None:
    down_alias()
    response = client.get("/unavailable/")
    assert response.status_code == 503
    assert response.json() == {"error": "lock backend unavailable"}
    assert response["Retry-After"] == str(MutexMiddleware.unavailable_retry_after)


def test_unreachable_redis_html_page_does_not_name_the_lock(
    client: Client, down_alias: Callable[..., None]
) -> None:
    down_alias()
    response = client.get("/unavailable/", headers={"accept": "text/html"})
    assert response.status_code == 503
    page = response.content.decode()
    assert "<h1>This service is temporarily unavailable</h1>" in page
    assert "flaky" not in page
    assert int(response["Retry-After"]) >= 1


def test_unreachable_redis_is_logged_as_error_with_its_cause(
    client: Client, down_alias: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    down_alias()
    with caplog.at_level(logging.INFO, logger="django.request"):
        client.get("/unavailable/")
    [record] = [r for r in caplog.records if r.name == "django.request"]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert message.startswith("Service Unavailable: /unavailable/: Redis for cache 'down'")
    assert "refused" in message


def test_fail_open_alias_runs_view_unlocked_instead_of_503(
    client: Client, down_alias: Callable[..., None]
) -> None:
    down_alias(fail_open=True)
    response = client.get("/unavailable/")
    assert response.status_code == 200
    assert response.json() == {"ran": True}


# -- everything else passes through ----------------------------------------


@pytest.mark.parametrize("kind", sorted(views.ERRORS))
def test_other_exceptions_propagate_untouched(client: Client, kind: str) -> None:
    with pytest.raises(type(views.ERRORS[kind])) as raised:
        client.get(f"/fail/{kind}/")
    assert raised.value is views.ERRORS[kind]


def test_other_exceptions_still_become_django_500() -> None:
    response = Client(raise_request_exception=False).get("/fail/lost/")
    assert response.status_code == 500


def test_a_deadlock_victim_is_answered_503_as_a_contended_lock(rf: RequestFactory) -> None:
    middleware = MutexMiddleware(lambda request: HttpResponse())
    victim = LockDeadlock("orders", cycle=("'orders' held by web1, pid 7",), retry_after=4)
    response = middleware.process_exception(rf.get("/orders/"), victim)
    assert response is not None
    assert response.status_code == 503
    assert json.loads(response.content) == {"error": "locked", "lock": "orders", "retry_after": 4}
    assert response["Retry-After"] == "4"


def test_process_exception_declines_other_exceptions() -> None:
    middleware = MutexMiddleware(lambda request: HttpResponse())
    assert middleware.process_exception(HttpRequest(), ValueError("boom")) is None


# -- ASGI and async views ----------------------------------------------------


def test_middleware_runs_natively_in_an_async_chain() -> None:
    async def get_response(request: HttpRequest) -> HttpResponse:
        return HttpResponse("async")

    assert iscoroutinefunction(MutexMiddleware(get_response))
    assert not iscoroutinefunction(MutexMiddleware(lambda request: HttpResponse()))


def test_async_view_under_asgi_returns_503_when_contended() -> None:
    with held_elsewhere("busy", ttl=7):
        response = aget("/async-busy/")
    assert response.status_code == 503
    assert response.json()["lock"] == "busy"
    assert response["Retry-After"] == str(response.json()["retry_after"])


def test_async_view_under_asgi_html_page(settings: Any) -> None:
    with held_elsewhere("busy"):
        response = aget("/async-busy/", headers={"accept": BROWSER_ACCEPT})
    assert response.status_code == 503
    assert "<code>busy</code>" in response.content.decode()


def test_sync_view_under_asgi_returns_503_when_contended() -> None:
    with held_elsewhere("busy"):
        response = aget("/busy/")
    assert response.status_code == 503
    assert response.json()["error"] == "locked"


def test_async_view_under_wsgi_returns_503_when_contended(client: Client) -> None:
    with held_elsewhere("busy"):
        response = client.get("/async-busy/")
    assert response.status_code == 503
    assert response.json()["lock"] == "busy"


def test_async_view_under_asgi_runs_when_free() -> None:
    response = aget("/async-busy/")
    assert response.status_code == 200
    assert response.json() == {"held": ["busy"]}


def test_async_view_with_unreachable_redis_returns_503_under_asgi(
    down_alias: Callable[..., None],
) -> None:
    down_alias()
    response = aget("/async-unavailable/")
    assert response.status_code == 503
    assert response.json() == {"error": "lock backend unavailable"}


def test_other_exceptions_propagate_under_asgi() -> None:
    with pytest.raises(ValueError) as raised:
        aget("/fail/value/")
    assert raised.value is views.ERRORS["value"]
