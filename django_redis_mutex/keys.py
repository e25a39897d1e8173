"""Lock names and the Redis keys they map to.

Every key of one lock carries the same Redis Cluster hash tag, ``{<name>}``,
so each script touches a single slot. Characters that would change the tag
(``{`` and ``}``) are percent-escaped, so a user's name can never move a lock
to another slot or out of its namespace.

The layout of one lock, written here and nowhere else (``<lock>`` is
``<namespace>:{<escaped name>}``)::

    <lock>               hash: token, fence, owner (JSON); ``queued`` once someone
                         waits behind this holder; ``acquired`` (ms) only when the
                         fence is not the server clock in µs (see scripts.py).
                         Held shared: no token, one ``r:<token>`` field per
                         holder, "<lease end ms>|<fence>|<taken ms>|<owner JSON>"
    <lock>:fence         string: the last fencing token handed out for this name
    <lock>:queue         zset: waiting tokens, scored by arrival (FIFO order)
    <lock>:waiting       hash: waiting token -> "<place lease end ms>|<ttl ms>|<owner JSON>"
    <lock>:wake:<token>  list: a waiter's wake-up, "<fence>|<successor token>"

One key per waiting thread or task, outside any lock (``<agent>`` is the
agent id in the owner record, see holds.py)::

    <namespace>:waits:{<agent>}
                         string: "<token>|<lock key>", the lock the agent waits
                         for and its token in that lock's queue; written only
                         while a wait outlasts DEADLOCK_TIMEOUT, with a short
                         expiry (see deadlock.py)

A semaphore has the same layout, under ``<namespace>:semaphore:{<escaped
name>}``: its permits are shared holders' records, and its hash also keeps
``limit``, the most holders it admits at once. A lock and a semaphore of one
name are two different things, and the lock patterns never match a semaphore.

Contention figures (see :mod:`django_redis_mutex.stats`) live beside the locks,
one hash per minute of figures, never matched by the lock or semaphore
patterns::

    <namespace>:stats:{<window start, epoch s>}
                         hash: "<figure>|<lock class>" -> count; expires an hour
                         after its window ends

Every script is given, in KEYS, every key it may touch (the first five in that
order, then the one wake-up list it may push to or clear): during a Redis
Cluster slot migration a key the script did not declare could already have
moved, and the script would run on part of the lock's state instead of being
redirected with the rest of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "MAX_LABEL_LENGTH",
    "MAX_NAME_LENGTH",
    "LockKeys",
    "SharedRecord",
    "app_key_patterns",
    "escape_name",
    "lock_pattern",
    "place_is_live",
    "semaphore_pattern",
    "stats_key",
    "unescape_name",
    "validate_label",
    "validate_name",
    "waits_key",
]

MAX_NAME_LENGTH = 1024
# A label is stored in the owner record with every acquisition and shown in the
# admin and ``manage.py locks``; it is often built from request data, so it is
# bounded like the name, only tighter: it describes a holder, it names nothing.
MAX_LABEL_LENGTH = 256

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})
_UNESCAPES = {"%25": "%", "%7B": "{", "%7D": "}"}
_ESCAPED = re.compile("%25|%7B|%7D")
_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def _check_text(what: str, text: str, limit: int) -> None:
    """Raise ValueError naming ``what`` if ``text`` is longer than ``limit`` or not UTF-8."""
    if len(text) > limit:
        raise ValueError(f"{what} is {len(text)} characters long; the limit is {limit}.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} {text!r} cannot be encoded as UTF-8: {exc.reason}.") from exc


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a lock, else raise TypeError/ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a string, not {type(name).__name__}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    _check_text("Lock name", name, MAX_NAME_LENGTH)
    return name


def validate_label(label: object) -> str | None:
    """Return ``label`` if it can describe a lock's holder, else raise TypeError/ValueError.

    A label is None or a string of at most :data:`MAX_LABEL_LENGTH` characters
    that encodes as UTF-8 (no lone surrogates), since it is written to Redis
    with every acquisition of the lock.
    """
    if label is None:
        return None
    if not isinstance(label, str):
        raise TypeError(f"label must be a string or None, not {type(label).__name__}.")
    _check_text("label", label, MAX_LABEL_LENGTH)
    return label


def escape_name(name: str) -> str:
    """Return ``name`` with the hash-tag characters (and the escape itself) escaped."""
    return name.translate(_ESCAPES)


def unescape_name(escaped: str) -> str:
    """Return the name :func:`escape_name` turned into ``escaped`` (one pass, so exact)."""
    return _ESCAPED.sub(lambda match: _UNESCAPES[match.group()], escaped)


def glob_escape(text: str) -> str:
    """Escape ``text`` for a literal match in a Redis SCAN MATCH pattern."""
    return text.translate(_GLOB_SPECIAL)


# Where a semaphore's keys live in a namespace, before its hash tag.
_SEMAPHORES = "semaphore:"


def lock_pattern(namespace: str) -> str:
    """Return the SCAN pattern matching every lock key (and only lock keys) of a namespace."""
    return glob_escape(namespace) + ":{*}"


def semaphore_pattern(namespace: str) -> str:
    """Return the SCAN pattern matching every semaphore's main key (its hash) in a namespace."""
    return glob_escape(namespace) + ":" + _SEMAPHORES + "{*}"


# Where the contention figures live in a namespace, before their hash tag.
_STATS = "stats:"


def stats_key(namespace: str, window: int) -> str:
    """Return the hash of the contention figures of the window starting at ``window`` (epoch s).

    The window is the key's hash tag: one slot per window on a Cluster, so a
    flush's writes to one window stay on one node.
    """
    return f"{namespace}:{_STATS}{{{window}}}"


# Where the waits-for records live in a namespace, before the agent's hash tag.
_WAITS = "waits:"


def app_key_patterns(namespace: str) -> tuple[str, ...]:
    """Return SCAN patterns matching every key this app writes in a namespace, and no other."""
    escaped = glob_escape(namespace)
    return (
        escaped + ":{*",
        escaped + ":" + _SEMAPHORES + "{*",
        escaped + ":" + _STATS + "{*",
        escaped + ":" + _WAITS + "{*",
    )


def waits_key(namespace: str, agent: str) -> str:
    """Return the key of the waits-for record of ``agent`` (a thread or task) in a namespace.

    The agent id is hex and dots (see holds.owner_metadata), but it is read
    back from owner records anyone may have written, so it is escaped too.
    """
    return f"{namespace}:{_WAITS}{{{escape_name(agent)}}}"


@lru_cache(maxsize=4096)
def _keys_for(namespace: str, name: str, space: str) -> LockKeys:
    # Hot names (a view's lock) are built on every request; the keys are pure
    # functions of namespace and name.
    return LockKeys.for_lock_key(f"{namespace}:{space}{{{escape_name(name)}}}")


@dataclass(frozen=True)
class LockKeys:
    """The keys of one lock (see the layout above)."""

    lock: str
    fence: str
    queue: str
    waiting: str
    wake_prefix: str
    # lock, fence, queue, waiting: the KEYS every queue-aware script starts
    # with, built once per name (hot names are looked up on every request).
    script_keys: tuple[str, str, str, str]

    @classmethod
    def for_name(cls, namespace: str, name: str) -> LockKeys:
        return _keys_for(namespace, name, "")

    @classmethod
    def for_semaphore(cls, namespace: str, name: str) -> LockKeys:
        return _keys_for(namespace, name, _SEMAPHORES)

    @classmethod
    def for_lock_key(cls, lock_key: str) -> LockKeys:
        fence = f"{lock_key}:fence"
        queue = f"{lock_key}:queue"
        waiting = f"{lock_key}:waiting"
        return cls(
            lock=lock_key,
            fence=fence,
            queue=queue,
            waiting=waiting,
            wake_prefix=f"{lock_key}:wake:",
            script_keys=(lock_key, fence, queue, waiting),
        )

    def wake(self, token: str) -> str:
        """Return the wake-up list of the waiter holding ``token``."""
        return self.wake_prefix + token

    def with_wake(self, token: str) -> tuple[str, ...]:
        """Return :attr:`script_keys` plus the wake-up list of ``token`` (a script's KEYS[5])."""
        return (*self.script_keys, self.wake_prefix + token)

    def name_of(self, namespace: str) -> str:
        """Return the lock name these keys belong to in ``namespace`` (read from the key)."""
        return unescape_name(self.lock[self.lock.index("{", len(namespace)) + 1 : -1])


def place_is_live(record: str, now_ms: int) -> bool:
    """Whether a waiter's place in line still holds, read as the scripts read it.

    A place is ``"<lease end ms>|<ttl ms>|<owner>"`` (``waiter_terms`` in
    scripts.py): one whose waiter stopped renewing it is skipped when it
    comes first, so it is not counted as waiting. An older version's
    ``"<ttl ms>|<owner>"`` holds until served; an unreadable one never does.
    """
    first, bar, rest = record.partition("|")
    if not (bar and _lua_number(first)):
        return False
    if rest.startswith("{"):
        return True
    ttl, bar, _owner = rest.partition("|")
    return bool(bar) and _lua_number(ttl) and float(first) > now_ms


def _lua_number(text: str) -> bool:
    """Whether Lua's tonumber() reads ``text`` as a number (for what this package writes)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SharedRecord:
    """One shared holder's field in a lock hash: ``r:<token>`` = "<ends>|<fence>|<taken>|<owner>".

    ``ends`` and ``taken`` are server times in ms; ``owner`` is the owner JSON.
    """

    ends: int
    fence: int
    taken: int
    owner: str

    @classmethod
    def parse(cls, value: str) -> SharedRecord | None:
        """Return the record ``value`` holds, or None if it is not one."""
        parts = value.split("|", 3)
        if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]):
            return None
        return cls(int(parts[0]), int(parts[1]), int(parts[2]), parts[3])
