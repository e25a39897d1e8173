"""Distributed mutual exclusion for Django on Redis.

The public names are re-exported here; nothing reads settings at import time.
"""

from .decorators import MutexContext, mutex
from .exceptions import (
    LockBackendUnavailable,
    LockContended,
    LockError,
    LockLost,
    LockNotOwned,
    StaleFence,
)
from .introspection import HeldLock, held_locks, reset, reset_all
from .lock import DEFAULT, Mutex
from .owners import Owner
from .quorum import QuorumMutex

__version__ = "0.1.0"

__all__ = [
    "DEFAULT",
    "HeldLock",
    "LockBackendUnavailable",
    "LockContended",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "Mutex",
    "MutexContext",
    "Owner",
    "QuorumMutex",
    "StaleFence",
    "held_locks",
    "mutex",
    "reset",
    "reset_all",
]
