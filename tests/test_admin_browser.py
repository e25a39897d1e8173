"""The Locks admin page in a real browser: Debian's chromium, headless, driven by Playwright.

The browser is the system one at /usr/bin/chromium (``.ci/run`` installs it);
Playwright never downloads one. Playwright's sync API keeps an event loop
running on the test's thread while it is open, and Django refuses ORM calls
under a running loop, so each test touches the ORM and its locks only before
the browser starts or after it closed; the pages are served by ``live_server``
in its own thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.db import connection, transaction

from django_redis_mutex import (
    LockLost,
    LockNotOwned,
    Mutex,
    Semaphore,
    held_locks,
    holds,
    mutex,
)

from .helpers import ROOT, held_shared

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LIST_URL = "/admin/django_redis_mutex/lock/"
# The narrowest desktop the page is laid out for, with the admin sidebar open.
NARROW_VIEWPORT = {"width": 1280, "height": 800}
# The docs' picture of the page (docs/operations.rst) and what it shows, in
# words a test can compare: rewritten only when asked, so a test run leaves the
# tree clean.
DOCS_SCREENSHOT = ROOT / "docs" / "admin-locks.png"
DOCS_SCREENSHOT_CONTENTS = ROOT / "docs" / "admin-locks.txt"
REGENERATE = "UPDATE_SCREENSHOTS=1 uv run pytest tests/test_admin_browser.py -k docs_screenshot"
PASSWORD = "browser-test"


@pytest.fixture
def playwright_api() -> Any:
    """Return playwright.sync_api, or skip when no chromium can be had here."""
    if not CHROMIUM.exists():
        pytest.skip(
            f"No chromium at {CHROMIUM}: install Debian's (apt-get install -y chromium); "
            ".ci/run does so on a fresh machine."
        )
    return pytest.importorskip("playwright.sync_api")


@pytest.fixture
def admin_user(transactional_db, django_user_model) -> str:
    """Create a superuser who logs in through the form; return its username."""
    django_user_model.objects.create_superuser("admin", "admin@example.com", PASSWORD)
    return "admin"


@pytest.fixture
def hold() -> Iterator[Any]:
    """Return a function taking a lock (no watchdog); release what is still ours at the end."""
    taken: list[Mutex] = []

    def take(name: str, label: str) -> Mutex:
        lock = Mutex(name, label=label, ttl=120, watchdog=False)
        assert lock.acquire(blocking=False)
        taken.append(lock)
        return lock

    yield take
    for lock in taken:
        if lock.owned():
            lock.release()


@contextmanager
def logged_in_page(
    api: Any, base_url: str, username: str, *, javascript: bool = True
) -> Iterator[Any]:
    """Open headless chromium, log in to the admin and yield a page on the Locks list."""
    with api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(
                viewport={"width": 1400, "height": 640}, java_script_enabled=javascript
            )
            page = context.new_page()
            page.goto(f"{base_url}/admin/login/?next={LIST_URL}")
            page.fill("#id_username", username)
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            api.expect(page.locator("h1")).to_have_text("Locks")
            yield page
        finally:
            browser.close()


def test_superuser_releases_selected_lock_in_browser(
    tmp_path, playwright_api, live_server, admin_user, hold
):
    expect = playwright_api.expect
    hold("exports:nightly", "nightly export")
    kept = hold("billing:invoices", "monthly invoicing")
    screenshot = tmp_path / "admin-locks.png"

    with logged_in_page(playwright_api, live_server.url, admin_user) as page:
        stale = page.locator('tr[data-lock="exports:nightly"]')
        expect(stale).to_contain_text("nightly export")
        expect(page.locator('tr[data-lock="billing:invoices"]')).to_contain_text(
            "monthly invoicing"
        )
        expect(page.locator("#select-all-locks")).to_be_visible()  # locks.js was served
        page.screenshot(path=str(screenshot))

        stale.locator("input.action-select").check()
        page.click("#release-selected")
        expect(page.locator("#release-list li")).to_have_count(1)
        expect(page.locator("#release-list")).to_contain_text("exports:nightly")
        page.click("#confirm-release")

        expect(page.locator("ul.messagelist")).to_contain_text("Released 1 lock.")
        expect(stale).to_have_count(0)
        expect(page.locator('tr[data-lock="billing:invoices"]')).to_have_count(1)

    assert not Mutex("exports:nightly").locked()
    assert kept.owned()
    entry = LogEntry.objects.get()
    assert (entry.object_repr, entry.action_flag) == ("exports:nightly", DELETION)
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank


def test_release_link_works_without_javascript(playwright_api, live_server, admin_user, hold):
    expect = playwright_api.expect
    hold("imports:daily", "daily import")

    with logged_in_page(playwright_api, live_server.url, admin_user, javascript=False) as page:
        expect(page.locator("#select-all-locks")).to_be_hidden()  # no script ran
        page.locator('tr[data-lock="imports:daily"] a.deletelink').click()
        expect(page.locator("#release-list")).to_contain_text("daily import")
        page.click("#confirm-release")
        expect(page.locator("ul.messagelist")).to_contain_text("Released 1 lock.")
        expect(page.locator("#no-locks")).to_contain_text("No lock is held")

    assert not Mutex("imports:daily").locked()


def test_pause_button_says_paused_once_an_error_has_paused_the_refresh(
    playwright_api, live_server, admin_user
):
    expect = playwright_api.expect
    with logged_in_page(playwright_api, live_server.url, admin_user) as page:
        expect(page.locator("#pause-refresh")).to_have_text("Pause auto-refresh")
        page.goto(f"{live_server.url}{LIST_URL}?pid=x")  # a filter that cannot be used
        expect(page.locator(".refresh-state")).to_contain_text("Auto-refresh is paused")
        expect(page.locator("#pause-refresh")).to_have_count(0)
        expect(page.locator(".object-tools")).to_have_text("Auto-refresh paused")
        expect(page.locator(".object-tools a[href]")).to_have_count(0)


def test_release_of_one_hosts_locks_keeps_the_other_hosts_lock(
    playwright_api, live_server, admin_user, hold_on_host
):
    expect = playwright_api.expect
    web1 = hold_on_host("cache:web1", "web1", label="deploy")
    web2 = hold_on_host("cache:web2", "web2", label="deploy")

    with logged_in_page(playwright_api, live_server.url, admin_user) as page:
        expect(page.locator("tr.lock-row")).to_have_count(2)
        page.fill("#filter-host", "web1")
        page.click("#apply-filters")
        expect(page.locator("tr.lock-row")).to_have_count(1)
        expect(page.locator('tr[data-lock="cache:web1"] td.field-host')).to_have_text("web1")

        page.check("#select-all-locks")  # everything listed: web1's locks only
        page.click("#release-selected")
        expect(page.locator("#release-list li")).to_have_count(1)
        expect(page.locator("#release-list")).to_contain_text("cache:web1")
        expect(page.locator("#release-filter")).to_contain_text("host 'web1'")
        page.click("#confirm-release")

        expect(page.locator("ul.messagelist")).to_contain_text("Released 1 lock.")
        expect(page.locator("#filter-host")).to_have_value("web1")  # back on the filtered list
        expect(page.locator("#no-locks")).to_contain_text("No held lock matches this filter.")

    assert [held.name for held in held_locks()] == ["cache:web2"]
    assert web1.let_go() == "lost"
    assert web2.let_go() == "released"
    assert LogEntry.objects.get().object_repr == "cache:web1"


def test_shared_lock_lists_every_holder_and_its_release_frees_them_all(
    playwright_api, live_server, admin_user
):
    expect = playwright_api.expect
    labels = ("nightly export of every tenant's invoices", "hourly csv export")
    with held_shared("reports:monthly", *labels) as handles:
        fences = [handle.fence for handle in handles]
        with logged_in_page(playwright_api, live_server.url, admin_user) as page:
            page.set_viewport_size(NARROW_VIEWPORT)
            rows = page.locator('tr[data-lock="reports:monthly"]')
            expect(rows).to_have_count(2)  # one row per holder
            expect(rows.first.locator(".lock-mode")).to_have_text("shared, 2 holders")
            for row, label, thread, fence in zip(
                (rows.nth(0), rows.nth(1)), labels, ("reader-1", "reader-2"), fences, strict=True
            ):
                expect(row.locator("td.field-label")).to_have_text(label)
                expect(row.locator("td.field-thread")).to_have_text(thread)
                expect(row.locator("td.field-pid")).to_have_text(str(os.getpid()))
                expect(row.locator("td.field-fence")).to_have_text(str(fence))
            results = page.locator("#changelist .results")
            scroll_width, client_width = results.evaluate("b => [b.scrollWidth, b.clientWidth]")
            assert scroll_width <= client_width, (scroll_width, client_width)

            rows.first.locator("a.deletelink").click()
            expect(page.locator("#release-list li.release-holder")).to_have_count(2)
            expect(page.locator("#release-list")).to_contain_text(labels[1])
            page.click("#confirm-release")

            expect(page.locator("ul.messagelist")).to_contain_text("Released 1 lock.")
            expect(rows).to_have_count(0)
            expect(page.locator("#no-locks")).to_contain_text("No lock is held")
        assert [handle.owned() for handle in handles] == [False, False]
        writer = Mutex("reports:monthly", watchdog=False)
        assert writer.acquire(blocking=False)  # both readers gone: a writer gets in
        writer.release()
    assert held_locks() == []


def test_a_lock_kept_for_its_transaction_says_so_until_the_commit_frees_it(
    playwright_api, live_server, admin_user
):
    # One tab's request (here a thread) has left its locked block but not yet
    # committed; the operator looks at the Locks page in the meantime.
    expect = playwright_api.expect
    inside, commit = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def request_in_a_transaction() -> None:
        try:
            with transaction.atomic():
                with mutex("orders:export", label="nightly export"):
                    pass
                inside.set()
                assert commit.wait(30)
        except BaseException as exc:  # reported below
            failures.append(exc)
        finally:
            inside.set()
            connection.close()

    worker = threading.Thread(target=request_in_a_transaction)
    worker.start()
    try:
        assert inside.wait(30) and not failures, failures
        with logged_in_page(playwright_api, live_server.url, admin_user) as page:
            row = page.locator('tr[data-lock="orders:export"]')
            expect(row.locator("td.field-label")).to_contain_text("nightly export")
            expect(row.locator(".lock-transaction")).to_have_text(
                "kept until its transaction on default ends"
            )
            commit.set()
            worker.join(30)
            page.reload()
            expect(page.locator('tr[data-lock="orders:export"]')).to_have_count(0)
    finally:
        commit.set()
        worker.join(30)
    assert not failures, failures


@pytest.fixture
def permit() -> Iterator[Any]:
    """Return a function taking one semaphore permit (no watchdog); give back what is left."""
    taken: list[Semaphore] = []

    def take(name: str, limit: int, label: str) -> Semaphore:
        handle = Semaphore(name, limit, label=label, ttl=120, watchdog=False)
        assert handle.acquire(blocking=False)
        taken.append(handle)
        return handle

    yield take
    for handle in taken:
        if handle.token is not None:
            with contextlib.suppress(LockLost, LockNotOwned):  # reset by the test
                handle.release()


def test_superuser_resets_a_semaphore_in_browser(playwright_api, live_server, admin_user, permit):
    expect = playwright_api.expect
    holder = permit("exports:pool", 1, "nightly export")
    assert not Semaphore("exports:pool", 1).acquire(blocking=False)  # the one permit is taken

    with logged_in_page(playwright_api, live_server.url, admin_user) as page:
        row = page.locator('tr.semaphore-row[data-semaphore="exports:pool"]')
        expect(row.locator("td.field-label")).to_have_text("nightly export")
        expect(row.locator("td.field-pid")).to_have_text(str(os.getpid()))
        expect(row.locator("td.field-permits")).to_have_text("1 / 1")
        row.locator("a.reset-semaphore").click()

        expect(page.locator("#reset-list li.reset-item")).to_have_count(1)
        expect(page.locator("#reset-list")).to_contain_text("nightly export")
        page.click("#confirm-reset")

        expect(page.locator("ul.messagelist")).to_contain_text(
            "Reset semaphore “exports:pool”: freed 1 permit."
        )
        expect(page.locator("tr.semaphore-holder")).to_have_count(0)
        expect(page.locator("#no-semaphores")).to_contain_text("No semaphore has a permit held")

    fresh = permit("exports:pool", 1, "after the reset")  # the permit is free again
    assert fresh.token is not None
    with pytest.raises(LockNotOwned):
        holder.release()
    entry = LogEntry.objects.get()
    assert (entry.object_repr, entry.action_flag) == ("exports:pool", CHANGE)


def test_locks_and_semaphores_fit_1280_pixels(
    playwright_api, live_server, admin_user, hold, permit
):
    expect = playwright_api.expect
    hold("inventory:warehouse-7", "held on purpose by the nightly inventory reconciliation")
    for label in ("nightly export of every tenant's invoices", "hourly export"):
        permit("exports:tenant-invoices", 3, label)

    with logged_in_page(playwright_api, live_server.url, admin_user) as page:
        page.set_viewport_size(NARROW_VIEWPORT)
        expect(page.locator("#nav-sidebar")).to_be_visible()  # the sidebar takes its width
        expect(page.locator("tr.semaphore-holder")).to_have_count(2)
        right_edge = NARROW_VIEWPORT["width"]
        for box_selector in ("#changelist .results", "#semaphores .semaphore-results"):
            box = page.locator(box_selector)  # one of each: strict locators fail otherwise
            scroll_width, client_width = box.evaluate("b => [b.scrollWidth, b.clientWidth]")
            assert scroll_width <= client_width, (box_selector, scroll_width, client_width)
        for cell in ("a.reset-semaphore", "td.field-waiters", "td.field-time-left"):
            edge = page.locator(f"tr.semaphore-row {cell}").bounding_box()
            assert edge is not None, cell
            assert edge["x"] + edge["width"] <= right_edge, (cell, edge)
        assert page.evaluate("document.documentElement.scrollWidth") <= right_edge


def page_contents(page: Any) -> list[str]:
    """Describe the Locks page as a reader of its screenshot sees it: fields, columns, rows."""

    def texts(selector: str) -> str:
        found = page.locator(selector).evaluate_all("all => all.map(e => e.textContent.trim())")
        return " | ".join(text or "[checkbox]" for text in found)

    lines = [
        f"viewport: {NARROW_VIEWPORT['width']} px wide, the admin sidebar open",
        f"filters: {texts('#lock-filters label')}",
        f"lock columns: {texts('#result_list thead th')}",
    ]
    for row in page.locator("tr.lock-row").all():
        name = row.get_attribute("data-lock")
        holders = page.locator(f'tr.lock-holder[data-lock="{name}"]').count()
        mode = row.locator(".lock-mode")
        kind = mode.inner_text() if mode.count() else f"exclusive, {holders} holder"
        lines.append(f"lock row: {kind}")
    lines.append(f"semaphore columns: {texts('#semaphore_list thead th')}")
    for row in page.locator("tr.semaphore-row").all():
        name = row.get_attribute("data-semaphore")
        holders = page.locator(f'tr.semaphore-holder[data-semaphore="{name}"]').count()
        permits = row.locator("td.field-permits").inner_text()
        lines.append(f"semaphore row: {permits} permits held, {holders} holders")
    return lines


def png_line(path: Path) -> str:
    """Describe a PNG file by its size in pixels and its SHA-256."""
    data = path.read_bytes()
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return f"png: {width} x {height} px, sha256 {hashlib.sha256(data).hexdigest()}"


def test_docs_screenshot_shows_the_page_as_it_is(
    tmp_path, playwright_api, live_server, admin_user, hold, permit, monkeypatch
):
    """docs/admin-locks.png was taken of this page: the same fields, columns and kinds of row.

    The page holds one lock of each kind and a semaphore with permits held,
    each holder reporting a made-up host. docs/admin-locks.txt says what the
    picture shows; the live page must say the same, and the picture must be
    the one described there. With UPDATE_SCREENSHOTS=1 both are written anew.
    """
    expect = playwright_api.expect
    # Owner records as a worker's would read, not this machine's host name.
    monkeypatch.setattr(holds, "_hostname", lambda: "web1")
    monkeypatch.setattr(threading.current_thread(), "name", "worker-1")
    holds._owner_json.cache_clear()  # records made before carry the real names
    hold("billing:close", "monthly invoicing")
    for label in ("nightly export of every tenant's invoices", "hourly export"):
        permit("exports:pool", 3, label)
    update = bool(os.environ.get("UPDATE_SCREENSHOTS"))
    screenshot = DOCS_SCREENSHOT if update else tmp_path / "admin-locks.png"

    with (
        held_shared("reports:q2", "quarterly report", "sales dashboard"),
        logged_in_page(playwright_api, live_server.url, admin_user) as page,
    ):
        page.set_viewport_size({"width": NARROW_VIEWPORT["width"], "height": 1000})
        expect(page.locator("tr.lock-row")).to_have_count(2)
        expect(page.locator("tr.semaphore-holder")).to_have_count(2)
        expect(page.locator("#nav-sidebar")).to_be_visible()
        contents = page_contents(page)
        page.locator("#content").screenshot(path=str(screenshot), animations="disabled")
    holds._owner_json.cache_clear()

    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank
    if update:
        DOCS_SCREENSHOT_CONTENTS.write_text(
            "What docs/admin-locks.png shows: the admin Locks page as\n"
            "tests/test_admin_browser.py renders it, which checks that the live page\n"
            f"still shows the same. Regenerate both with\n{REGENERATE}\n\n"
            + "\n".join([*contents, png_line(screenshot)])
            + "\n"
        )
    assert DOCS_SCREENSHOT_CONTENTS.exists(), f"No docs/admin-locks.txt: {REGENERATE}"
    described = DOCS_SCREENSHOT_CONTENTS.read_text().split("\n\n", 1)[1].splitlines()
    assert described[:-1] == contents, (
        "The admin Locks page no longer looks like docs/admin-locks.png "
        f"(described in docs/admin-locks.txt). Regenerate both with\n{REGENERATE}"
    )
    assert described[-1] == png_line(DOCS_SCREENSHOT), (
        "docs/admin-locks.png is not the picture docs/admin-locks.txt describes. "
        f"Regenerate both with\n{REGENERATE}"
    )


def test_contention_page_charts_a_contended_lock_class(
    playwright_api, live_server, admin_user
) -> None:
    from django.test import override_settings

    from django_redis_mutex import stats

    from .helpers import caches_with
    from .test_stats import contend_in_threads

    expect = playwright_api.expect
    with override_settings(CACHES=caches_with(STATS=True)):
        contend_in_threads(1)
        contend_in_threads(2)
        stats.flush()
        with logged_in_page(playwright_api, live_server.url, admin_user) as page:
            page.click("#contention-link")
            expect(page.locator("h1")).to_have_text("Lock contention")
            row = page.locator('#contention_list tr[data-lock-class="product:{pk}"]')
            expect(row.locator(".field-acquired")).to_have_text("4")
            expect(row.locator(".field-waited")).to_have_text("2 (50%)")
            expect(row.locator(".field-contended")).to_have_text("2")
            series = page.locator('#contention-chart polyline[data-lock-class="product:{pk}"]')
            expect(series).to_have_count(1)
            # A real line, drawn with room on the page: not a point, not hidden.
            box = page.locator("#contention-chart svg").bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 100
            expect(
                page.locator('.contention-legend li[data-lock-class="product:{pk}"]')
            ).to_contain_text("4 contended acquisitions")
