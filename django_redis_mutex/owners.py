"""Who holds a lock: the owner record stored with every acquisition.

Each acquisition writes a small JSON record next to its token (host, process
id, thread or asyncio task name, and the caller's label) so that the
``locks`` command, the admin and ``LockContended`` can say who is in the way.
The record is read back from Redis, where anyone with access may have written
anything, so reading it never fails: a field that is missing or of the wrong
type reads as None.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Owner", "agent_of", "mark_transaction", "parse_owner"]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _aliases(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(item for item in value if isinstance(item, str))


def _pid(value: Any) -> int | None:
    # bool is an int subclass; a pid of True is not a pid.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class Owner:
    """The holder of a lock as it described itself when it acquired it."""

    host: str | None = None
    pid: int | None = None
    thread: str | None = None  # thread name, or asyncio task name
    label: str | None = None
    #: The database aliases whose transaction the lock is kept for, after its
    #: block ended (empty while the block runs). See the Transactions docs.
    transaction: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, record: Any) -> Owner:
        """Return the owner described by a decoded JSON record, None for anything unreadable."""
        if not isinstance(record, dict):
            return cls()
        return cls(
            host=_text(record.get("host")),
            pid=_pid(record.get("pid")),
            thread=_text(record.get("thread")),
            label=_text(record.get("label")),
            transaction=_aliases(record.get("transaction")),
        )

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict (for JSON output)."""
        fields = asdict(self)
        fields["transaction"] = list(self.transaction)
        return fields

    def __str__(self) -> str:
        """Describe the owner in one line: ``label (host, pid 12, thread T)``.

        This is the one place an owner is turned into text, so the admin,
        the ``locks`` command and error messages say it the same way.
        """
        where = ", ".join(
            part
            for part in (
                self.host or "",
                f"pid {self.pid}" if self.pid is not None else "",
                f"thread {self.thread}" if self.thread else "",
            )
            if part
        )
        if self.label and where:
            who = f"{self.label} ({where})"
        else:
            who = self.label or where or "unknown owner"
        if self.transaction:
            return f"{who}, kept until its transaction on {', '.join(self.transaction)} ends"
        return who

    # -- dict-style access, kept for one release ------------------------------------

    def __getitem__(self, field: str) -> Any:
        return self._deprecated_lookup(field, KeyError)

    def get(self, field: str, default: Any = None) -> Any:
        """Deprecated: read the attribute instead (``owner.host``)."""
        try:
            return self._deprecated_lookup(field, KeyError)
        except KeyError:
            return default

    def _deprecated_lookup(self, field: str, missing: type[Exception]) -> Any:
        warnings.warn(
            f"Owner is a record, not a dict: use owner.{field} instead of owner[{field!r}] "
            "or owner.get(...); dict-style access goes away in the next release.",
            DeprecationWarning,
            stacklevel=3,
        )
        if field not in self.__dataclass_fields__:
            raise missing(field)
        return getattr(self, field)


def mark_transaction(owner_json: str, databases: list[str]) -> str:
    """Return ``owner_json`` saying that the lock is kept for a transaction on ``databases``."""
    record = json.loads(owner_json)
    record["transaction"] = list(databases)
    return json.dumps(record, separators=(",", ":"))


def _record(raw: Any) -> dict[str, Any] | None:
    """Return an owner record read from Redis as a dict, or None if absent or not a JSON object."""
    if not raw:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    lease, bar, rest = text.partition("|")
    if bar and lease.isdigit():
        # An older version's release, handing the lock to a waiter of this
        # one, took the waiter's place lease for part of its owner record.
        text = rest
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def parse_owner(raw: Any) -> Owner | None:
    """Return the owner record read from Redis, or None if absent or not a JSON object."""
    record = _record(raw)
    return Owner.from_record(record) if record is not None else None


def agent_of(raw: Any) -> str | None:
    """Return the agent id in an owner record (the thread or task that holds), or None.

    Records written before agents existed, and records that are not ours, have
    none: their holder is never followed by deadlock detection.
    """
    record = _record(raw)
    agent = record.get("agent") if record is not None else None
    return agent if isinstance(agent, str) and agent else None
