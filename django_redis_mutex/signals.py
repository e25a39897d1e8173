"""Signals sent as locks change hands, for metrics and logging.

Each is sent with ``sender`` set to the cache alias and these keyword arguments:

``lock_acquired``
    ``name``, ``fence``, ``wait`` (seconds spent waiting).
``lock_released``
    ``name``, ``fence``, ``held`` (seconds the lock was held).
``lock_contended``
    ``name``, ``wait`` (seconds waited before giving up), ``retry_after``, ``owner``.
``lock_lost``
    ``name``, ``fence``, ``held`` (seconds from acquisition until the loss was noticed).

Receivers run in the thread that acquired or released the lock, except
``lock_lost`` when the watchdog notices the loss, which runs in the watchdog
thread. Keep receivers fast: they sit on the lock's hot path.
"""

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_contended = Signal()
lock_lost = Signal()
