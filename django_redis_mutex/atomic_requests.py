"""Views under ``ATOMIC_REQUESTS``: the lock first, then the request's transaction.

Django wraps a view in ``transaction.atomic()`` for each database with
``ATOMIC_REQUESTS``, outside every decorator of the view, so a decorated view
would take its lock inside the transaction. A lock kept until the transaction
ends (see transactions.py) already stops the next holder from reading before
our COMMIT, but the order still matters: rows read before the lock are not
protected, and on REPEATABLE READ (MySQL's and MariaDB's default) a snapshot
taken before the lock can predate the previous holder's commit.

So a function decorated with ``mutex()`` tells Django, through the public
``_non_atomic_requests`` attribute that ``transaction.non_atomic_requests``
sets, that it opens the request's transactions itself, and does so inside the
lock when it is called as a view (its first or second argument is an
``HttpRequest``, and no transaction is open yet on that database). The
transaction thus begins after the lock is taken and ends before it is given
back. Aliases the view excludes with ``non_atomic_requests``, above or below
the lock's decorator, stay excluded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from django.http import HttpRequest

__all__ = ["RequestTransactions"]

_NOTHING = contextlib.nullcontext()


class _OpenedByLock(set[str]):
    """A view's ``_non_atomic_requests`` when its lock opens the request's transactions.

    Django asks it ``alias not in ...`` and finds every alias in it, so it opens
    no transaction around the lock. The set's real members are the aliases the
    view excludes on its own (``non_atomic_requests`` adds to it).
    """

    def __contains__(self, alias: object) -> bool:
        return True

    def excludes(self, alias: str) -> bool:
        """Return True if the view itself opted ``alias`` out of request transactions."""
        return set.__contains__(self, alias)


class RequestTransactions:
    """The request transactions one locked function opens inside its lock."""

    __slots__ = ("_excluded",)

    def __init__(self, func: Callable[..., Any]) -> None:
        own: Iterable[str] = getattr(func, "_non_atomic_requests", ())
        self._excluded = _OpenedByLock(own)

    def mark(self, wrapper: Callable[..., Any]) -> None:
        """Tell Django's request handler that ``wrapper`` opens its own request transactions."""
        wrapper._non_atomic_requests = self._excluded  # type: ignore[attr-defined]

    def opened(self, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[Any]:
        """Return a context that opens the request's transactions, when ``args`` are a view call."""
        if not _is_view_call(args):
            return _NOTHING
        from django.db import connections, transaction

        aliases = [
            alias
            for alias, settings in connections.settings.items()
            if settings.get("ATOMIC_REQUESTS")
            and not self._excluded.excludes(alias)
            and not connections[alias].in_atomic_block
        ]
        if not aliases:
            return _NOTHING
        return _atomic_all(transaction.atomic, aliases)


@contextlib.contextmanager
def _atomic_all(atomic: Callable[..., Any], aliases: list[str]) -> Any:
    with contextlib.ExitStack() as stack:
        for alias in aliases:
            stack.enter_context(atomic(using=alias))
        yield


def _is_view_call(args: tuple[Any, ...]) -> bool:
    # A function view gets the request first; a view method (a direct
    # decorator on get/post/dispatch) gets it after self.
    return bool(args) and (
        isinstance(args[0], HttpRequest) or (len(args) > 1 and isinstance(args[1], HttpRequest))
    )
