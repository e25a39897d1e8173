"""The ``with`` and ``async with`` protocol every lock handle shares.

``with`` and ``async with`` raise LockContended when the lock cannot be had,
honour FAIL_OPEN, and on the way out raise LockLost only when the body
succeeded: an exception already propagating is never replaced. Each block
opens a scope that other handles of the same owner may nest into until the
block ends, and its exit leaves exactly the level it entered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from . import acquisition
from .acquisition import AcquiringHandle
from .conf import DEFAULT, MutexSettings
from .exceptions import LockBackendUnavailable, LockContended, LockError, LockLost, LockNotOwned
from .holds import Hold, close_scope, open_scope
from .levels import Levels
from .release import arelease, release
from .watchdog import declare_if_lapsed

__all__ = ["LockBlock"]

logger = logging.getLogger("django_redis_mutex")

B = TypeVar("B", bound="LockBlock")


class LockBlock:
    """Mixin of :class:`~django_redis_mutex.Mutex`: entering and leaving a block holds the lock."""

    name: str
    kind: str
    settings: MutexSettings
    _levels: Levels

    if TYPE_CHECKING:

        def contended(self) -> LockContended: ...

    @property
    def _handle(self) -> AcquiringHandle:
        # Only Mutex (and its subclasses) mix this in.
        return cast(AcquiringHandle, self)

    def __enter__(self: B) -> B:
        try:
            self._enter(acquisition.acquire(self._handle, DEFAULT, DEFAULT))
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
        return self

    async def __aenter__(self: B) -> B:
        try:
            self._enter(await acquisition.aacquire(self._handle, DEFAULT, DEFAULT))
        except LockBackendUnavailable as exc:
            self._enter_failed_open(exc)
        return self

    def _enter(self, hold: Hold | None) -> None:
        if hold is None:
            raise self.contended()
        self._levels.enter(hold, open_scope(hold))

    def _enter_failed_open(self, exc: LockBackendUnavailable) -> None:
        if not self.settings.fail_open:
            raise exc
        logger.warning(
            "FAIL_OPEN: running %r unlocked because Redis is unavailable: %s", self.name, exc
        )
        self._levels.enter(None, None)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        hold = self._leaving()
        if hold is not None:  # else it ran unlocked under FAIL_OPEN
            try:
                release(self._handle, hold)
            except (LockNotOwned, LockBackendUnavailable) as error:
                self._left(hold, error, body_failed=exc_type is not None)
            else:
                self._left(hold, None, body_failed=exc_type is not None)
        return False

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        hold = self._leaving()
        if hold is not None:
            try:
                # Shielded: a task cancelled while leaving the block still
                # releases its lock (the release finishes in the background).
                await asyncio.shield(arelease(self._handle, hold))
            except (LockNotOwned, LockBackendUnavailable) as error:
                self._left(hold, error, body_failed=exc_type is not None)
            else:
                self._left(hold, None, body_failed=exc_type is not None)
        return False

    def _leaving(self) -> Hold | None:
        """Pop the block being left; return its hold (None if it ran unlocked)."""
        block = self._levels.leave()
        if block is None or block.hold is None:
            return None
        if block.scope is not None:
            close_scope(block.scope)
        declare_if_lapsed(block.hold)
        return block.hold

    def _left(self, hold: Hold, error: LockError | None, *, body_failed: bool) -> None:
        """Raise what the block's release found, unless the body already failed (then log it)."""
        if isinstance(error, LockBackendUnavailable):
            # The lease still ends by itself; the hold stays on the handle for a retry.
            if body_failed or self.settings.fail_open:
                logger.error("Could not release %s %r: %s", self.kind, self.name, error)
                return
            raise error
        if error is None and not (hold.lost and not hold.active):
            return
        message = (
            f"{hold.describe()} was lost while the block ran: "
            f"{hold.lost_reason or 'it expired, was reset, or was taken'}."
        )
        if body_failed or not hold.raise_on_lost:
            logger.error(message)
            return
        raise LockLost(message, name=self.name)
