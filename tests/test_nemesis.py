"""The nemesis (tests/nemesis.py): its checker on hand-made histories, then short real runs.

The checker tests come first so that a clean run means something: each builds
the journal lines workers write (enter, leave, outcome, told, ...) and the
faults the nemesis applied, and asks :func:`tests.nemesis.check` for a verdict.
Times are milliseconds from the start of the run.

The real runs start their own redis-server(s), worker processes with threads
and asyncio tasks, and apply the faults a seed plans, one topology per test.
The seed comes from ``NEMESIS_SEED`` (random otherwise) and is in every
failure message, with the command that replays the same plan.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from .databases import PostgresServer
from .nemesis import (
    HANDOFF_VARIANTS,
    NS,
    TOPOLOGIES,
    DataState,
    FaultRecord,
    HeldSample,
    Increment,
    RunInfo,
    Tuning,
    Verdict,
    check,
    make_plan,
    run_nemesis,
)

T0 = 1_000 * NS
TUNING = Tuning()  # ttl 1.5 s: a pause of 0.5 s or more may cost a lease


def at(ms: float) -> int:
    return T0 + int(ms * 1_000_000)


class Journal:
    """The events workers would have written, built by hand."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.faults: list[FaultRecord] = []
        self.held_after: list[HeldSample] = []
        self.held_during: list[HeldSample] = []
        self.orphan_phases: dict[str, int] = {}
        self._bodies = 0

    def body(
        self,
        pid: int,
        fence: int,
        enter: float,
        leave: float | None,
        *,
        result: str | None = "clean",
        name: str = "hot",
        space: str = "single",
        kind: str = "with",
        called: float | None = None,
        slot: int | None = None,
        is_async: bool = False,
        scenario: str | None = None,
        joined: bool = False,
        shared: bool = False,
        limit: int | None = None,
    ) -> str:
        self._bodies += 1
        body = f"{pid}-{self._bodies}"
        self.events.append(
            {
                "e": "enter",
                "pid": pid,
                "t": at(enter),
                "b": body,
                "slot": pid if slot is None else slot,
                "space": space,
                "name": name,
                "fence": fence,
                "kind": kind,
                "owner": "thread0",
                "called": at(enter if called is None else called),
                "joined": joined,
                "scenario": scenario,
                "async": is_async,
                "shared": shared,
                "limit": limit,
            }
        )
        if leave is not None:
            self.events.append({"e": "leave", "pid": pid, "t": at(leave), "b": body})
            if result is not None:
                self.events.append(
                    {"e": "outcome", "pid": pid, "t": at(leave + 1), "b": body, "result": result}
                )
        return body

    def signal(self, pid: int, name: str, fence: int, when: float) -> None:
        self.events.append(
            {"e": "told", "pid": pid, "t": at(when), "how": "signal", "name": name, "fence": fence}
        )

    def event(self, kind: str, pid: int, when: float, **data: Any) -> None:
        self.events.append({"e": kind, "pid": pid, "t": at(when), **data})

    def fault(self, kind: str, start: float, end: float | None = None, **data: Any) -> None:
        self.faults.append(
            FaultRecord(
                id=len(self.faults) + 1,
                kind=kind,
                t0=at(start),
                t1=None if end is None else at(end),
                **data,
            )
        )

    def transaction(
        self,
        pid: int,
        fence: int,
        enter: float,
        leave: float,
        committed: float,
        *,
        read: int,
        name: str = "hot",
        given_back: bool = True,
    ) -> str:
        """A tx-with body: its lock's block ends at ``leave``, its COMMIT at ``committed``.

        Its outcome (clean) is journalled after the COMMIT, as workers do.
        """
        body = self.body(pid, fence, enter, leave, kind="tx-with", name=name, result=None)
        self.event("intent", pid, enter + 1, b=body, lock=f"single:{name}", read=read)
        self.event("exited", pid, leave + 0.5, b=body)
        self.event("committed", pid, committed, b=body, value=read + 1, given_back=given_back)
        self.event("outcome", pid, committed + 1, b=body, result="clean")
        return body

    def committed(self, *bodies: str) -> DataState:
        """The database after ``bodies`` committed, in that order, each writing its read + 1."""
        reads = {e["b"]: e["read"] for e in self.events if e["e"] == "intent"}
        locks = {e["b"]: e["lock"] for e in self.events if e["e"] == "intent"}
        state = DataState(counters={}, writes={})
        for body in bodies:
            lock = locks[body]
            seq = state.writes.get(lock, 0) + 1
            state.increments.append(Increment(body, lock, reads[body] + 1, seq))
            state.writes[lock], state.counters[lock] = seq, reads[body] + 1
        return state

    def held(
        self, phase: str, when: float, name: str = "hot", *, pid: int = 1, lease: float = 1.5
    ) -> None:
        """The orphan check saw lock ``name`` held by ``pid`` at ``when``, in ``phase``."""
        self.held_after.append(
            HeldSample(
                phase, at(when), "lock", "single", name, "fence 10", pid,
                f"host (pid {pid}, thread task0-child)", 1.0, lease, "task0-child",
            )
        )  # fmt: skip

    def child(self, pid: int, child: str, ended: float, *seen: float) -> None:
        """A cancelled child task ended at ``ended``; its permit was seen held at ``seen``."""
        self.event("child-end", pid, ended, child=child, b=None, phase="waiting", cancels=2)
        for when in seen:
            self.held_during.append(
                HeldSample(
                    "run", at(when), "permit", "single", "sem", "token t1", pid,
                    f"host (pid {pid}, thread {child})", 1.0, 6.0, child,
                )
            )  # fmt: skip

    def check(
        self, *, done: tuple[int, ...] | None = None, data: DataState | None = None
    ) -> Verdict:
        pids = {e["pid"] for e in self.events} if done is None else set(done)
        killed = {f.pid for f in self.faults if f.kind == "kill-worker"}
        events = self.events + [
            {"e": "done", "pid": pid, "t": at(60_000)} for pid in sorted(pids - killed)
        ]
        info = RunInfo(
            "single",
            0,
            TUNING,
            T0,
            at(60_000),
            faults=self.faults,
            data=data,
            held_after=self.held_after,
            orphan_phases=self.orphan_phases,
            held_during=self.held_during,
        )
        return check(events, info)


def kinds(verdict: Verdict) -> list[str]:
    return [violation.kind for violation in verdict.violations]


# -- overlaps -----------------------------------------------------------------------------------


def test_back_to_back_bodies_with_growing_fences_pass() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 100)
    journal.body(2, 11, 100, 200)
    journal.body(1, 15, 250, 300)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["fences in order"] == 2


def test_an_overlap_whose_stale_holder_was_never_told_is_a_violation() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000)
    journal.body(2, 11, 2000, 2100)
    journal.fault("pause-worker", 100, 2500, pid=1, slot=1)  # a long pause, yet nobody told

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: stale holder never told"]
    assert "fence 10" in verdict.violations[0].text


def test_a_told_stale_holder_paused_past_its_lease_is_excused() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told")
    journal.body(2, 11, 2000, 2100)
    journal.fault("pause-worker", 100, 2500, pid=1, slot=1)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["excused"] == {"told": 1}
    assert "SIGSTOP of pid 1" in verdict.excused[0]


def test_a_told_stale_holder_with_no_fault_to_explain_its_loss_is_a_violation() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told")
    journal.body(2, 11, 2000, 2100)
    journal.fault("pause-worker", 100, 400, pid=1, slot=1)  # shorter than a third of the ttl
    journal.fault("pause-worker", 2100, 2900, pid=1, slot=1)  # after the newer body entered
    journal.fault("cut-proxy", 1000, slot=1, server="r0")  # a cut costs a renewal at most

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]


def test_the_stale_holder_is_the_smaller_fence_even_when_its_journal_came_later() -> None:
    # Acquired first (fence 10), paused before it could write "enter": the newer
    # holder (fence 11) entered earlier. The stale one was told, and paused.
    journal = Journal()
    journal.body(2, 11, 1000, 1500)
    journal.body(1, 10, 1400, 1600, called=0, result="told")
    journal.fault("pause-worker", 50, 1390, pid=1, slot=1)

    verdict = journal.check()

    assert verdict.violations == []


def test_a_redis_restart_explains_losses_of_its_own_locks_only() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told", space="side", name="side:0")
    journal.body(2, 11, 2000, 2100, space="side", name="side:0")
    journal.body(1, 20, 0, 3000, result="told", space="quorum", name="q:hot")
    journal.body(2, 21, 2000, 2100, space="quorum", name="q:hot")
    journal.fault("restart-redis", 500, 600, server="side")

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "q:hot" in verdict.violations[0].text


def test_a_reset_explains_losses_of_the_lock_it_reset_only() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told", name="hot")
    journal.body(2, 11, 2000, 2100, name="hot")
    journal.body(1, 20, 0, 3000, result="told", name="a")
    journal.body(2, 21, 2000, 2100, name="a")
    journal.fault("reset", 500, 510, space="single", name="hot", held=True)

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "single:a" in verdict.violations[0].text


def test_a_loop_stall_explains_losses_of_async_bodies_only() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told", is_async=True)
    journal.body(2, 11, 2000, 2100)
    journal.body(1, 20, 0, 3000, result="told", name="a")
    journal.body(2, 21, 2000, 2100, name="a")
    journal.event("stall", 1, 1600, t0=at(100), t1=at(1600))

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "single:a" in verdict.violations[0].text


# -- shared bodies --------------------------------------------------------------------------------


def test_two_shared_bodies_overlapping_pass() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 300, shared=True)
    journal.body(2, 11, 100, 400, shared=True, kind="async-with", is_async=True)
    journal.body(3, 12, 150, 200, shared=True, kind="decorated")

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["shared overlaps"] == 3
    assert "overlaps" not in verdict.stats


def test_a_shared_and_an_exclusive_body_overlapping_with_no_fault_are_violations() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 300, shared=True)  # the stale one, never told
    journal.body(2, 11, 200, 400)
    journal.body(3, 20, 1000, 1300, name="a", result="told")  # the stale one: exclusive
    journal.body(4, 21, 1200, 1400, name="a", shared=True)

    verdict = journal.check()

    assert kinds(verdict) == [
        "overlap: lease lost without a fault to explain it",
        "overlap: stale holder never told",
    ]
    assert "single:a" in verdict.violations[0].text
    assert "[shared with" in verdict.violations[1].text


def test_a_shared_body_overlapping_an_exclusive_one_is_excused_only_by_a_fault() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, shared=True, result="told")
    journal.body(2, 11, 2000, 2100)
    journal.fault("pause-worker", 100, 2500, pid=1, slot=1)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["excused"] == {"told": 1}


def test_shared_bodies_of_a_quorum_lock_are_judged_as_on_one_redis() -> None:
    quorum = {"space": "quorum", "name": "q:hot"}
    journal = Journal()
    journal.body(1, 10, 0, 3000, shared=True, result="told", **quorum)
    journal.body(2, 11, 100, 400, shared=True, kind="async-with", is_async=True, **quorum)
    journal.body(3, 12, 2000, 2100, **quorum)  # beside the told reader: a master restarted
    journal.body(1, 20, 4000, 7000, shared=True, result="told", **quorum)
    journal.body(3, 21, 6000, 6100, **quorum)  # beside the told reader: nothing of its own
    journal.fault("restart-redis", 500, 600, server="m2")
    journal.fault("restart-redis", 4500, 4600, server="side")

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "fence 20" in verdict.violations[0].text
    assert verdict.stats["shared overlaps"] == 1
    assert verdict.stats["excused"] == {"told": 1}


def test_shared_bodies_may_enter_out_of_fence_order_but_two_never_share_a_fence() -> None:
    # Granted together (10, 11): each journals when its thread gets to it.
    journal = Journal()
    journal.body(1, 11, 0, 100, shared=True)
    journal.body(2, 10, 5, 100, shared=True)
    journal.body(3, 12, 200, 300)
    journal.body(1, 13, 400, 500, shared=True)
    journal.body(2, 13, 450, 550, shared=True)

    verdict = journal.check()

    assert sorted(kinds(verdict)) == ["fence handed out twice", "overlap: one fence, two bodies"]


def test_an_exclusive_fence_must_exceed_the_fences_of_shared_bodies_before_it() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 100, shared=True)
    journal.body(2, 14, 20, 150, shared=True)
    journal.body(3, 12, 200, 300)  # below 14, whose body left before this one entered
    journal.body(4, 20, 1000, 1100)
    journal.body(1, 19, 1200, 1300, shared=True)  # below 20, entered after it left
    journal.body(2, 21, 1050, 1500, shared=True, result="told", name="b")  # another lock

    verdict = journal.check()

    assert kinds(verdict) == ["fence went backwards", "fence went backwards"]
    assert "fence 14" in verdict.violations[0].text and "fence 12" in verdict.violations[0].text
    assert "fence 19" in verdict.violations[1].text and "fence 20" in verdict.violations[1].text


def test_an_exclusive_fence_above_every_earlier_shared_one_passes() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 100, shared=True)
    journal.body(2, 11, 20, 150, shared=True)
    journal.body(3, 12, 200, 300)
    journal.body(1, 13, 400, 500, shared=True)
    journal.body(2, 15, 420, 520, shared=True)
    journal.body(3, 16, 600, 700)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["fences against shared"] == 2
    assert verdict.stats["fences in order"] == 1


# -- killed holders -------------------------------------------------------------------------------


def test_a_killed_holder_ends_at_the_kill_so_a_later_holder_does_not_overlap_it() -> None:
    journal = Journal()
    journal.body(1, 10, 0, None)
    journal.body(2, 11, 2500, 2600)
    journal.fault("kill-worker", 1000, pid=1, slot=1)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["status"] == {"unknown": 1, "clean": 1}


def test_a_holder_killed_while_stopped_ends_when_it_stopped() -> None:
    journal = Journal()
    journal.body(1, 10, 0, None)
    journal.body(2, 11, 1800, 1900)
    journal.fault("pause-worker", 300, 2000, pid=1, slot=1)
    journal.fault("kill-worker", 2000, pid=1, slot=1, stopped_since=at(300))

    assert journal.check().violations == []


def test_a_killed_holder_overlapped_before_the_kill_needs_a_fault_to_explain_it() -> None:
    journal = Journal()
    journal.body(1, 10, 0, None)
    journal.body(2, 11, 500, 600)
    journal.fault("kill-worker", 1000, pid=1, slot=1)

    assert kinds(journal.check()) == ["overlap: lease lost without a fault to explain it"]


# -- the scenarios --------------------------------------------------------------------------------


def test_a_waiter_entering_on_a_hand_off_that_lapsed_in_its_loop_stall_is_a_violation() -> None:
    # H holds; W queues (called at 0); the loop stalls 200..1700; H releases at
    # 300 (the hand-off to W); C takes the lock once W's hand-off lapsed; W runs
    # again and enters beside C. W is told at exit and the stall explains a
    # loss, but the lapse happened inside W's acquire call.
    journal = Journal()
    journal.body(1, 10, -100, 290, kind="handoff-holder", scenario="s")
    journal.event("scenario", 1, 300, sc="s", role="release")
    journal.event("stall", 1, 1700, t0=at(200), t1=at(1700), scenario="s")
    journal.body(1, 12, 900, 2700, kind="handoff-competitor", scenario="s")
    journal.body(
        1, 11, 1705, 1760, kind="handoff-waiter", called=0, is_async=True, scenario="s",
        result="told",
    )  # fmt: skip

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: entered on a lapsed hand-off"]
    assert verdict.stats["handoff scenarios judged"] == 1


def test_a_waiter_that_waits_for_the_competitor_after_the_stall_passes() -> None:
    journal = Journal()
    journal.body(1, 10, -100, 290, kind="handoff-holder", scenario="s")
    journal.event("scenario", 1, 300, sc="s", role="release")
    journal.event("stall", 1, 1700, t0=at(200), t1=at(1700), scenario="s")
    journal.body(1, 12, 900, 2700, kind="handoff-competitor", scenario="s")
    journal.body(1, 13, 2701, 2760, kind="handoff-waiter", called=0, is_async=True, scenario="s")

    assert journal.check().violations == []


def test_a_body_that_joined_a_hold_handed_to_another_thread_is_a_violation() -> None:
    # The handed body (fence 10) is released by the other thread at 300; the
    # decorated body of the first thread got no grant of its own.
    journal = Journal()
    journal.body(1, 10, 0, 300, kind="handover")
    journal.body(1, 10, 50, 100, kind="after-handover", joined=True)

    assert sorted(kinds(journal.check())) == [
        "fence handed out twice",
        "overlap: one fence, two bodies",
    ]


def test_a_side_lock_lost_across_a_master_pause_with_its_own_redis_healthy_is_a_violation() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, space="side", name="side:0", kind="side-hold", result="told")
    journal.fault("pause-redis", 300, 2700, server="m2")

    assert kinds(journal.check()) == ["unrelated lock lost while a quorum master hung"]


def test_a_loss_learned_before_leaving_must_raise_at_a_block_exit() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 1000, kind="with")  # clean exit
    journal.signal(1, "hot", 10, 500)
    journal.body(1, 11, 1100, 2000, kind="acquire")  # release() answers for itself
    journal.signal(1, "hot", 11, 1500)
    journal.body(1, 12, 2100, 3000, kind="nested")  # told by the release, in the exit
    journal.signal(1, "hot", 12, 3000.5)

    verdict = journal.check()

    assert kinds(verdict) == ["loss hidden at exit", "loss hidden at exit"]
    assert "fence 10" in verdict.violations[0].text
    assert "while it exited" in verdict.violations[1].text


# -- fences and processes -------------------------------------------------------------------------


def test_fences_must_grow_over_clean_bodies_and_never_repeat() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 100)
    journal.body(2, 9, 200, 300)  # backwards, and never told
    journal.body(3, 7, 400, 500, result="told")  # told: out of the ordering
    journal.body(1, 12, 600, 700)
    journal.body(2, 12, 800, 900, name="a")  # another lock may reuse it

    assert kinds(journal.check()) == ["fence went backwards"]


def test_a_worker_that_vanished_without_being_killed_is_reported() -> None:
    journal = Journal()
    journal.body(1, 10, 0, None)

    assert sorted(kinds(journal.check(done=()))) == ["harness", "harness"]


# -- the data -------------------------------------------------------------------------------------


def test_increments_that_each_read_the_commit_before_them_pass() -> None:
    journal = Journal()
    first = journal.transaction(1, 10, 0, 100, 130, read=0)
    second = journal.transaction(2, 11, 131, 200, 220, read=1)  # waited for the COMMIT
    third = journal.transaction(1, 20, 300, 400, 420, read=0, name="a")

    verdict = journal.check(data=journal.committed(first, second, third))

    assert verdict.violations == []
    assert verdict.stats["data checked"] == 1
    assert verdict.stats["transactional bodies"] == 3
    assert verdict.stats["increments committed"] == 3
    assert verdict.stats["counters checked"] == 2
    assert verdict.stats["lost updates"] == 0


def test_a_lost_update_with_no_excused_overlap_is_a_violation() -> None:
    # The lock was given back at the end of the block (100), before the COMMIT
    # (150): the next holder read the old value. Code sections never overlapped.
    journal = Journal()
    stale = journal.transaction(1, 10, 0, 100, 150, read=0)
    newer = journal.transaction(2, 11, 110, 200, 210, read=0)
    # On lock "a" the stale one was told (its give-back found the lock gone),
    # but nothing could have cost it its lease.
    told = journal.transaction(1, 20, 1000, 1100, 1150, read=0, name="a", given_back=False)
    journal.signal(1, "a", 20, 1149)
    other = journal.transaction(2, 21, 1110, 1200, 1210, read=0, name="a")
    # A transaction killed before its COMMIT left only its intent.
    killed = journal.body(3, 30, 2000, None, kind="tx-with", name="b")
    journal.event("intent", 3, 2001, b=killed, lock="single:b", read=0)
    journal.fault("kill-worker", 2050, pid=3, slot=3)

    verdict = journal.check(data=journal.committed(stale, newer, told, other))

    assert kinds(verdict) == [
        "lost update without a fault to explain it",
        "lost update: stale holder never told",
    ]
    assert "fence 20" in verdict.violations[0].text
    assert "single:hot" in verdict.violations[1].text
    assert verdict.stats["lost updates"] == 2
    assert verdict.stats["increments rolled back"] == 1
    assert verdict.stats.get("overlaps", 0) == 0


def test_a_lost_update_explained_by_an_excused_overlap_passes() -> None:
    # Paused past its lease inside its transaction: the newer holder read and
    # committed meanwhile; the stale one then committed over it, and found its
    # lock gone when it gave it back.
    journal = Journal()
    stale = journal.transaction(1, 10, 0, 2010, 2020, read=0, given_back=False)
    journal.signal(1, "hot", 10, 2019)
    journal.fault("pause-worker", 50, 2000, pid=1, slot=1)
    newer = journal.transaction(2, 11, 1700, 1800, 1810, read=0)
    # Killed right after its COMMIT, before journalling it: the table tells.
    late = journal.body(3, 12, 2100, None, kind="tx-with")
    journal.event("intent", 3, 2101, b=late, lock="single:hot", read=1)
    journal.fault("kill-worker", 2200, pid=3, slot=3)

    verdict = journal.check(data=journal.committed(newer, stale, late))

    assert verdict.violations == []
    assert verdict.stats["lost updates"] == 1
    assert verdict.stats["lost updates excused"] == {"told": 1}
    assert verdict.stats["commits a kill kept out of the journal"] == 1
    excused = [text for text in verdict.excused if "without having read" in text]
    assert len(excused) == 1 and "SIGSTOP of pid 1" in excused[0]


def test_a_loss_known_as_a_kept_lock_exits_its_block_must_raise_there() -> None:
    # Told while the block ran, inside its transaction: the exit (before the
    # COMMIT) must raise LockLost, not return and let the transaction commit.
    journal = Journal()
    body = journal.transaction(1, 10, 0, 100, 150, read=0, given_back=False)
    journal.signal(1, "hot", 10, 50)
    # Told only by the give-back after the COMMIT: nothing to raise at the exit.
    later = journal.transaction(1, 11, 200, 300, 350, read=1, given_back=False)
    journal.signal(1, "hot", 11, 349)

    verdict = journal.check(data=journal.committed(body, later))

    assert kinds(verdict) == ["loss hidden at exit"]
    assert "fence 10" in verdict.violations[0].text


# -- Redis stalls, cancellations ------------------------------------------------------------------


def test_a_redis_sleep_past_a_third_of_the_lease_explains_losses_of_its_own_locks() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="told")
    journal.body(2, 11, 2000, 2100)
    journal.body(1, 20, 0, 3000, result="told", space="side", name="side:0")
    journal.body(2, 21, 2000, 2100, space="side", name="side:0")
    journal.fault("sleep-redis", 500, 1800, server="r0", seconds=1.3)

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "side:0" in verdict.violations[0].text
    assert "sleep-redis" in verdict.excused[0]


def test_a_cancelled_body_is_unconfirmed_and_overlaps_only_with_a_fault() -> None:
    # Cancelled inside its body: its exit raised CancelledError, so it never
    # learned whether it kept the lock; an overlap still needs a fault.
    journal = Journal()
    journal.body(1, 10, 0, 3000, result="cancelled", is_async=True)
    journal.body(2, 11, 2000, 2100)
    journal.body(1, 20, 0, 3000, result="cancelled", is_async=True, name="a")
    journal.body(2, 21, 2000, 2100, name="a")
    journal.fault("reset", 1000, 1010, space="single", name="a", held=True)

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: lease lost without a fault to explain it"]
    assert "single:hot" in verdict.violations[0].text
    assert "unconfirmed (cancelled)" in verdict.violations[0].text
    assert verdict.stats["excused"] == {"unconfirmed": 1}


def test_cancels_are_counted_by_where_they_found_the_child() -> None:
    journal = Journal()
    inside = journal.body(1, 10, 0, 100, result="cancelled", is_async=True)
    leaving = journal.body(1, 11, 200, 300, result="cancelled", is_async=True)
    journal.event("cancel", 1, 50, b=inside, phase="inside", n=1)
    journal.event("cancel", 1, 51, b=inside, phase="inside", n=2)
    journal.event("cancel", 1, 301, b=leaving, phase="leaving", n=1)
    journal.event("cancel", 1, 400, b=None, phase="waiting", n=1)
    journal.event("refused", 1, 401, space="single", name="hot", why="cancelled")

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["cancelled"] == {"inside": 1, "releasing": 1, "acquiring": 1}
    assert verdict.stats["repeated cancels"] == 1
    assert verdict.stats["refused"] == {"cancelled": 1}


# -- semaphores -----------------------------------------------------------------------------------


def test_as_many_permit_bodies_as_the_limit_may_overlap() -> None:
    journal = Journal()
    journal.body(1, -1, 0, 1000, name="sem", kind="sem-with", limit=2)
    journal.body(2, -1, 500, 1500, name="sem", kind="async-sem", limit=2, is_async=True)
    journal.body(3, -1, 1000, 2000, name="sem", kind="sem-with", limit=2)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["permit overlaps"] == 2
    assert "fences unique" not in verdict.stats  # a permit has no fence to check


def test_more_permit_bodies_than_the_limit_with_no_fault_are_a_violation() -> None:
    journal = Journal()
    journal.body(1, -1, 0, 1000, name="sem", kind="sem-with", limit=2)
    journal.body(2, -1, 100, 1000, name="sem", kind="sem-with", limit=2, result="told")
    journal.body(3, -1, 500, 600, name="sem", kind="async-sem", limit=2, is_async=True)

    verdict = journal.check()

    assert kinds(verdict) == ["permits: more holders than the limit"]
    assert "3 permit bodies at once" in verdict.violations[0].text
    assert "nothing in the run could have cost" in verdict.violations[0].text


def test_a_permit_over_the_limit_is_excused_by_a_told_holder_paused_past_its_lease() -> None:
    journal = Journal()
    journal.body(1, -1, 0, 3000, name="sem", kind="sem-with", limit=2, result="told")
    journal.body(2, -1, 100, 3000, name="sem", kind="sem-with", limit=2)
    journal.body(3, -1, 2500, 2600, name="sem", kind="sem-with", limit=2)
    journal.fault("pause-worker", 200, 2400, pid=1, slot=1)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["excused"] == {"permit told": 1}
    assert "SIGSTOP of pid 1" in verdict.excused[0]


def test_a_permit_of_a_quorum_semaphore_over_the_limit_is_excused_by_a_masters_fault() -> None:
    sem = {"space": "quorum", "name": "q:sem", "kind": "sem-with", "limit": 2}
    journal = Journal()
    journal.body(1, -1, 0, 3000, result="told", **sem)
    journal.body(2, -1, 100, 3000, **sem)
    journal.body(3, -1, 2500, 2600, **sem)  # a master stopped past the lease: excused
    journal.body(1, -1, 5000, 8000, result="told", **sem)
    journal.body(2, -1, 5100, 8000, **sem)
    journal.body(3, -1, 7500, 7600, **sem)  # only the side Redis stopped: not excused
    journal.fault("pause-redis", 200, 2400, server="m2")
    journal.fault("pause-redis", 5200, 7400, server="side")

    verdict = journal.check()

    assert kinds(verdict) == ["permits: more holders than the limit"]
    assert "+7.500s" in verdict.violations[0].text
    assert verdict.stats["excused"] == {"permit told": 1}
    assert "server m2" in verdict.excused[0]


def test_a_reset_of_the_semaphore_explains_lost_permits() -> None:
    journal = Journal()
    journal.body(1, -1, 0, 3000, name="sem", kind="sem-with", limit=2, result="told")
    journal.body(2, -1, 100, 3000, name="sem", kind="sem-with", limit=2)
    journal.body(3, -1, 2500, 2600, name="sem", kind="sem-with", limit=2)
    journal.fault("reset", 2000, 2010, space="single", name="sem", held=True)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["excused"] == {"permit told": 1}


# -- the mid hand-off stall -----------------------------------------------------------------------


def test_a_waiter_stalled_just_after_its_hand_over_must_not_enter_on_the_lapsed_lease() -> None:
    # "mid": H releases at 300 (the hand-over to W), the loop stalls from 305
    # for longer than the hand-over lease but less than the TTL; C takes the
    # lapsed lock, W enters beside it once its loop runs again.
    journal = Journal()
    journal.event("scenario", 1, -200, sc="s", role="start", variant="mid")
    journal.body(1, 10, -100, 290, kind="handoff-holder", scenario="s")
    journal.event("scenario", 1, 300, sc="s", role="release")
    journal.event("stall", 1, 5100, t0=at(305), t1=at(5100), scenario="s")
    journal.body(1, 12, 4400, 6500, kind="handoff-competitor", scenario="s")
    journal.body(
        1, 11, 5105, 5160, kind="handoff-waiter", called=0, is_async=True, scenario="s",
        result="told",
    )  # fmt: skip

    verdict = journal.check()

    assert kinds(verdict) == ["overlap: entered on a lapsed hand-off"]
    assert verdict.stats["handoff scenarios judged"] == 1


# -- orphans --------------------------------------------------------------------------------------


def test_a_lock_still_held_a_second_after_every_worker_went_idle_is_an_orphan() -> None:
    journal = Journal()
    journal.body(1, 10, 0, 100, result="cancelled", is_async=True)
    journal.events[-3]["owner"] = "task0-child"  # the owner record's task
    journal.orphan_phases = {"idle": at(30_000), "exited": at(32_000)}
    for when in (30_000, 30_500, 31_100):
        journal.held("idle", when)

    verdict = journal.check()

    assert kinds(verdict) == ["orphan: lock outlived its owner"]
    text = verdict.violations[0].text
    assert "single:hot (fence 10) still held 1.100s after every worker had run its last body" in (
        text
    )
    assert "owner record: host (pid 1, thread task0-child)" in text
    assert "its process was not killed" in text
    assert "fence 10" in text and "unconfirmed (cancelled)" in text  # its last body


def test_a_lock_given_back_within_the_grace_is_no_orphan() -> None:
    journal = Journal()
    journal.orphan_phases = {"idle": at(30_000), "exited": at(32_000)}
    journal.held("idle", 30_000)
    journal.held("idle", 30_900)
    journal.held("exited", 32_950)

    verdict = journal.check()

    assert verdict.violations == []
    assert verdict.stats["orphan check"] == 1
    assert verdict.stats["held after the run, explained"] == 2


def test_a_killed_owners_lock_may_outlive_it_by_a_wait_lease_and_its_lease_not_more() -> None:
    journal = Journal()
    journal.fault("kill-worker", 30_000, pid=1, slot=1)
    journal.fault("kill-worker", 25_000, pid=2, slot=2)
    journal.orphan_phases = {"idle": at(30_000), "exited": at(32_000)}
    # Past the grace (33 s); killed at 30 s, a wait lease and a lease explain it to 33.5 s.
    journal.held("exited", 33_400, pid=1, lease=1.5)
    journal.held("exited", 33_400, name="a", pid=2, lease=1.5)  # killed at 25 s: not

    verdict = journal.check()

    assert kinds(verdict) == ["orphan: lock outlived its owner"]
    assert "single:a" in verdict.violations[0].text
    assert "killed at +25.000s" in verdict.violations[0].text


def test_a_killed_owners_last_command_held_back_by_its_server_may_run_after_the_kill() -> None:
    # Redis runs what a killed process wrote once its pause ends: a renewal
    # or a check-in sent before the kill at 30 s may run at 31 s, so a wait
    # lease and a lease count from there (to 34.5 s), not from the kill.
    journal = Journal()
    journal.fault("pause-redis", 29_500, 31_000, server="r0")
    journal.fault("kill-worker", 30_000, pid=1, slot=1)
    journal.fault("pause-redis", 29_000, 31_500, server="m1")  # not the lock's server
    journal.fault("stall-proxy", 29_800, 32_500, server="r0", slot=2)  # not its path
    journal.orphan_phases = {"idle": at(30_000), "exited": at(32_000)}
    journal.held("exited", 34_400, pid=1, lease=1.5)
    journal.held("exited", 34_600, name="a", pid=1, lease=1.5)

    verdict = journal.check()

    assert kinds(verdict) == ["orphan: lock outlived its owner"]
    assert "single:a" in verdict.violations[0].text
    assert verdict.stats["held after the run, explained"] == 1


def test_a_permit_held_in_the_name_of_a_cancelled_child_that_ended_is_an_orphan() -> None:
    journal = Journal()
    journal.event("start", 1, -1000, slot=1)
    journal.child(1, "task0-c7", 1000, 500, 2500, 3100)  # the 500 ms sample: still running

    verdict = journal.check()

    assert kinds(verdict) == ["orphan: permit outlived its owner"]
    text = verdict.violations[0].text
    assert "permit single:sem (token t1) still held at +3.100s, 2.100s after its owner" in text
    assert "cancelled 2 time(s) (waiting)" in text
    assert "owner record: host (pid 1, thread task0-c7)" in text


def test_a_child_grant_may_outlast_a_redis_sleep_that_kept_its_give_back_away() -> None:
    journal = Journal()
    journal.event("start", 1, -1000, slot=1)
    journal.fault("sleep-redis", 500, 2800, server="r0", seconds=2.3)
    journal.child(1, "task0-c7", 1000, 4700)  # within 2 s of the sleep's end
    journal.child(1, "task0-c9", 1200, 5000)  # past it

    verdict = journal.check()

    assert kinds(verdict) == ["orphan: permit outlived its owner"]
    assert "task0-c9" in verdict.violations[0].text
    assert verdict.stats["held by an ended child, seen"] == 2


# -- the plan -------------------------------------------------------------------------------------


def test_a_seed_plans_the_same_faults_every_time_and_every_scenario_fits() -> None:
    for topology in TOPOLOGIES:
        plan = make_plan(7, topology, 25.0, TUNING)

        assert plan == make_plan(7, topology, 25.0, TUNING)
        assert plan != make_plan(8, topology, 25.0, TUNING)
        assert all(fault.at >= 2.5 and fault.at + fault.seconds <= 24.0 for fault in plan)
        variants = {fault.variant for fault in plan if fault.kind == "handoff-stall"}
        assert variants == set(HANDOFF_VARIANTS)
        assert any(fault.kind == "restart-redis" for fault in plan)
        sleeps = [fault for fault in plan if fault.kind == "sleep-redis"]
        assert sleeps
        assert all(fault.seconds > TUNING.socket_timeout for fault in sleeps)
        assert any(fault.kind == "nested-reset" for fault in plan)
        if topology == "quorum":
            assert any(fault.kind == "side-hold" for fault in plan)


# -- real runs ------------------------------------------------------------------------------------

SEED = int(os.environ.get("NEMESIS_SEED") or random.SystemRandom().randrange(1, 2**31))
RUN_SECONDS = float(os.environ.get("NEMESIS_SECONDS") or 25)


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_locks_keep_their_promises_under_a_random_fault_schedule(
    topology: str, postgres_server: PostgresServer
) -> None:
    report = run_nemesis(topology, RUN_SECONDS, SEED, postgres=postgres_server)

    context = (
        f"NEMESIS_SEED={SEED}; replay the plan with: uv run python scripts/nemesis.py "
        f"--seed {SEED} --topology {topology} --seconds {RUN_SECONDS:g}\n"
        f"{report.summary()}\n{report.describe_violations()}"
    )
    assert report.ok, context
    # The run did what it claims: many bodies of every kind, under every scenario.
    stats = report.verdict.stats
    assert stats.get("bodies", 0) >= 100, context
    assert stats["kinds"].get("handover", 0) > 0, context
    # Some bodies took their lock shared, and shared bodies met.
    assert stats.get("shared bodies", 0) >= 20, context
    assert stats.get("shared overlaps", 0) > 0, context
    # Read-modify-writes in transactions ran, and the database was checked.
    assert stats.get("data checked") == 1, context
    assert stats.get("transactional bodies", 0) >= 20, context
    assert stats.get("increments committed", 0) >= 20, context
    assert stats.get("counters checked", 0) == len(report.info.data.counters), context
    faults = report.faults_by_kind()
    assert faults["handoff-stall"] >= 1, context
    assert faults["nested-reset"] >= 1, context
    # Redis slept past the socket timeout, and a waiter's loop stalled between
    # its hand-over lease and its TTL.
    assert faults["sleep-redis"] >= 1, context
    variants = {r.note for r in report.info.faults if r.kind == "handoff-stall"}
    assert "mid" in variants, context
    # Tasks were cancelled while acquiring, inside and releasing, some twice.
    cancelled = stats.get("cancelled", {})
    assert all(cancelled.get(where, 0) > 0 for where in ("acquiring", "inside", "releasing")), (
        context
    )
    assert stats.get("repeated cancels", 0) > 0, context
    # Permits were taken, beside one another, and checked against the limit.
    assert stats.get("permit bodies", 0) >= 20, context
    assert stats.get("permit overlaps", 0) > 0, context
    # The orphan check looked while the workers were idle and after they exited.
    assert stats.get("orphan check") == 1, context
    assert set(report.info.orphan_phases) == {"idle", "exited"}, context
    if topology == "quorum":
        assert faults["side-hold"] >= 1, context
