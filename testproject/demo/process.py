"""Keep the demo's helper processes from outliving it.

Signal handlers cover SIGINT, SIGTERM and SIGHUP, but nothing runs on
SIGKILL or a crash: on Linux, ``prctl(PR_SET_PDEATHSIG)`` makes the kernel
send the child a signal when its parent goes away, whatever the reason.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent exits.

    Does nothing off Linux. Call it in the child (or as ``preexec_fn``). With
    ``parent``, the pid the child was started by: if that one is already gone
    (the child was re-parented before the call), exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
