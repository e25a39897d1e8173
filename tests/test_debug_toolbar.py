"""The django-debug-toolbar panel, through the real toolbar: middleware, store and render view.

Each test turns the toolbar on with ``override_settings`` (app, middleware,
``tests/toolbar_urls.py`` as the URLconf, only the Locks panel), requests a locked view, then
asks the toolbar's ``render_panel`` view for the panel, as the toolbar's
JavaScript does, and reads the table it returns.
"""

from __future__ import annotations

import asyncio
import copy
import html
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, override_settings

from django_redis_mutex import (
    LockBackendUnavailable,
    LockContended,
    LockLost,
    Mutex,
    held_locks,
    mutex,
    reset,
    signals,
)
from django_redis_mutex.testing import free_port

from .helpers import wait_until

PAGE = "<html><body>{}</body></html>"


def show_toolbar(request: HttpRequest) -> bool:
    return True


def reserve(request: HttpRequest) -> HttpResponse:
    """Wait for "inventory", then find "report" held by someone else."""
    with mutex("inventory") as lock:
        fence = lock.fence
    try:
        with mutex("report", timeout=0):
            pass
    except LockContended:
        pass
    return HttpResponse(PAGE.format(f"fence {fence}"))


def in_transaction(request: HttpRequest) -> HttpResponse:
    """Take "inventory" inside a transaction: it is kept until the COMMIT."""
    with transaction.atomic(), mutex("inventory") as lock:
        fence = lock.fence
    return HttpResponse(PAGE.format(f"fence {fence}"))


# Set by a test to let the "slow" request leave its lock.
gate = threading.Event()


def locked(request: HttpRequest, name: str) -> HttpResponse:
    with mutex(name) as lock:
        if name == "slow":
            assert gate.wait(10)
        return HttpResponse(PAGE.format(f"fence {lock.fence}"))


def lose(request: HttpRequest) -> HttpResponse:
    """Take "ledger", have it reset under the block, and carry on."""
    try:
        with mutex("ledger", watchdog=False) as lock:
            fence = lock.fence
            assert reset("ledger")
    except LockLost:
        pass
    return HttpResponse(PAGE.format(f"fence {fence}"))


def unreachable(request: HttpRequest) -> HttpResponse:
    try:
        with mutex("ledger", using="down"):
            pass
    except LockBackendUnavailable:
        pass
    return HttpResponse(PAGE.format("Redis is down"))


def read(request: HttpRequest) -> HttpResponse:
    """Read "catalog" shared, then find "ledger" held exclusively by someone else."""
    with mutex("catalog", shared=True) as lock:
        fence = lock.fence
    try:
        with mutex("ledger", shared=True, timeout=0):
            pass
    except LockContended:
        pass
    return HttpResponse(PAGE.format(f"fence {fence}"))


def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse(PAGE.format("no lock here"))


async def alocked(request: HttpRequest, name: str) -> HttpResponse:
    async with mutex(name) as lock:
        return HttpResponse(PAGE.format(f"fence {lock.fence}"))


@pytest.fixture
def toolbar() -> Iterator[None]:
    """The debug toolbar with only the Locks panel, shown on every request of this module."""
    with override_settings(
        INSTALLED_APPS=[*settings.INSTALLED_APPS, "debug_toolbar"],
        MIDDLEWARE=["debug_toolbar.middleware.DebugToolbarMiddleware", *settings.MIDDLEWARE],
        ROOT_URLCONF="tests.toolbar_urls",
        DEBUG_TOOLBAR_PANELS=["django_redis_mutex.panels.LocksPanel"],
        DEBUG_TOOLBAR_CONFIG={
            "SHOW_TOOLBAR_CALLBACK": f"{__name__}.show_toolbar",
            "IS_RUNNING_TESTS": False,
        },
    ):
        yield


def panel_rows(client: Client, response: HttpResponse) -> list[dict[str, str]]:
    """Fetch the Locks panel of ``response``'s request and return its table rows by header."""
    match = re.search(r'data-request-id="([0-9a-f]+)"', response.content.decode())
    assert match, "the toolbar was not inserted in the page"
    rendered = client.get(
        "/__debug__/render_panel/", {"request_id": match.group(1), "panel_id": "LocksPanel"}
    )
    assert rendered.status_code == 200
    content = rendered.json()["content"]
    [table] = re.findall(r'<table class="djdt-locks">(.*?)</table>', content, re.S)
    headers = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", table)]
    rows = []
    for row in re.findall(r"<tr class=\"djdt-lock-\w+\">(.*?)</tr>", table, re.S):
        cells = [
            html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        rows.append(dict(zip(headers, cells, strict=True)))
    return rows


def milliseconds(cell: str) -> float:
    assert cell.endswith(" ms"), cell
    return float(cell.removesuffix(" ms"))


def fence_of(response: HttpResponse) -> str:
    match = re.search(r"fence (\d+)", response.content.decode())
    assert match
    return match.group(1)


def panel_receivers() -> int:
    return sum(
        key[0] == "django_redis_mutex.panels"
        for signal in (signals.lock_acquired, signals.lock_released, signals.lock_contended)
        for key, *_ in signal.receivers
    )


def hold_in_thread(name: str) -> Mutex:
    """Take ``name`` from another thread (another owner) and return its handle."""
    lock = Mutex(name)
    taker = threading.Thread(target=lock.acquire, kwargs={"blocking": False})
    taker.start()
    taker.join()
    assert lock.owned()
    return lock


def test_the_panel_lists_name_fence_wait_and_contention(toolbar: None) -> None:
    holder = Mutex("inventory")
    assert holder.acquire()
    busy = hold_in_thread("report")

    def release_once_queued() -> None:
        wait_until(
            lambda: [lock.waiters for lock in held_locks() if lock.name == "inventory"] == [1]
        )
        # Keep the request queued a while longer, so its wait is clearly more than a round trip.
        threading.Event().wait(0.1)
        holder.release()

    releaser = threading.Thread(target=release_once_queued)
    releaser.start()
    client = Client()
    response = client.get("/reserve/")
    releaser.join(5)
    busy.release()
    assert response.status_code == 200

    # The side bar sums the request up.
    assert re.search(r"2 locks, 1 contended, \d+\.\d ms waiting", response.content.decode())
    inventory, report = panel_rows(client, response)
    # The holder's release, sent from another thread during the request, is not the request's.
    assert inventory["Lock"] == "inventory"
    assert inventory["Outcome"] == "acquired"
    assert inventory["Fence"] == fence_of(response)
    assert milliseconds(inventory["Waited"]) >= 100
    assert 0 <= milliseconds(inventory["Held"]) < milliseconds(inventory["Waited"])
    assert report["Lock"] == "report"
    assert report["Outcome"] == "contended"
    assert report["Fence"] == ""
    assert "retry after" in report["Detail"]
    assert panel_receivers() == 0


def test_the_panel_says_which_acquisitions_were_shared(toolbar: None) -> None:
    busy = hold_in_thread("ledger")
    client = Client()
    try:
        response = client.get("/read/")
    finally:
        busy.release()
    catalog, ledger = panel_rows(client, response)
    assert (catalog["Outcome"], catalog["Detail"]) == ("acquired", "shared")
    assert catalog["Fence"] == fence_of(response)
    assert ledger["Outcome"] == "contended"
    assert ledger["Detail"].startswith("shared; held by")


def test_concurrent_requests_each_see_only_their_own_locks(toolbar: None) -> None:
    gate.clear()
    client = Client()
    slow: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: slow.update(response=client.get("/locked/slow/")))
    thread.start()
    wait_until(lambda: [lock.name for lock in held_locks()] == ["slow"])
    fast = Client().get("/locked/fast/")
    gate.set()
    thread.join(10)

    [fast_row] = panel_rows(client, fast)
    [slow_row] = panel_rows(client, slow["response"])
    assert (fast_row["Lock"], fast_row["Fence"]) == ("fast", fence_of(fast))
    assert (slow_row["Lock"], slow_row["Fence"]) == ("slow", fence_of(slow["response"]))
    assert panel_receivers() == 0


def test_an_async_view_under_asgi_is_recorded(toolbar: None) -> None:
    started = time.monotonic()
    response = asyncio.run(AsyncClient().get("/async-locked/ledger/"))
    elapsed = (time.monotonic() - started) * 1000
    assert response.status_code == 200
    [row] = panel_rows(Client(), response)
    assert (row["Lock"], row["Outcome"], row["Fence"]) == ("ledger", "acquired", fence_of(response))
    assert 0 <= milliseconds(row["Waited"]) <= elapsed


def test_a_lock_lost_while_the_block_ran_is_marked_lost(toolbar: None) -> None:
    client = Client()
    response = client.get("/lose/")
    [row] = panel_rows(client, response)
    assert (row["Lock"], row["Fence"]) == ("ledger", fence_of(response))
    assert row["Outcome"] == "acquired, lost"
    assert milliseconds(row["Held"]) >= 0


def test_an_unreachable_redis_is_listed(toolbar: None) -> None:
    caches = copy.deepcopy(settings.CACHES)
    caches["down"] = {**caches["default"], "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}
    client = Client()
    with override_settings(CACHES=caches):
        response = client.get("/unreachable/")
    [row] = panel_rows(client, response)
    assert (row["Lock"], row["Cache"], row["Outcome"]) == ("ledger", "down", "Redis unavailable")
    assert "unavailable" in row["Detail"]
    assert (row["Fence"], row["Held"]) == ("", "")


def test_a_request_without_locks_says_so(toolbar: None) -> None:
    client = Client()
    response = client.get("/plain/")
    request_id = re.search(r'data-request-id="([0-9a-f]+)"', response.content.decode())
    assert request_id
    rendered = client.get(
        "/__debug__/render_panel/", {"request_id": request_id.group(1), "panel_id": "LocksPanel"}
    )
    assert "This request took no lock." in rendered.json()["content"]


@pytest.mark.django_db(transaction=True)
def test_a_lock_kept_for_its_transaction_says_so_in_the_panel(toolbar: None) -> None:
    client = Client()
    response = client.get("/in-transaction/")
    assert response.status_code == 200
    [row] = panel_rows(client, response)
    assert row["Outcome"] == "acquired"
    assert "kept until its transaction on default ended" in row["Detail"]
