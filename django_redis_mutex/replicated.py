"""WAIT_REPLICAS: a lock on one Redis whose acquisitions its replicas must acknowledge.

A lock on a master with replicas can be lost in a failover, when the replica
promoted had not yet received it. With ``WAIT_REPLICAS`` set, an acquisition
returns only once that many replicas acknowledged it (Redis's WAIT), and is
released and refused with :class:`~django_redis_mutex.LockNotReplicated`
otherwise. Every other operation is :class:`~django_redis_mutex.topology.OneRedis`'s.
"""

from __future__ import annotations

from . import scripts
from .driver import Acknowledged, Steps
from .exceptions import LockNotReplicated
from .holds import Attempt
from .scripts import lease_ms
from .topology import Grant, OneRedis

__all__ = ["ReplicatedRedis"]


class ReplicatedRedis(OneRedis):
    """The steps of a lock on one Redis whose MUTEX block sets WAIT_REPLICAS."""

    def acquire_steps(self, attempt: Attempt) -> Steps[Grant | None]:
        """Acquire as OneRedis does, then have WAIT_REPLICAS replicas acknowledge it.

        WAIT counts the replication offset of its own connection's last write.
        The first try is sent with its WAIT in one round trip, which covers a
        lock this script wrote. A lock handed over by someone else's release
        (or found granted at a later check-in) was not our connection's last
        write: we confirm it with a write of our own (EXTEND to the full lease)
        and WAIT after that, which covers the hand-off written before it.
        """
        lock = self.lock
        replicas, timeout = lock.settings.wait_replicas, lock.settings.wait_timeout
        token = attempt.token
        sent, reply, acknowledged = yield Acknowledged(
            self.alias,
            lock._acquire_script,
            self.keys.with_wake(token),
            lock._acquire_args(attempt, attempt.blocking),
            replicas,
            timeout,
        )
        if not isinstance(reply, list):  # the fence alone: written by this very script
            grant = self._grant(reply, sent, lock.lease)
            return (yield from self._acknowledged(token, grant, acknowledged))
        if reply[0] == 1 and int(reply[2]) < 0:  # granted by this very script
            grant = yield from self._granted_steps(reply, sent)
            return (yield from self._acknowledged(token, grant, acknowledged))
        if reply[0] != 1:
            yield from self._wake(reply[3])
            lock._refused(attempt, reply)
            if not attempt.blocking:
                return None
        refused_sent = sent
        while True:
            if reply[0] == 1:
                handed: Grant | None = yield from self._granted_steps(reply, sent)
            else:
                handed = yield from self._wait_steps(attempt, reply, refused_sent)
            if handed is None:
                return None
            sent, extended, acknowledged = yield Acknowledged(
                self.alias,
                scripts.EXTEND,
                [self.keys.lock],
                [token, lease_ms(lock.lease)],
                replicas,
                timeout,
            )
            if extended:
                grant = Grant(handed.fence, {self.alias: (sent, lock.lease)}, handed.successor)
                return (yield from self._acknowledged(token, grant, acknowledged))
            # The hand-over lapsed before we confirmed it (a long pause): back
            # in line, checking in at once.
            reply, refused_sent = [0, 1, "", ""], sent

    def _acknowledged(self, token: str, grant: Grant, acknowledged: int) -> Steps[Grant]:
        """Return ``grant`` if enough replicas acknowledged it; else release it and raise."""
        settings = self.lock.settings
        if acknowledged >= settings.wait_replicas:
            return grant
        yield from self._release_call_steps(token, grant.successor)
        raise LockNotReplicated(
            self.lock.name,
            alias=self.alias,
            acknowledged=acknowledged,
            required=settings.wait_replicas,
            timeout=settings.wait_timeout,
        )
