"""Distributed mutual exclusion for Django on Redis.

The public names are re-exported here; nothing reads settings at import time.
"""

from .decorators import MutexContext, mutex, skip_if_locked
from .exceptions import (
    LockBackendUnavailable,
    LockContended,
    LockDeadlock,
    LockError,
    LockLost,
    LockNotOwned,
    LockNotReplicated,
    LockUpgradeRefused,
    StaleFence,
)
from .introspection import (
    HeldLock,
    HeldSemaphore,
    held_locks,
    held_semaphores,
    reset,
    reset_all,
    reset_semaphore,
)
from .lock import DEFAULT, Mutex, QuorumMutex
from .owners import Owner
from .semaphore import Semaphore, SemaphoreContext, semaphore
from .transactions import LockAfterReadWarning

__version__ = "0.1.0"

__all__ = [
    "DEFAULT",
    "HeldLock",
    "HeldSemaphore",
    "LockAfterReadWarning",
    "LockBackendUnavailable",
    "LockContended",
    "LockDeadlock",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockNotReplicated",
    "LockUpgradeRefused",
    "Mutex",
    "MutexContext",
    "Owner",
    "QuorumMutex",
    "Semaphore",
    "SemaphoreContext",
    "StaleFence",
    "held_locks",
    "held_semaphores",
    "mutex",
    "reset",
    "reset_all",
    "reset_semaphore",
    "semaphore",
    "skip_if_locked",
]
