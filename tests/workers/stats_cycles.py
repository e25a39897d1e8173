"""Take and give back one lock class COUNT times with STATS on, then exit without flushing.

Usage: stats_cycles.py COUNT

The figures counted here reach Redis only through the flush at interpreter
exit; the test reads them back once this process has ended.
"""

import sys

import django
from django.conf import settings

django.setup()
# Before the first lock reads the alias's settings.
settings.CACHES["default"]["MUTEX"]["STATS"] = True

from support import emit  # noqa: E402

from django_redis_mutex import mutex  # noqa: E402


@mutex("cycle:{n}", timeout=30)
def cycle(n: int) -> None:
    """One lock of the class "cycle:{n}" per n."""


def main(count: int) -> None:
    for n in range(count):
        cycle(n % 2)
    emit("done", cycles=count)


if __name__ == "__main__":
    main(int(sys.argv[1]))
