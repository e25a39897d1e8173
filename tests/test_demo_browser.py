"""The demo project, run as a person runs it, driven by headless chromium.

``manage.py demo`` starts as a real subprocess with its own private
redis-server (no REDIS_URL), on a free port and in a data folder of its own;
the tests click through it in Debian's chromium via Playwright, talk to it
with ``manage.py locks`` as a second terminal would, and signal it the way a
terminal or a process manager does. See tests/demo_server.py.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from django_redis_mutex.testing import free_port

from .demo_server import Demo, pid_alive, wait_for
from .test_admin_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.browser

# Long enough that a second tab's reserve (2 s lock timeout) surely meets the
# held lock on a busy machine, short enough that the test waits it out.
HOLD_SECONDS = 10
VIEWPORT = {"width": 1280, "height": 800}
LOCKS_URL = "/admin/django_redis_mutex/lock/"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# How many lines a cell's text takes: one client rect per line box.
LINE_COUNT = """cell => {
    const range = document.createRange();
    range.selectNodeContents(cell);
    return new Set([...range.getClientRects()].map(rect => Math.round(rect.top))).size;
}"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """One demo for the module's browser tests; everything it started is killed after."""
    running = Demo(tmp_path_factory.mktemp("demo"), hold_seconds=HOLD_SECONDS)
    try:
        yield running.start()
    finally:
        running.kill_all()
    # Nothing of it is left: not the demo, its workers, nor its redis-server.
    wait_for(lambda: not running.processes(), 30, "every process of the demo to end")
    assert not pid_alive(running.redis_pid)
    assert not running.redis_folder.exists()


@pytest.fixture
def browser(playwright_api: Any) -> Iterator[Any]:
    """A headless chromium, closed at the end."""
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def playwright_api() -> Any:
    """Return playwright.sync_api, or skip when no chromium can be had here."""
    if not CHROMIUM.exists():
        pytest.skip(f"No chromium at {CHROMIUM}: install Debian's (apt-get install -y chromium).")
    return pytest.importorskip("playwright.sync_api")


def assert_png(path: Path) -> None:
    """A real screenshot: a non-empty PNG file."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000, path


def assert_no_traceback(output: str) -> None:
    """The demo's threads handled every lock error themselves."""
    assert "Traceback" not in output, output
    assert "Exception in thread" not in output, output


def reserve(page: Any) -> Any:
    """Reserve paper filters; return the reserve POST's response.

    Not product 1: the background workers take its lock too, which would
    make a 503 that has nothing to do with the inventory lock.
    """
    with page.expect_response(lambda r: "/reserve/" in r.url) as response:
        page.locator("tr", has_text="Paper filters").locator("button").click()
    return response.value


def test_second_tab_gets_503_while_the_inventory_lock_is_held(
    demo: Demo, browser: Any, playwright_api: Any, tmp_path: Path
) -> None:
    expect = playwright_api.expect
    context = browser.new_context(viewport=VIEWPORT)
    page_a = context.new_page()
    page_a.goto(demo.url + "/")
    page_a.locator("#hold-form button").click()
    expect(page_a.locator(".msg")).to_contain_text("Holding the inventory lock")
    expect(page_a.locator('tr[data-lock="inventory"]')).to_contain_text("held on purpose")
    expect(page_a.locator('tr[data-lock="inventory"] time')).to_contain_text("UTC")
    page_a.screenshot(path=str(tmp_path / "holding.png"))

    page_b = context.new_page()
    page_b.goto(demo.url + "/")
    refused = reserve(page_b)
    assert refused.status == 503
    # No hold of the class is known yet: the estimate is the holder's time so
    # far (a few seconds), never the 28 s left of the renewed 30 s lease.
    assert 1 <= int(refused.headers["retry-after"]) <= HOLD_SECONDS // 2
    expect(page_b.locator("h1")).to_have_text("Someone else is working on this right now")
    page_b.screenshot(path=str(tmp_path / "refused.png"))

    # The hold ends by itself after HOLD_SECONDS; then reserving works again.
    def released() -> bool:
        page_a.reload()
        count: int = page_a.locator('tr[data-lock="inventory"]').count()
        return count == 0

    wait_for(released, HOLD_SECONDS + 30, "the held inventory lock to be released", 0.5)
    page_b.goto(demo.url + "/")
    accepted = reserve(page_b)
    assert accepted.status == 302
    expect(page_b.locator(".msg.success")).to_contain_text("Reserved one")
    page_b.screenshot(path=str(tmp_path / "reserved.png"))

    # Held again: the lock now has a history of one HOLD_SECONDS hold, so a
    # refused reserve (after its 2 s wait) is told about what is left of it,
    # not the 28 s left of the watchdog-renewed 30 s lease.
    page_a.goto(demo.url + "/")
    page_a.locator("#hold-form button").click()
    expect(page_a.locator(".msg")).to_contain_text("Holding the inventory lock")
    page_b.goto(demo.url + "/")
    refused_again = reserve(page_b)
    assert refused_again.status == 503
    assert 3 <= int(refused_again.headers["retry-after"]) <= HOLD_SECONDS

    # The contention chart of the demo page draws the inventory class once flushed.
    def charted() -> bool:
        page_a.goto(demo.url + "/")
        return bool(
            page_a.locator('#contention-chart polyline[data-lock-class="inventory"]').count()
        )

    wait_for(charted, 60, "the demo page to chart the inventory lock's contention", 0.5)
    page_a.screenshot(path=str(tmp_path / "chart.png"))
    wait_for(released, HOLD_SECONDS + 30, "the second hold to be released", 0.5)
    context.close()

    for name in ("holding.png", "refused.png", "reserved.png", "chart.png"):
        assert_png(tmp_path / name)
    assert_no_traceback(demo.output())


def test_a_reservations_answer_stays_while_the_page_refreshes_its_figures(
    demo: Demo, browser: Any, playwright_api: Any
) -> None:
    """One visitor, two tabs: each tab keeps its own answer while its figures update in place.

    The page reads its stock and locks again every few seconds without
    reloading, so the answer to a click does not vanish, and that read never
    takes the message another tab of the same visitor is about to show.
    """
    expect = playwright_api.expect
    context = browser.new_context(viewport=VIEWPORT)
    try:
        tab_a, tab_b = context.new_page(), context.new_page()
        tab_a.goto(demo.url + "/")
        tab_b.goto(demo.url + "/")
        assert reserve(tab_a).status == 302
        expect(tab_a.locator(".msg.success")).to_contain_text("Reserved one Paper filters")
        answer_a = tab_a.locator(".msg.success").inner_text()
        left_after_a = int(answer_a.split("; ")[1].split()[0])
        # A mark that a reload of the tab would wipe.
        tab_a.evaluate("() => { window.notReloaded = true; }")

        assert reserve(tab_b).status == 302
        expect(tab_b.locator(".msg.success")).to_contain_text(
            f"Reserved one Paper filters; {left_after_a - 1} left."
        )
        # Tab A shows tab B's reservation in its stock by itself, in place,
        # and still shows its own answer.
        stock_a = tab_a.locator("#stock tr", has_text="Paper filters").locator("td").nth(1)
        expect(stock_a).to_have_text(str(left_after_a - 1), timeout=30_000)
        assert tab_a.evaluate("() => window.notReloaded === true")
        assert tab_a.locator(".msg.success").inner_text() == answer_a
        assert tab_b.locator(".msg.success").count() == 1
    finally:
        context.close()
    assert_no_traceback(demo.output())


def _stock_of(page: Any, product: str) -> int:
    page.goto(page.url.split("?")[0])
    return int(page.locator("tr", has_text=product).locator("td").nth(1).inner_text())


def _answer_on(page: Any, playwright_api: Any) -> str | None:
    """The text of the answer ``page`` shows to its Reserve click, or None while it has none.

    The answer is a message on the inventory page (reserved, or too few
    left) or the 503 page. The inventory page without a message is the page
    before its click navigated: its answer is still to come.
    """
    try:
        if page.locator("p.msg").count() or (
            "/reserve/" in page.url and page.locator("h1").count()
        ):
            return str(page.locator("body").inner_text())
    except playwright_api.Error:
        return None  # the page navigated while being read: look again
    return None


def test_concurrent_reserve_clicks_never_oversell(
    demo: Demo, browser: Any, playwright_api: Any
) -> None:
    """Tabs of several visitors click Reserve on the same product at once (ATOMIC_REQUESTS on).

    Every accepted reservation took one unit and no unit went twice: the
    stock falls by exactly the number of "Reserved one" answers and never
    below zero. Without the lock kept until each request's COMMIT, two
    requests would read the same stock and one reservation would be lost.
    """
    contexts = [browser.new_context(viewport=VIEWPORT) for _ in range(7)]
    try:
        pages = [context.new_page() for context in contexts]
        for page in pages:
            page.goto(demo.url + "/")
        before = _stock_of(pages[0], "Grinder")
        # Clicked without waiting, so every tab's request is in flight at once.
        for page in pages:
            page.locator("tr", has_text="Grinder").locator("button").evaluate(
                "button => button.click()"
            )
        # Every tab is watched in turn, so a slow answer holds up no other.
        answers: dict[int, str] = {}

        def every_answer() -> bool:
            for index, page in enumerate(pages):
                if index not in answers and (answer := _answer_on(page, playwright_api)):
                    answers[index] = answer
            return len(answers) == len(pages)

        wait_for(every_answer, 60, "every tab's reservation answer", 0.05)
        reserved = sum("Reserved one Grinder" in answer for answer in answers.values())
        after = _stock_of(pages[0], "Grinder")
        assert after >= 0
        assert before - after == reserved, answers
        assert reserved >= 1, answers
    finally:
        for context in contexts:
            context.close()
    assert_no_traceback(demo.output())


def test_locks_command_in_a_second_terminal_finds_the_demo_redis(demo: Demo) -> None:
    assert (demo.data_dir / "redis-url").read_text().strip() == demo.redis_url
    locks = wait_for(
        lambda: [lock for lock in demo.held_locks() if "demo worker" in lock["owner"]["label"]],
        60,
        "manage.py locks --json to list a demo worker's lock",
    )
    worker_locks = {"report:nightly", "sync:crm", "export:catalog", "billing:run"}
    assert {lock["name"] for lock in locks} <= worker_locks


def test_reset_all_leaves_the_hold_thread_and_workers_running(
    demo: Demo, browser: Any, playwright_api: Any
) -> None:
    expect = playwright_api.expect
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.goto(demo.url + "/")
    page.locator("#hold-form button").click()
    expect(page.locator(".msg")).to_contain_text("Holding the inventory lock")

    reset_at = time.time()
    result = demo.manage("locks", "--reset-all", "--noinput")
    assert result.returncode == 0, result.stderr
    assert "Released" in result.stdout

    # Every worker thread takes demo locks again after the reset.
    seen: set[str] = set()

    def every_worker_acquired_again() -> bool:
        for lock in demo.held_locks():
            acquired = datetime.fromisoformat(lock["acquired_at"]).timestamp()
            if "demo worker" in lock["owner"]["label"] and acquired > reset_at:
                seen.add(lock["owner"]["label"])
        return len(seen) == 3

    wait_for(every_worker_acquired_again, 60, f"all 3 workers to acquire again (saw {seen})")
    # The hold thread meets its reset lock at the end of the hold, and says so.
    wait_for(
        lambda: "already gone at release" in demo.output(),
        HOLD_SECONDS + 30,
        "the hold thread to report its lock gone",
    )
    # The workers hold their locks for moments at a time, so a page may catch
    # none held: load it again until it shows one.
    fresh = page.context.new_page()

    def a_worker_hold_is_shown() -> bool:
        fresh.goto(demo.url + "/")
        owners = fresh.locator("tr[data-lock] td:nth-child(2)").all_inner_texts()
        return any("demo worker" in owner for owner in owners)

    wait_for(a_worker_hold_is_shown, 60, "a fresh page to show a demo worker's hold", 0.5)
    assert_no_traceback(demo.output())


def test_admin_locks_table_fits_1280_pixels(
    demo: Demo, browser: Any, playwright_api: Any, tmp_path: Path
) -> None:
    expect = playwright_api.expect
    page = browser.new_context(viewport=VIEWPORT).new_page()
    # The held inventory lock has the widest row: a request thread and a long label.
    page.goto(demo.url + "/")
    page.locator("#hold-form button").click()
    page.goto(f"{demo.url}/admin/login/?next={LOCKS_URL}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "admin")
    page.click("input[type=submit]")
    expect(page.locator("h1")).to_have_text("Locks")
    expect(page.locator("#nav-sidebar")).to_be_visible()  # the sidebar takes its width

    def first_row_is_listed() -> bool:
        if page.locator("tr.lock-row").count():
            return True
        page.reload()
        return False

    wait_for(first_row_is_listed, 60, "a worker's lock in the admin list", 0.5)
    held = page.locator('tr[data-lock="inventory"]')
    expect(held).to_contain_text("held on purpose")
    page.screenshot(path=str(tmp_path / "admin-locks.png"))
    # The table scrolls inside its box rather than widening the page, so
    # "fits" means: nothing to scroll there, and every cell ends inside it.
    results = page.locator("#changelist .results")
    scroll_width, client_width = results.evaluate("r => [r.scrollWidth, r.clientWidth]")
    assert scroll_width <= client_width, (scroll_width, client_width)
    results_box = results.bounding_box()
    assert results_box is not None
    right_edge = min(results_box["x"] + results_box["width"], VIEWPORT["width"])
    for row in (page.locator("tr.lock-row").first, held):
        for cell in ("input.action-select", "a.deletelink", "td.field-waiters"):
            box = row.locator(cell).bounding_box()
            assert box is not None, cell
            assert box["x"] + box["width"] <= right_edge, (cell, box, right_edge)
        # A label wraps onto two lines at most, not a word or two a line.
        lines = row.locator("td.field-label").evaluate(LINE_COUNT)
        assert 1 <= lines <= 2, (row.locator("td.field-label").inner_text(), lines)
    assert_png(tmp_path / "admin-locks.png")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_demo_stops_its_redis_server_on_signal(tmp_path: Path, signum: int) -> None:
    demo = Demo(tmp_path / "demo")
    try:
        demo.start()
        assert demo.redis_pid and pid_alive(demo.redis_pid)
        assert demo.redis_folder.is_dir()
        assert (demo.data_dir / "redis-url").exists()
        started = demo.processes()
        assert demo.redis_pid in started and len(started) >= 3  # demo, redis, workers

        status = demo.signal(signum)

        assert status == 128 + signum, demo.output()
        wait_for(lambda: not demo.processes(), 30, f"every demo process to end: {started}")
        assert not pid_alive(demo.redis_pid)
        assert not demo.redis_folder.exists()
        assert not (demo.data_dir / "redis-url").exists()
        assert "Stopped the private Redis." in demo.output()
        assert_no_traceback(demo.output())
    finally:
        demo.kill_all()


def test_demo_removes_the_redis_folder_a_killed_demo_left_and_no_other(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"  # the demos' temporary folders go here, and only theirs
    temp.mkdir()
    # Not for a demo to remove: a folder no demo marked (a test server's), and
    # a marked one whose process still runs.
    unmarked = temp / "django-redis-mutex-redis-unmarked"
    unmarked.mkdir()
    live = temp / "django-redis-mutex-redis-live"
    live.mkdir()
    (live / "demo-pids").write_text(f"{os.getpid()}\n")
    killed = Demo(tmp_path / "killed", TMPDIR=str(temp))
    second = Demo(tmp_path / "second", TMPDIR=str(temp))
    try:
        killed.start()
        assert killed.redis_folder.parent == temp

        assert killed.signal(signal.SIGKILL) == -signal.SIGKILL
        wait_for(lambda: not pid_alive(killed.redis_pid), 30, "the killed demo's redis-server")
        assert killed.redis_folder.is_dir()  # no cleanup ran

        second.start()

        assert not killed.redis_folder.exists()
        assert f"Removed {killed.redis_folder}, left by a demo that was killed." in second.output()
        assert second.redis_folder.is_dir()
        assert unmarked.is_dir()
        assert live.is_dir()
    finally:
        killed.kill_all()
        second.kill_all()


def test_redis_down_reads_as_plain_words(tmp_path: Path, browser: Any, playwright_api: Any) -> None:
    expect = playwright_api.expect
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    demo = Demo(tmp_path / "demo", REDIS_URL=dead)
    try:
        demo.start()
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.goto(demo.url + "/")
        error = page.locator("#redis-error")
        expect(error).to_contain_text("cannot be reached right now")
        expect(error).to_contain_text(dead.split("/")[2])  # host:port, not a lock name
        assert "'*'" not in error.inner_text()

        page.goto(f"{demo.url}/admin/login/?next={LOCKS_URL}")
        page.fill("#id_username", "admin")
        page.fill("#id_password", "admin")
        page.click("input[type=submit]")
        expect(page.locator("#lock-error")).to_be_visible()
        expect(page.locator(".refresh-state")).to_contain_text("could not be read")
        expect(page.locator(".refresh-state")).not_to_contain_text("read from Redis")

        # The workers keep trying, one line per failure, until Redis is back.
        wait_for(lambda: demo.output().count("Retrying in") >= 3, 60, "the workers to retry")
        assert_no_traceback(demo.output())
    finally:
        demo.kill_all()


def test_a_demo_on_a_busy_address_says_so_before_starting_anything(tmp_path: Path) -> None:
    # runserver would find out only after the private Redis had started, and
    # leave with os._exit(), leaving the demo's Redis folder and URL file.
    demo = Demo(tmp_path / "demo")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", demo.port))
        other.listen()

        result = demo.manage("demo", f"127.0.0.1:{demo.port}")

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"CommandError: 127.0.0.1:{demo.port} is already in use: stop what serves there, or "
        "give the demo another address, e.g. `uv run manage.py demo 127.0.0.1:8001`."
    ]
    assert not (demo.data_dir / "redis-url").exists()


def test_the_test_harness_moves_a_demo_whose_picked_port_was_taken(tmp_path: Path) -> None:
    demo = Demo(tmp_path / "demo", hold_seconds=HOLD_SECONDS)
    picked = demo.port
    try:
        # Bound, as an outgoing connection's port is: connections to it are refused.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            other.bind(("127.0.0.1", picked))
            demo.start()
        assert demo.port != picked
        assert demo.url.endswith(f":{demo.port}")
        assert demo.redis_pid and pid_alive(demo.redis_pid)
    finally:
        demo.kill_all()


def test_locks_command_without_a_running_demo_never_uses_6379(tmp_path: Path) -> None:
    demo = Demo(tmp_path / "demo")
    demo.data_dir.mkdir()

    result = demo.manage("locks", "--json")

    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "CommandError: The demo is not running, so there is no Redis to read: start it with "
        "`uv run manage.py demo` (or set REDIS_URL to read another Redis)."
    ]


def test_locks_command_with_a_stale_demo_url_says_the_demo_is_not_running(tmp_path: Path) -> None:
    # A URL file left by a SIGKILLed demo, whose Redis is gone: stale.
    demo = Demo(tmp_path / "demo")
    demo.data_dir.mkdir()
    gone = f"redis://127.0.0.1:{free_port()}/0"
    (demo.data_dir / "redis-url").write_text(gone + "\n")

    result = demo.manage("locks")

    assert result.returncode == 1
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"CommandError: The demo is not running: nothing answers at {gone}, ")
    assert "`uv run manage.py demo`" in line
    assert "6379" not in line
