"""Hostile lock names and labels, fuzzed through every surface that shows or takes them.

Names and labels are often built from request data (``"order:{order_id}"``,
``label=request.user.username``), so whatever a client can put in a URL has to
come out of every surface intact where exactness matters (JSON, signals, the
lock taken and released) and harmless where people read it (a terminal, a web
page): control characters, bidi overrides, braces, glob characters, NUL, HTML
and names of the full 1,024 characters. Nothing here may become a 500.

Everything runs against the session's real redis-server. Examples of one test
share its namespace, so each example releases what it took.
"""

from __future__ import annotations

import html
import json
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from io import StringIO
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from django.core.management import call_command
from django.test import Client
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_redis_mutex import LockNotOwned, Mutex, held_locks, mutex
from django_redis_mutex.display import terminal_safe
from django_redis_mutex.keys import (
    MAX_LABEL_LENGTH,
    MAX_NAME_LENGTH,
    validate_label,
    validate_name,
)
from django_redis_mutex.signals import lock_acquired, lock_contended
from tests.helpers import held_elsewhere

LIST_URL = "/admin/django_redis_mutex/lock/"
RELEASE_URL = LIST_URL + "release/"
JSON_ACCEPT = "application/json"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"

# What a terminal or a browser acts on instead of showing: controls (C0, DEL,
# C1), format characters (bidi marks, overrides, isolates), line separators.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})

HOSTILE_CHARACTERS = [
    "\x00",  # NUL
    "\x07",  # BEL, ends an OSC sequence
    "\x1b",  # ESC, starts every terminal sequence
    "\x7f",  # DEL
    "\x85",  # NEL, a C1 control
    "\x9b",  # CSI, the one-byte C1 form of ESC [
    "\n",
    "\r",
    "\t",
    "\u200f",  # RIGHT-TO-LEFT MARK
    "\u202a",  # LEFT-TO-RIGHT EMBEDDING
    "\u202e",  # RIGHT-TO-LEFT OVERRIDE
    "\u2066",  # LEFT-TO-RIGHT ISOLATE
    "\u2069",  # POP DIRECTIONAL ISOLATE
    "\u2028",  # LINE SEPARATOR
    "\ufeff",  # BYTE ORDER MARK
    *"{}*?[]\\",  # hash tag and glob characters
    *"<>&\"'",  # HTML
    *"/%:;#= -",  # URL and command-line punctuation
]
SEQUENCES = ["\x1b[2J", "\x1b]0;pwned\x07", "\x1b[31m", "{x}", "</code><script>", "%7B"]

HOSTILE_PIECE = st.one_of(
    st.sampled_from(HOSTILE_CHARACTERS),
    st.sampled_from(SEQUENCES),
    st.characters(exclude_categories=("Cs",)),
)


def hostile_text(max_size: int) -> st.SearchStrategy[str]:
    """Return non-empty strings of hostile pieces, at most ``max_size`` characters."""
    return (
        st.lists(HOSTILE_PIECE, min_size=1, max_size=20)
        .map("".join)
        .map(lambda text: text[:max_size])
    )


def padded_to(length: int) -> st.SearchStrategy[str]:
    """Return hostile strings repeated up to exactly ``length`` characters (the limits)."""
    return hostile_text(40).map(lambda text: (text * length)[:length])


# A name a URL parameter fills into "doc:{key}": up to the full name limit.
URL_KEYS = st.one_of(hostile_text(60), padded_to(MAX_NAME_LENGTH - len("doc:")))
NAMES = st.one_of(hostile_text(60), padded_to(MAX_NAME_LENGTH))
LABELS = st.one_of(st.none(), hostile_text(60), padded_to(MAX_LABEL_LENGTH))
LONE_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)

FUZZ = hypothesis_settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def unsafe_characters(text: str) -> list[str]:
    """Return the characters of ``text`` a terminal or browser would act on, not show."""
    return [char for char in text if unicodedata.category(char) in UNSAFE_CATEGORIES]


@contextmanager
def names_sent(signal: Any) -> Iterator[list[str]]:
    """Collect the ``name`` every receiver of ``signal`` gets while the block runs."""
    names: list[str] = []

    def receiver(sender: str, **kwargs: Any) -> None:
        names.append(kwargs["name"])

    signal.connect(receiver, weak=False)
    try:
        yield names
    finally:
        signal.disconnect(receiver)


def take(name: str, label: str | None = None) -> Mutex:
    """Acquire ``name`` in this thread with no watchdog (a test may release it behind us)."""
    lock = Mutex(name, watchdog=False, ttl=60, label=label)
    assert lock.acquire(blocking=False), f"{name!r} was already held"
    return lock


def release_all(locks: list[Mutex]) -> None:
    for lock in locks:
        with suppress(LockNotOwned):
            lock.release()


def run_locks(*args: str) -> str:
    out = StringIO()
    call_command("locks", *args, stdout=out)
    return out.getvalue()


# -- what validation refuses ---------------------------------------------------------------


@FUZZ
@given(before=hostile_text(20), surrogate=LONE_SURROGATES, after=hostile_text(20))
def test_lone_surrogates_are_refused_as_names_and_labels(
    before: str, surrogate: str, after: str
) -> None:
    text = before + surrogate + after
    with pytest.raises(ValueError, match="UTF-8"):
        validate_name(text)
    with pytest.raises(ValueError, match="UTF-8"):
        validate_label(text)
    with pytest.raises(ValueError, match="UTF-8"):
        Mutex(text)
    with pytest.raises(ValueError, match="UTF-8"):
        Mutex("ok", label=text)
    with pytest.raises(ValueError, match="UTF-8"):
        mutex("ok", label=text)  # at decoration time, before any request
    assert held_locks() == []


def test_label_of_exactly_the_limit_is_stored_whole() -> None:
    label = "\u202e" + "x" * (MAX_LABEL_LENGTH - 1)
    with mutex("limit", label=label):
        [held] = held_locks()
    assert held.owner.label == label


@pytest.mark.parametrize("length", [MAX_LABEL_LENGTH + 1, 5 * 1024 * 1024])
def test_label_over_the_limit_is_refused_naming_the_limit(length: int) -> None:
    label = "x" * length
    expected = rf"label is {length} characters long; the limit is {MAX_LABEL_LENGTH}\."
    with pytest.raises(ValueError, match=expected):
        Mutex("x", label=label)
    with pytest.raises(ValueError, match=expected):
        mutex("x", label=label)  # fails when the view is decorated, not per request
    assert held_locks() == []


def test_label_of_another_type_is_refused_at_decoration_time() -> None:
    with pytest.raises(TypeError, match="label must be a string or None, not bytes"):
        mutex("x", label=b"label")  # type: ignore[arg-type]


# -- a name filled from the URL: decorator, middleware, signals ------------------------------


@FUZZ
@given(key=URL_KEYS)
def test_url_filled_name_is_taken_exactly_and_its_503_is_safe(client: Client, key: str) -> None:
    name = f"doc:{key}"
    url = f"/documents/{quote(key, safe='')}/"

    with names_sent(lock_acquired) as acquired:
        free = client.get(url, HTTP_ACCEPT=JSON_ACCEPT)
    assert free.status_code == 200
    assert free.json() == {"held": [name]}
    assert acquired == [name]

    with held_elsewhere(name, ttl=30, watchdog=False), names_sent(lock_contended) as contended:
        busy = client.get(url, HTTP_ACCEPT=JSON_ACCEPT)
        page = client.get(url, HTTP_ACCEPT=BROWSER_ACCEPT)
    assert contended == [name, name]

    assert busy.status_code == 503
    assert json.loads(busy.content) == {"error": "locked", "lock": name, "retry_after": 30}

    assert page.status_code == 503
    body = page.content.decode()
    shown = body.split("<code>", 1)[1].split("</code>", 1)[0]
    assert "<" not in shown and ">" not in shown
    assert html.unescape(shown) == terminal_safe(name)
    assert unsafe_characters(shown) == []
    assert held_locks() == []


def test_503_page_shows_no_raw_control_or_bidi_characters(client: Client) -> None:
    key = "\x1b[2J\u202eevil\x00"
    with held_elsewhere(f"doc:{key}", watchdog=False):
        page = client.get(f"/documents/{quote(key, safe='')}/", HTTP_ACCEPT=BROWSER_ACCEPT)
    assert page.status_code == 503
    assert unsafe_characters(page.content.decode().replace("\n", "")) == []


# -- the admin: list, search, release --------------------------------------------------------


@pytest.fixture
def superuser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password=None))
    return client


def listed(response: Any) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in response.context["locks"]}


@pytest.mark.django_db
@FUZZ
@given(name=NAMES, other=NAMES, label=LABELS)
def test_admin_lists_finds_and_releases_only_the_named_lock(
    superuser: Client, name: str, other: str, label: str | None
) -> None:
    assume(name != other)
    taken = [take(name, label), take(other)]
    try:
        page = superuser.get(LIST_URL)
        assert page.status_code == 200
        rows = listed(page)
        assert set(rows) == {name, other}
        # The page shows no label as blank, and control or bidi characters escaped.
        assert rows[name]["label"] == terminal_safe(label or "")
        assert rows[name]["shown_name"] == terminal_safe(name)
        body = page.content.decode()
        cells = [part.split("</th>", 1)[0] for part in body.split('class="field-name">')[1:]]
        assert len(cells) == 2 and all(unsafe_characters(cell) == [] for cell in cells)

        query = name.strip()
        found = superuser.get(LIST_URL, {"q": name})
        assert found.status_code == 200
        assert name in listed(found)
        assert all(query.casefold() in row.casefold() for row in listed(found))

        confirm = superuser.get(RELEASE_URL, {"name": name})
        assert confirm.status_code == 200
        assert [row["name"] for row in confirm.context["locks"]] == [name]

        # Encoded the way a browser posts the confirmation form.
        done = superuser.post(
            RELEASE_URL,
            urlencode({"name": name}),
            content_type="application/x-www-form-urlencoded",
        )
        assert done.status_code == 302
        assert [held.name for held in held_locks()] == [other]
        assert taken[1].owned()
        with pytest.raises(LockNotOwned):
            taken[0].release()
    finally:
        release_all(taken)


# -- manage.py locks -------------------------------------------------------------------------


@FUZZ
@given(entries=st.lists(st.tuples(NAMES, LABELS), min_size=2, max_size=3, unique_by=lambda e: e[0]))
def test_locks_command_escapes_the_table_and_keeps_json_and_resets_exact(
    entries: list[tuple[str, str | None]],
) -> None:
    taken = [take(name, label) for name, label in entries]
    try:
        table = run_locks()
        assert unsafe_characters(table.replace("\n", "")) == []
        assert len(table.splitlines()) == len(entries) + 3  # source, header, rows, footer

        data = json.loads(run_locks("--json"))
        assert [(item["name"], item["owner"]["label"]) for item in data] == sorted(entries)

        # "--reset=NAME": a name may start with "-", which argparse would take for an option.
        first, *rest = sorted(name for name, _label in entries)
        reset_out = run_locks(f"--reset={first}")
        assert unsafe_characters(reset_out.replace("\n", "")) == []
        assert [held.name for held in held_locks()] == rest
        assert all(lock.owned() for lock in taken if lock.name != first)

        assert run_locks("--reset-all", "--noinput") == (
            f"Released {len(rest)} lock{'s' if len(rest) != 1 else ''} in cache 'default'.\n"
        )
        assert held_locks() == []
    finally:
        release_all(taken)


def test_table_shows_a_terminal_attack_escaped() -> None:
    taken = [take("x\x1b[2J\x1b]0;pwned\x07", "\x1b[31mred\u202eevil")]
    try:
        table = run_locks()
    finally:
        release_all(taken)
    assert "x\\x1b[2J\\x1b]0;pwned\\x07" in table
    assert "\\x1b[31mred\\u202eevil" in table
    assert "\x1b" not in table and "\u202e" not in table


def test_table_doubles_a_backslash_so_an_escape_is_never_spelled_by_a_name() -> None:
    taken = [take("spelled\\x1b")]
    try:
        table = run_locks()
    finally:
        release_all(taken)
    assert "spelled\\\\x1b" in table
