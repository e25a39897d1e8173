"""The admin's Locks page: live from Redis, guarded by permissions, releases with history."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
from django.conf import settings
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client, override_settings

from django_redis_mutex import LockLost, LockNotOwned, Mutex, Semaphore, held_semaphores, mutex
from django_redis_mutex.models import Lock
from django_redis_mutex.models import Semaphore as SemaphoreModel
from django_redis_mutex.testing import free_port

from .helpers import ROOT, held_shared, wait_until

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/django_redis_mutex/lock/"
RELEASE_URL = LIST_URL + "release/"
RESET_SEMAPHORE_URL = LIST_URL + "reset-semaphore/"


def _login(django_user_model, *codenames: str, csrf: bool = False) -> Client:
    """Return a client logged in as a staff user holding the given permissions of this app."""
    user = django_user_model.objects.create_user(
        username="staff-" + "-".join(codenames), is_staff=True
    )  # no password: no slow hashing
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_redis_mutex", codename__in=codenames
        )
    )
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


@pytest.fixture
def superuser(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password=None))
    return client


@pytest.fixture
def viewer(django_user_model) -> Client:
    return _login(django_user_model, "view_lock")


@pytest.fixture
def releaser(django_user_model) -> Client:
    return _login(django_user_model, "view_lock", "release_lock", csrf=True)


@pytest.fixture
def resetter(django_user_model) -> Client:
    return _login(django_user_model, "view_lock", "reset_semaphore", csrf=True)


@pytest.fixture
def hold() -> Iterator[Callable[..., Mutex]]:
    """Return a function taking a lock for a test that may force-release it.

    No watchdog, so nothing renews a lock the test released behind its holder's
    back; whatever is still ours at the end is released.
    """
    taken: list[Mutex] = []

    def take(lock_name: str, **options: object) -> Mutex:
        lock = Mutex(lock_name, watchdog=False, ttl=60, **options)
        assert lock.acquire(blocking=False)
        taken.append(lock)
        return lock

    yield take
    for lock in taken:
        if lock.owned():
            lock.release()


def _rows(response) -> dict[str, dict]:
    return {row["name"]: row for row in response.context["locks"]}


def _csrf_token(html: str) -> str:
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert found, "the confirmation page has no CSRF token"
    return found.group(1)


# -- who may look --------------------------------------------------------------


def test_anonymous_user_is_sent_to_admin_login(client):
    response = client.get(LIST_URL)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=")


def test_staff_without_view_permission_is_forbidden(django_user_model):
    staff = _login(django_user_model)
    with mutex("secret-job"):
        response = staff.get(LIST_URL)
    assert response.status_code == 403
    assert b"secret-job" not in response.content


def test_admin_index_links_to_locks_page(superuser):
    response = superuser.get("/admin/")
    assert response.status_code == 200
    assert f'href="{LIST_URL}"'.encode() in response.content


def test_locks_cannot_be_added_through_admin(superuser):
    assert superuser.get(LIST_URL + "add/").status_code == 404


# -- what the list shows -------------------------------------------------------


def test_viewer_sees_held_lock_with_owner_label(viewer):
    with mutex("reports:nightly", label="nightly report") as lock:
        fence = lock.fence
        response = viewer.get(LIST_URL)
    assert response.status_code == 200
    row = _rows(response)["reports:nightly"]
    assert row["label"] == "nightly report"
    assert row["pid"] == os.getpid()
    assert row["fence"] == fence
    assert b"nightly report" in response.content


HOLDER = """
import sys
import django
django.setup()
from django_redis_mutex import mutex
with mutex(sys.argv[1], label="worker process"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def held_by_subprocess() -> Iterator[tuple[str, int]]:
    """Hold lock "imports" in a real OS process until the test ends."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "imports"],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().strip() == "held"
    yield "imports", proc.pid
    proc.communicate("done\n", timeout=30)
    assert proc.returncode == 0


def test_lock_held_by_another_process_shows_its_pid(viewer, held_by_subprocess):
    name, pid = held_by_subprocess
    row = _rows(viewer.get(LIST_URL))[name]
    assert row["pid"] == pid != os.getpid()
    assert row["label"] == "worker process"


def test_search_shows_only_matching_names(viewer):
    with mutex("orders:17"), mutex("reports:daily"):
        response = viewer.get(LIST_URL, {"q": "ORDERS"})
    assert list(_rows(response)) == ["orders:17"]
    assert response.context["total"] == 2
    assert b"reports:daily" not in response.content


def test_page_refreshes_itself_unless_paused(viewer):
    live = viewer.get(LIST_URL)
    paused = viewer.get(LIST_URL, {"refresh": "0"})
    assert b'http-equiv="refresh"' in live.content
    assert b'http-equiv="refresh"' not in paused.content
    assert b"Resume auto-refresh" in paused.content


# -- cache aliases ---------------------------------------------------------------


@pytest.fixture
def second_alias(mutex_prefix: str) -> Iterator[str]:
    """Add cache alias "locks" on the same server with its own lock namespace, and a LocMem one."""
    caches = copy.deepcopy(settings.CACHES)
    caches["locks"] = {
        **copy.deepcopy(caches["default"]),
        "MUTEX": {"PREFIX": mutex_prefix + "-second"},
    }
    caches["local"] = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    with override_settings(CACHES=caches):
        yield "locks"


def test_alias_selector_offers_only_redis_caches(viewer, second_alias):
    response = viewer.get(LIST_URL)
    assert response.context["aliases"] == ["default", "locks"]
    assert b'id="alias-selector"' in response.content


def test_using_shows_locks_of_chosen_alias(viewer, second_alias):
    with mutex("in-second", using=second_alias), mutex("in-default"):
        second = viewer.get(LIST_URL, {"using": second_alias})
        default = viewer.get(LIST_URL)
    assert list(_rows(second)) == ["in-second"]
    assert list(_rows(default)) == ["in-default"]


def test_unknown_alias_is_explained_not_a_server_error(viewer, second_alias):
    for alias in ("nope", "local"):
        response = viewer.get(LIST_URL, {"using": alias})
        assert response.status_code == 404
        assert f"Cache alias “{alias}” does not carry locks".encode() in response.content
        assert b"default, locks" in response.content


def test_lock_names_are_escaped_in_the_page(viewer):
    with mutex("<script>alert(1)</script>", label="<b>label</b>"):
        response = viewer.get(LIST_URL)
    assert b"<script>alert(1)</script>" not in response.content
    assert b"&lt;script&gt;alert(1)&lt;/script&gt;" in response.content
    assert b"&lt;b&gt;label&lt;/b&gt;" in response.content


# -- Redis down --------------------------------------------------------------------


@pytest.fixture
def redis_down() -> Iterator[None]:
    """Point the default cache at a port nothing listens on."""
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["LOCATION"] = f"redis://127.0.0.1:{free_port()}/0"
    with override_settings(CACHES=caches):
        yield


def test_unreachable_redis_is_explained_on_the_page(viewer, redis_down):
    response = viewer.get(LIST_URL)
    assert response.status_code == 503
    assert "could not be read" in response.context["error"]
    assert b'id="lock-error"' in response.content


def test_release_with_unreachable_redis_returns_to_list_with_explanation(releaser, redis_down):
    response = releaser.get(RELEASE_URL, {"name": "batch"}, follow=True)
    [message] = [str(m) for m in response.context["messages"]]
    assert "could not be read" in message
    assert response.status_code == 503


# -- releasing -----------------------------------------------------------------------


def test_viewer_without_release_permission_sees_no_release_controls(viewer):
    with mutex("guarded"):
        response = viewer.get(LIST_URL)
    assert "guarded" in _rows(response)
    assert b"Release selected locks" not in response.content
    assert RELEASE_URL.encode() not in response.content


def test_releaser_gets_a_release_link_per_lock(releaser, hold):
    hold("orders:9")
    [row] = _rows(releaser.get(LIST_URL)).values()
    assert row["release_url"] == RELEASE_URL + "?using=default&name=orders%3A9"
    page = releaser.get(row["release_url"])
    assert [r["name"] for r in page.context["locks"]] == ["orders:9"]


@pytest.mark.parametrize("method", ["get", "post"])
def test_viewer_without_release_permission_is_forbidden_to_release(viewer, method, hold):
    lock = hold("guarded")
    response = getattr(viewer, method)(RELEASE_URL, {"name": "guarded"})
    assert response.status_code == 403
    assert lock.locked() and lock.owned()


def test_release_confirmation_lists_lock_and_keeps_it(releaser, hold):
    lock = hold("batch", label="batch job")
    response = releaser.get(RELEASE_URL, {"name": "batch"})
    assert response.status_code == 200
    assert [row["name"] for row in response.context["locks"]] == ["batch"]
    assert b"batch job" in response.content
    assert b'name="csrfmiddlewaretoken"' in response.content
    assert lock.owned()


def test_release_in_unknown_alias_is_explained(releaser):
    response = releaser.get(RELEASE_URL, {"name": "batch", "using": "nope"})
    assert response.status_code == 404
    assert "Cache alias “nope” does not carry locks" in response.context["error"]


def test_release_post_without_csrf_token_is_rejected(releaser, hold):
    lock = hold("batch")
    response = releaser.post(RELEASE_URL, {"name": "batch"})
    assert response.status_code == 403
    assert lock.owned()


def test_confirmed_release_frees_lock(releaser, hold):
    hold("batch")
    token = _csrf_token(releaser.get(RELEASE_URL, {"name": "batch"}).content.decode())
    response = releaser.post(RELEASE_URL, {"name": "batch", "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert response["Location"] == LIST_URL + "?using=default"
    assert not Mutex("batch").locked()


def test_confirmed_release_is_recorded_in_admin_history(releaser, hold):
    lock = hold("batch", label="batch job")
    fence = lock.fence
    token = _csrf_token(releaser.get(RELEASE_URL, {"name": "batch"}).content.decode())
    releaser.post(RELEASE_URL, {"name": "batch", "csrfmiddlewaretoken": token})
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION
    assert entry.content_type == ContentType.objects.get_for_model(Lock)
    assert entry.object_repr == "batch"
    assert entry.user.username == "staff-view_lock-release_lock"
    assert f"fence {fence}" in entry.change_message
    assert f"owner batch job ({socket.gethostname()}, pid {os.getpid()}" in entry.change_message


def test_release_of_selection_frees_each_and_reports_count(releaser, hold):
    for name in ("a", "b", "c"):
        hold(name)
    names = {"name": ["a", "c"]}
    page = releaser.get(RELEASE_URL, names)
    assert [row["name"] for row in page.context["locks"]] == ["a", "c"]
    response = releaser.post(
        RELEASE_URL,
        {**names, "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["Released 2 locks."]
    assert list(_rows(response)) == ["b"]
    assert LogEntry.objects.count() == 2


def test_release_of_lock_no_longer_held_says_so(releaser, hold):
    lock = hold("batch")
    page = releaser.get(RELEASE_URL, {"name": "batch"})
    lock.release()
    response = releaser.post(
        RELEASE_URL,
        {"name": "batch", "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["1 lock was no longer held."]
    assert not LogEntry.objects.exists()


# -- filters -------------------------------------------------------------------------


def test_filter_fields_narrow_the_list_and_keep_their_values(viewer, hold_on_host):
    hold_on_host("cache:warm", "web1", label="deploy")
    hold_on_host("cache:rebuild", "web2", label="deploy")
    response = viewer.get(LIST_URL, {"host": "WEB1", "label": "deploy"})
    assert response.status_code == 200
    assert list(_rows(response)) == ["cache:warm"]
    assert response.context["total"] == 2
    fields = {field["name"]: field["value"] for field in response.context["filter_fields"]}
    assert fields == {"host": "WEB1", "pid": "", "label": "deploy", "older_than": ""}
    assert b'id="filter-host" value="WEB1"' in response.content


def test_pid_and_older_than_filters_select_by_holder_and_age(viewer, hold, hold_on_host):
    other = hold_on_host("elsewhere", "web2")
    hold("here")
    by_pid = viewer.get(LIST_URL, {"pid": str(other.pid)})
    assert list(_rows(by_pid)) == ["elsewhere"]
    assert list(_rows(viewer.get(LIST_URL, {"older_than": "0"}))) == ["elsewhere", "here"]
    assert list(_rows(viewer.get(LIST_URL, {"older_than": "1h"}))) == []


def test_bad_filter_is_explained_and_lists_nothing(viewer, hold):
    hold("batch")
    response = viewer.get(LIST_URL, {"older_than": "soon", "pid": "x", "host": "web1"})
    assert response.status_code == 400
    assert response.context["locks"] == []
    assert b"batch" not in response.content
    error = response.context["error"]
    assert "PID: 'x' is not a process id" in error
    assert "Held longer than: 'soon' is not a duration" in error
    errors = {field["name"]: field["error"] for field in response.context["filter_fields"]}
    assert errors["host"] == ""
    assert errors["older_than"].startswith("'soon' is not a duration")
    assert b'id="filter-older_than" value="soon"' in response.content
    assert b'http-equiv="refresh"' not in response.content  # no reloading the same error


def test_links_of_a_filtered_list_keep_the_filter(releaser, hold):
    hold("batch", label="nightly")
    response = releaser.get(LIST_URL, {"label": "nightly"})
    [row] = _rows(response).values()
    assert row["release_url"] == RELEASE_URL + "?using=default&name=batch&label=nightly"
    assert response.context["pause_url"].endswith("refresh=0&label=nightly")
    assert response.context["clear_filters_url"] == LIST_URL + "?using=default"
    assert b'<input type="hidden" name="label" value="nightly">' in response.content


def test_filtered_release_confirms_and_releases_only_matching_locks(releaser, hold):
    hold("a", label="nightly")
    kept = hold("b", label="request")
    selection = {"name": ["a", "b"], "label": "nightly"}
    page = releaser.get(RELEASE_URL, selection)
    assert [row["name"] for row in page.context["locks"]] == ["a"]
    assert page.context["unmatched"] == ["b"]
    assert page.context["filter_description"] == "label 'nightly'"
    assert b'id="release-filter"' in page.content
    response = releaser.post(
        RELEASE_URL,
        {**selection, "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == [
        "1 lock no longer matched the filter and was left alone.",
        "Released 1 lock.",
    ]
    assert response.redirect_chain[-1][0] == LIST_URL + "?using=default&label=nightly"
    assert kept.owned()
    assert not Mutex("a").locked()
    assert [entry.object_repr for entry in LogEntry.objects.all()] == ["a"]


def test_filtered_release_leaves_a_lock_that_passed_to_a_holder_outside_the_filter(releaser, hold):
    first = hold("batch", label="nightly")
    page = releaser.get(RELEASE_URL, {"name": "batch", "label": "nightly"})
    first.release()
    successor = hold("batch", label="request")
    response = releaser.post(
        RELEASE_URL,
        {
            "name": "batch",
            "label": "nightly",
            "csrfmiddlewaretoken": _csrf_token(page.content.decode()),
        },
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == [
        "1 lock no longer matched the filter and was left alone."
    ]
    assert successor.owned()
    assert not LogEntry.objects.exists()


def test_filtered_release_with_a_bad_filter_releases_nothing(releaser, hold):
    lock = hold("batch")
    response = releaser.get(RELEASE_URL, {"name": "batch", "older_than": "soon"}, follow=True)
    [message] = [str(m) for m in response.context["messages"]]
    assert message.startswith("The filter cannot be used: Held longer than: 'soon'")
    assert lock.owned()


def test_selection_outside_the_filter_goes_back_to_the_list(releaser, hold):
    lock = hold("batch", label="request")
    response = releaser.get(RELEASE_URL, {"name": "batch", "label": "nightly"}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        "None of the selected locks matches the filter."
    ]
    assert lock.owned()


# -- shared locks --------------------------------------------------------------------


def test_viewer_sees_every_holder_of_a_shared_lock(viewer):
    with held_shared("report", "pdf export", "csv export") as handles:
        fences = [handle.fence for handle in handles]
        response = viewer.get(LIST_URL)
    assert response.status_code == 200
    row = _rows(response)["report"]
    assert row["shared"] is True
    assert [(h["label"], h["thread"], h["pid"], h["fence"]) for h in row["holders"]] == [
        ("pdf export", "reader-1", os.getpid(), fences[0]),
        ("csv export", "reader-2", os.getpid(), fences[1]),
    ]
    html = response.content.decode()
    assert "shared, 2 holders" in html
    assert html.count('data-lock="report"') == 2  # a table row per holder
    assert "pdf export" in html and "csv export" in html


def test_release_of_a_shared_lock_frees_every_holder(releaser):
    with held_shared("report", "pdf export", "csv export") as handles:
        page = releaser.get(RELEASE_URL, {"name": "report"})
        assert page.content.decode().count('class="release-holder"') == 2
        assert [handle.owned() for handle in handles] == [True, True]  # nothing changed yet
        response = releaser.post(
            RELEASE_URL,
            {"name": "report", "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
            follow=True,
        )
        assert [str(m) for m in response.context["messages"]] == ["Released 1 lock."]
        assert [handle.owned() for handle in handles] == [False, False]
        assert _rows(response) == {}
        writer = Mutex("report", watchdog=False)
        assert writer.acquire(blocking=False)  # no reader left: a writer gets in
        writer.release()
    message = LogEntry.objects.get().change_message
    assert message.count("fence ") == 2 and "shared, holders" in message


def test_filtered_release_frees_only_the_matching_holder_of_a_shared_lock(releaser):
    with held_shared("report", "pdf export", "csv export") as (first, second):
        kept_fence = second.fence
        listing = releaser.get(LIST_URL, {"label": "pdf export"})
        [row] = _rows(listing).values()
        assert [h["label"] for h in row["holders"]] == ["pdf export"]
        selection = {"name": ["report"], "label": "pdf export"}
        page = releaser.get(RELEASE_URL, selection)
        [shown] = page.context["locks"]
        assert [h["label"] for h in shown["holders"]] == ["pdf export"]
        assert "csv export" not in page.content.decode()
        response = releaser.post(
            RELEASE_URL,
            {**selection, "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
            follow=True,
        )
        assert [str(m) for m in response.context["messages"]] == ["Released 1 lock."]
        assert not first.owned()
        assert second.owned()  # the other holder keeps its shared hold
        everything = releaser.get(LIST_URL)
        assert [h["fence"] for h in _rows(everything)["report"]["holders"]] == [kept_fence]
        assert not Mutex("report").acquire(blocking=False)  # still held shared: no writer
    message = LogEntry.objects.get().change_message
    assert "pdf export" in message and "csv export" not in message


# -- semaphores ----------------------------------------------------------------------


@pytest.fixture
def permit() -> Iterator[Callable[..., Semaphore]]:
    """Return a function taking one permit of a semaphore; give back those still held at the end.

    No watchdog, so nothing renews a permit the test reset behind its holder's back.
    """
    taken: list[Semaphore] = []

    def take(name: str, limit: int, **options: object) -> Semaphore:
        handle = Semaphore(name, limit, watchdog=False, ttl=60, **options)
        assert handle.acquire(blocking=False)
        taken.append(handle)
        return handle

    yield take
    for handle in taken:
        if handle.token is not None:
            with contextlib.suppress(LockLost, LockNotOwned):
                handle.release()


def _semaphore_rows(response) -> dict[str, dict]:
    return {row["name"]: row for row in response.context["semaphores"]}


@contextlib.contextmanager
def _waiter(name: str, limit: int) -> Iterator[dict[str, object]]:
    """Wait for a permit of ``name`` in a thread; yield what it got once it is in line."""
    got: dict[str, object] = {}

    def wait() -> None:
        handle = Semaphore(name, limit, watchdog=False, ttl=60)
        got["acquired"] = handle.acquire(timeout=30)
        got["handle"] = handle

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        wait_until(lambda: [s.waiters for s in held_semaphores()] == [1], 10, "a waiter in line")
        yield got
    finally:
        thread.join(40)
        handle = got.get("handle")
        if isinstance(handle, Semaphore) and handle.token is not None:
            with contextlib.suppress(LockLost, LockNotOwned):
                handle.release()


def test_viewer_sees_each_permit_holder_of_a_semaphore(viewer, permit):
    permit("exports", 3, label="nightly export")
    permit("exports", 3, label="hourly export")
    response = viewer.get(LIST_URL)
    assert response.status_code == 200
    row = _semaphore_rows(response)["exports"]
    assert (row["limit"], row["held"], row["waiters"]) == (3, 2, 0)
    assert sorted(h["label"] for h in row["holders"]) == ["hourly export", "nightly export"]
    assert {h["pid"] for h in row["holders"]} == {os.getpid()}
    assert {h["host"] for h in row["holders"]} == {socket.gethostname()}
    assert all(h["time_left"].endswith(" s") for h in row["holders"])
    html = response.content.decode()
    assert html.count('data-semaphore="exports"') == 2  # one row per permit
    assert "nightly export" in html and "2 / 3" in html
    assert RESET_SEMAPHORE_URL not in html  # a viewer may not reset


def test_semaphore_waiters_are_listed(viewer, permit):
    holder = permit("exports", 1)
    with _waiter("exports", 1) as got:
        row = _semaphore_rows(viewer.get(LIST_URL))["exports"]
        assert (row["held"], row["waiters"]) == (1, 1)
        holder.release()
    assert got["acquired"] is True


def test_search_narrows_semaphores_by_name(viewer, permit):
    permit("exports", 2)
    permit("imports", 2)
    response = viewer.get(LIST_URL, {"q": "imp"})
    assert list(_semaphore_rows(response)) == ["imports"]
    assert response.context["semaphores_total"] == 2


def test_holder_filter_lists_no_semaphore_and_says_why(viewer, permit):
    permit("exports", 2)
    response = viewer.get(LIST_URL, {"host": socket.gethostname()})
    assert response.context["semaphores"] == []
    assert "Semaphores are not listed under a holder filter" in response.content.decode()


def test_no_semaphore_held_is_said_on_the_page(viewer):
    response = viewer.get(LIST_URL)
    assert response.context["semaphores"] == []
    assert "No semaphore has a permit held in this cache." in response.content.decode()


def test_resetter_gets_a_reset_link_per_semaphore_and_no_release_controls(resetter, permit):
    permit("jobs:9", 2)
    with mutex("guarded"):
        response = resetter.get(LIST_URL)
    row = _semaphore_rows(response)["jobs:9"]
    assert row["reset_url"] == RESET_SEMAPHORE_URL + "?using=default&name=jobs%3A9"
    assert "guarded" in _rows(response)
    assert b"Release selected locks" not in response.content
    assert RELEASE_URL.encode() not in response.content


def test_lock_releaser_gets_no_reset_link(releaser, permit):
    permit("jobs:9", 2)
    response = releaser.get(LIST_URL)
    assert "jobs:9" in _semaphore_rows(response)
    assert RESET_SEMAPHORE_URL.encode() not in response.content


def test_superuser_gets_release_and_reset_controls(superuser, permit, hold):
    hold("guarded")
    permit("jobs:9", 2)
    html = superuser.get(LIST_URL).content.decode()
    assert RELEASE_URL + "?using=default&amp;name=guarded" in html
    assert RESET_SEMAPHORE_URL + "?using=default&amp;name=jobs%3A9" in html


@pytest.mark.parametrize("method", ["get", "post"])
@pytest.mark.parametrize(
    "codenames",
    [("view_lock",), ("view_lock", "release_lock"), ("reset_semaphore",)],
    ids=["viewer", "lock-releaser", "no-view"],
)
def test_reset_needs_view_lock_and_reset_semaphore(django_user_model, codenames, method, permit):
    # No CSRF checks, so a refused POST is refused for its permissions.
    staff = _login(django_user_model, *codenames)
    held = permit("exports", 1)
    response = getattr(staff, method)(RESET_SEMAPHORE_URL, {"name": "exports"})
    assert response.status_code == 403
    assert [h.token for s in held_semaphores() for h in s.holders] == [held.token]
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("method", ["get", "post"])
def test_semaphore_resetter_is_forbidden_to_release_a_lock(django_user_model, method, hold):
    staff = _login(django_user_model, "view_lock", "reset_semaphore")  # no CSRF checks
    lock = hold("guarded")
    response = getattr(staff, method)(RELEASE_URL, {"name": "guarded"})
    assert response.status_code == 403
    assert lock.locked() and lock.owned()
    assert not LogEntry.objects.exists()


def test_reset_confirmation_lists_holders_and_keeps_them(resetter, permit):
    held = permit("exports", 2, label="nightly export")
    response = resetter.get(RESET_SEMAPHORE_URL, {"name": "exports"})
    assert response.status_code == 200
    assert [row["name"] for row in response.context["semaphores"]] == ["exports"]
    html = response.content.decode()
    assert "nightly export" in html and "1 of 2 permits held" in html
    assert 'name="csrfmiddlewaretoken"' in html
    assert [h.token for s in held_semaphores() for h in s.holders] == [held.token]


def test_reset_post_without_csrf_token_is_rejected(resetter, permit):
    held = permit("exports", 1)
    response = resetter.post(RESET_SEMAPHORE_URL, {"name": "exports"})
    assert response.status_code == 403
    assert [h.token for s in held_semaphores() for h in s.holders] == [held.token]


def test_confirmed_reset_frees_every_permit_and_is_recorded(resetter, permit, hold):
    lock = hold("exports")  # a lock of the same name is another thing, and stays
    first = permit("exports", 2, label="nightly export")
    permit("exports", 2)
    page = resetter.get(RESET_SEMAPHORE_URL, {"name": "exports"})
    response = resetter.post(
        RESET_SEMAPHORE_URL,
        {"name": "exports", "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        follow=True,
    )
    assert response.redirect_chain == [(LIST_URL + "?using=default", 302)]
    assert [str(m) for m in response.context["messages"]] == [
        "Reset semaphore “exports”: freed 2 permits."
    ]
    assert response.context["semaphores"] == []
    assert held_semaphores() == []
    assert lock.owned()
    with pytest.raises(LockNotOwned):
        first.release()
    assert permit("exports", 1)  # a fresh acquire succeeds
    entry = LogEntry.objects.get()
    assert entry.content_type == ContentType.objects.get_for_model(SemaphoreModel)
    assert (entry.object_id, entry.object_repr) == ("exports", "exports")
    assert entry.action_flag == CHANGE  # the semaphore stays; its permits changed hands
    assert entry.user.username == "staff-view_lock-reset_semaphore"
    assert "Reset semaphore “exports” in cache “default”, freeing 2 permits" in (
        entry.change_message
    )
    assert "nightly export" in entry.change_message


def test_reset_hands_the_freed_permit_to_the_waiter(resetter, permit):
    permit("exports", 1)
    with _waiter("exports", 1) as got:
        page = resetter.get(RESET_SEMAPHORE_URL, {"name": "exports"})
        resetter.post(
            RESET_SEMAPHORE_URL,
            {"name": "exports", "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        )
        wait_until(lambda: "acquired" in got, 10, "the waiter to get the freed permit")
        assert got["acquired"] is True
        [held] = held_semaphores()
        assert [h.token for h in held.holders] == [got["handle"].token]


def test_reset_of_semaphore_no_longer_held_says_so(resetter, permit):
    held = permit("exports", 1)
    page = resetter.get(RESET_SEMAPHORE_URL, {"name": "exports"})
    held.release()
    response = resetter.post(
        RESET_SEMAPHORE_URL,
        {"name": "exports", "csrfmiddlewaretoken": _csrf_token(page.content.decode())},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == [
        "1 semaphore had no permit held any more."
    ]
    assert not LogEntry.objects.exists()


def test_reset_of_semaphore_not_held_goes_back_to_the_list(resetter):
    response = resetter.get(RESET_SEMAPHORE_URL, {"name": "never-taken"}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        "None of the selected semaphores is held any more."
    ]


def test_reset_in_unknown_alias_is_explained(resetter):
    response = resetter.get(RESET_SEMAPHORE_URL, {"name": "exports", "using": "nope"})
    assert response.status_code == 404
    assert "Cache alias “nope” does not carry locks" in response.context["error"]


CONTENTION_URL = LIST_URL + "contention/"


def test_contention_page_is_linked_from_the_list_and_shows_each_class(viewer: Client) -> None:
    from django.test import override_settings

    from django_redis_mutex import stats

    from .helpers import caches_with
    from .test_stats import contend_in_threads

    listing = viewer.get(LIST_URL)
    assert f'href="{CONTENTION_URL}?using=default" id="contention-link"' in listing.content.decode()
    with override_settings(CACHES=caches_with(STATS=True)):
        contend_in_threads(3)
        stats.flush()
        page = viewer.get(CONTENTION_URL, {"minutes": "5"})
    assert page.status_code == 200
    content = page.content.decode()
    assert '<tr data-lock-class="product:{pk}">' in content
    assert '<polyline class="contention-series" data-lock-class="product:{pk}"' in content
    assert "<script" not in content.split('id="content-main"')[1]  # the chart is plain SVG


def test_contention_page_says_when_the_alias_does_not_count(viewer: Client) -> None:
    page = viewer.get(CONTENTION_URL)
    assert page.status_code == 200
    assert 'id="stats-off"' in page.content.decode()
    assert 'id="no-figures"' in page.content.decode()


def test_contention_page_needs_the_view_permission(django_user_model) -> None:
    assert _login(django_user_model).get(CONTENTION_URL).status_code == 403
