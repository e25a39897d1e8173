"""Shared locks across real OS processes: readers together, writers alone, writers not starved.

Worker scripts (tests/workers/rw_sections.py, rw_stream.py) run as separate
Python processes against the session's redis-server and check mutual
exclusion with counters on the data client, beside the lock: an exclusive
section must find no other section inside, a shared one no exclusive one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis

from .worker import Worker

# Generous bounds: these tests run on a busy 2-core machine.
START_TIMEOUT = 30.0
# How long a writer may wait behind a stream of readers (each holds 0.3 s).
WRITER_BOUND = 10.0


@pytest.fixture
def data_key(raw: redis.Redis, mutex_prefix: str) -> Iterator[Callable[[str], str]]:
    """Return a function naming a workload key of this test (outside the lock namespace)."""
    made: list[str] = []

    def key(purpose: str) -> str:
        made.append(f"processes:{mutex_prefix}:{purpose}")
        return made[-1]

    yield key
    if made:
        raw.delete(*made)


def test_shared_sections_meet_and_exclusive_ones_are_alone(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    writers, readers, barrier = data_key("writers"), data_key("readers"), data_key("barrier")
    seed = random.SystemRandom().randrange(2**31)
    workers = [
        spawn("rw_sections.py", "rw", writers, readers, barrier, 80, seed + index)
        for index in range(5)
    ]
    for worker in workers:
        worker.expect("ready", timeout=START_TIMEOUT)
    raw.rpush(barrier, *["go"] * len(workers))

    sections: list[list[Any]] = []
    for worker in workers:
        done = worker.expect("done", timeout=120)
        assert done["violations"] == [], f"seed {seed}: {done['violations'][:5]}"
        sections += done["sections"]
        assert worker.finish() == 0

    assert len(sections) == 400
    assert int(raw.get(writers) or 0) == 0 and int(raw.get(readers) or 0) == 0
    shared = [section for section in sections if section[0]]
    exclusive = [section for section in sections if not section[0]]
    assert shared and exclusive, f"seed {seed}: only one kind of section ran"
    # Readers really shared the lock: some met another reader inside.
    assert max(seen for *_, seen in shared) >= 2, f"seed {seed}: no two readers ever met"
    # By the clock too: an exclusive section overlaps no other section.
    for fence, enter, leave in ((s[1], s[2], s[3]) for s in exclusive):
        inside = [s for s in sections if s[1] != fence and s[2] < leave and enter < s[3]]
        assert inside == [], f"seed {seed}: exclusive fence {fence} overlapped {inside[:3]}"
    # Every grant took its own fence, and an exclusive fence is above every
    # fence of a section that ended before it entered.
    fences = [section[1] for section in sections]
    assert len(set(fences)) == len(fences), f"seed {seed}: a fence was handed out twice"
    for fence, enter in ((s[1], s[2]) for s in exclusive):
        earlier = [s[1] for s in sections if s[3] < enter]
        assert all(other < fence for other in earlier), f"seed {seed}: fence {fence} too small"
    in_order = sorted(exclusive, key=lambda section: section[2])
    assert all(a[1] < b[1] for a, b in pairwise(in_order))


def test_a_writer_behind_a_stream_of_readers_gets_the_lock_in_bounded_time(
    spawn: Callable[..., Worker], raw: redis.Redis, data_key: Callable[[str], str]
) -> None:
    readers, stop = data_key("readers"), data_key("stop")
    stream = [spawn("rw_stream.py", "reader", "stream", readers, stop, 0.3) for _ in range(4)]
    for reader in stream:
        reader.expect("reading", timeout=START_TIMEOUT)

    writer = spawn("rw_stream.py", "writer", "stream", readers, 60)
    waiting = writer.expect("waiting", timeout=START_TIMEOUT)
    acquired = writer.expect("acquired", timeout=WRITER_BOUND + 5)
    still_reading = all(reader.process.poll() is None for reader in stream)
    raw.set(stop, "1")

    assert acquired["t"] - waiting["t"] < WRITER_BOUND
    assert acquired["readers"] == 0
    writer.expect("released")
    assert writer.finish() == 0
    # The readers kept coming the whole time: none had stopped when the
    # writer got in, and they went on after it.
    assert still_reading
    counts = []
    for reader in stream:
        counts.append(reader.expect("done", timeout=START_TIMEOUT)["sections"])
        assert reader.finish() == 0
    assert sum(counts) > len(stream)
    assert int(raw.get(readers) or 0) == 0
