"""Lock names and the Redis keys they map to.

Every key of one lock carries the same Redis Cluster hash tag, ``{<name>}``,
so each script touches a single slot. Characters that would change the tag
(``{`` and ``}``) are percent-escaped, so a user's name can never move a lock
to another slot or out of its namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "MAX_LABEL_LENGTH",
    "MAX_NAME_LENGTH",
    "LockKeys",
    "escape_name",
    "lock_pattern",
    "validate_label",
    "validate_name",
]

MAX_NAME_LENGTH = 1024
# A label is stored in the owner record with every acquisition and shown in the
# admin and ``manage.py locks``; it is often built from request data, so it is
# bounded like the name, only tighter: it describes a holder, it names nothing.
MAX_LABEL_LENGTH = 256

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})
_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a lock, else raise TypeError/ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"Lock name must be a string, not {type(name).__name__}.")
    if not name:
        raise ValueError("Lock name must not be empty.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Lock name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}."
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"Lock name {name!r} cannot be encoded as UTF-8: {exc.reason}.") from exc
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
    if len(label) > MAX_LABEL_LENGTH:
        raise ValueError(f"label is {len(label)} characters long; the limit is {MAX_LABEL_LENGTH}.")
    try:
        label.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"label {label!r} cannot be encoded as UTF-8: {exc.reason}.") from exc
    return label


def escape_name(name: str) -> str:
    """Return ``name`` with the hash-tag characters (and the escape itself) escaped."""
    return name.translate(_ESCAPES)


def glob_escape(text: str) -> str:
    """Escape ``text`` for a literal match in a Redis SCAN MATCH pattern."""
    return text.translate(_GLOB_SPECIAL)


def lock_pattern(namespace: str) -> str:
    """Return the SCAN pattern matching every lock key (and only lock keys) of a namespace."""
    return glob_escape(namespace) + ":{*}"


@lru_cache(maxsize=4096)
def _keys_for(namespace: str, name: str) -> LockKeys:
    # Hot names (a view's lock) are built on every request; the keys are pure
    # functions of namespace and name.
    return LockKeys.for_lock_key(f"{namespace}:{{{escape_name(name)}}}")


@dataclass(frozen=True)
class LockKeys:
    """The keys of one lock, in the order every script takes them."""

    lock: str
    fence: str
    queue: str
    leases: str
    waiting: str
    wake_prefix: str

    @classmethod
    def for_name(cls, namespace: str, name: str) -> LockKeys:
        return _keys_for(namespace, name)

    @classmethod
    def for_lock_key(cls, lock_key: str) -> LockKeys:
        return cls(
            lock=lock_key,
            fence=f"{lock_key}:fence",
            queue=f"{lock_key}:queue",
            leases=f"{lock_key}:leases",
            waiting=f"{lock_key}:waiting",
            wake_prefix=f"{lock_key}:wake:",
        )

    @property
    def script_keys(self) -> list[str]:
        """The KEYS every lock script takes: the lock key (the scripts derive the rest)."""
        return [self.lock]
