"""pipeline/schedules/program.py: each rank's step as data (listings, the rules, the errors)."""

from __future__ import annotations

import gc

import pytest

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.program import Collective, Free, Post, Reduce, ReduceWait, Wait
from pipeline.schedules.registry import entry
from pipeline.schedules.schedule import SCHEDULES, Schedule, forward_only, schedule

# with dp = 2: each stage's reduction starts after its last gradient compute, and the tail waits
LISTINGS = {
    ("1f1b", 2, 3, 1): [
        """
        0F0
        post 0SEND_F0 0RECV_B0
        0F1
        post 0SEND_F1 0RECV_B1
        wait 0RECV_B0
        free 0SEND_F0
        0B0
        0F2
        post 0SEND_F2 0RECV_B2
        wait 0RECV_B1
        free 0SEND_F1
        0B1
        wait 0RECV_B2
        free 0SEND_F2
        0B2
        reduce 0
        wait reduce 0
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
        """
        post 1RECV_F0
        post 1RECV_F1
        wait 1RECV_F0
        1F0
        1B0
        post 1SEND_B0 1RECV_F2
        wait 1RECV_F1
        1F1
        1B1
        post 1SEND_B1
        wait 1RECV_F2
        free 1SEND_B0
        1F2
        1B2
        reduce 1
        post 1SEND_B2
        free 1SEND_B1 1SEND_B2
        wait reduce 1
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
    ],
    ("gpipe", 2, 2, 1): [
        # 0RECV_B0 is not posted ahead of 0F1: rank 1's 1B0 comes after 1F1, which needs 0SEND_F1
        # (a device-wide sync while 0F1 is queued would wait on it for ever)
        """
        0F0
        post 0SEND_F0
        0F1
        post 0SEND_F1 0RECV_B0 0RECV_B1
        wait 0RECV_B0
        free 0SEND_F0 0SEND_F1
        0B0
        wait 0RECV_B1
        0B1
        reduce 0
        wait reduce 0
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
        """
        post 1RECV_F0
        post 1RECV_F1
        wait 1RECV_F0
        1F0
        wait 1RECV_F1
        1F1
        1B0
        post 1SEND_B0
        1B1
        reduce 1
        post 1SEND_B1
        free 1SEND_B0 1SEND_B1
        wait reduce 1
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
    ],
    ("zb-h1", 2, 2, 1): [
        """
        0F0
        post 0SEND_F0 0RECV_B0
        0F1
        post 0SEND_F1 0RECV_B1
        wait 0RECV_B0
        free 0SEND_F0
        0B0
        0W0
        wait 0RECV_B1
        free 0SEND_F1
        0B1
        0W1
        reduce 0
        wait reduce 0
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
        None,
    ],
    ("interleaved-1f1b", 2, 2, 2): [
        """
        0F0
        post 0SEND_F0 2RECV_F0
        0F1
        post 0SEND_F1 2RECV_F1
        wait 2RECV_F0
        free 0SEND_F0
        2F0
        post 2SEND_F0 2RECV_B0
        wait 2RECV_F1
        free 0SEND_F1
        2F1
        post 2SEND_F1 2RECV_B1
        wait 2RECV_B0
        free 2SEND_F0
        2B0
        post 2SEND_B0 0RECV_B0
        wait 2RECV_B1
        free 2SEND_F1
        2B1
        reduce 2
        post 2SEND_B1 0RECV_B1
        wait 0RECV_B0
        free 2SEND_B0
        0B0
        wait 0RECV_B1
        free 2SEND_B1
        0B1
        reduce 0
        wait reduce 2
        wait reduce 0
        broadcast loss 1 0,1
        all_reduce loss replicas
        """,
        None,
    ],
}


def _text(listing: str) -> str:
    return "\n".join(line.strip() for line in listing.strip().splitlines())


@pytest.mark.parametrize("case", sorted(LISTINGS), ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}")
def test_the_listing_of_small_cases(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    sched = schedule(name, p, m, n_virtual=v)
    for r, listing in enumerate(LISTINGS[case]):
        if listing is not None:
            assert sched.program(r, dp=2).to_text() == _text(listing), f"rank {r}"
            assert str(sched.program(r, dp=2)) == _text(listing)


def _cases() -> list[tuple[str, int, int, int]]:
    out = []
    for name in SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in (p, 2 * p, 2 * p + 1):
                v = entry(name).min_virtual
                if entry(name).m_multiple_of_p and m % p:
                    continue
                out.append((name, p, m, v))
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}")
def test_every_message_is_posted_waited_and_freed_once_in_that_order(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    sched = schedule(name, p, m, n_virtual=v)
    for r in range(p):
        program = sched.program(r, dp=2)
        assert program.compute() == list(sched.compute[r])  # the schedule's row, in its order
        lowered = sched.lowered()[r]
        posted: dict[Action, int] = {}
        waited: dict[Action, int] = {}
        freed: dict[Action, int] = {}
        reduced: dict[int, int] = {}
        for k, x in enumerate(program):
            if isinstance(x, Post):
                assert x.sends or x.recvs, "an empty post"
                for a in (*x.sends, *x.recvs):
                    assert a not in posted, f"{a} posted twice"
                    posted[a] = k
            elif isinstance(x, Wait):
                assert x.recv in posted and x.recv not in waited
                waited[x.recv] = k
                nxt = program.instructions[k + 1]
                if isinstance(nxt, Free):
                    nxt = program.instructions[k + 2]
                assert isinstance(nxt, Action) and nxt.stage == x.recv.stage  # the compute it feeds
                assert nxt.kind is (Kind.F if x.recv.kind is Kind.RECV_F else Kind.B)
            elif isinstance(x, Free):
                for a in x.sends:
                    assert a.kind.is_send and posted[a] < k and a not in freed
                    freed[a] = k
            elif isinstance(x, Reduce):
                assert x.stage not in reduced
                reduced[x.stage] = k
        comm = [a for a in lowered if not a.kind.is_compute]
        assert set(posted) == set(comm)
        assert set(waited) == {a for a in comm if a.kind.is_recv}
        assert set(freed) == {a for a in comm if a.kind.is_send}
        # a stage's gradients are reduced after its last gradient compute, and only then
        last = Kind.W if sched.split_backward else Kind.B
        for s in sched.stages_of(r):
            final = max(k for k, x in enumerate(program) if isinstance(x, Action) and x.stage == s
                        and x.kind is last)  # fmt: skip
            assert reduced[s] == final + 1
        # the tail: every local stage's reduction waited for, then the loss over the pipeline and replicas
        tail = program.tail()
        started = [x.stage for x in program if isinstance(x, Reduce)]
        assert [x.stage for x in tail if isinstance(x, ReduceWait)] == started
        assert sorted(started) == sched.stages_of(r)
        loss = [x for x in tail if isinstance(x, Collective)]
        assert loss[-1] == Collective("all_reduce", "loss", ())
        if p > 1:
            assert loss[-2] == Collective("broadcast", "loss", tuple(range(p)), root=sched.rank_of(p * v - 1))
        assert program.instructions[: len(program) - len(tail)][-1] not in tail


def test_without_replicas_or_ties_the_tail_is_the_loss_alone() -> None:
    sched = schedule("1f1b", 2, 2)
    for r in range(2):
        program = sched.program(r)
        assert not [x for x in program if isinstance(x, Reduce | ReduceWait)]
        assert program.tail() == (Collective("broadcast", "loss", (0, 1), root=1),)
    assert schedule("1f1b", 1, 2).program(0).tail() == ()  # one rank: nothing to share


def test_tied_weights_reduce_once_per_group_of_ranks_in_the_order_found() -> None:
    """Ties over stages (0, 3) and (1, 3) and (0, 3) again, on 4 ranks: two groups, the first tie's
    first; a tie within one rank (stages 0 and 4 with v = 2) needs no collective."""
    sched = schedule("interleaved-1f1b", 4, 4, n_virtual=2)
    ties = [(0, 3), (1, 3), (3, 0), (0, 4)]
    tails = [[str(x) for x in sched.program(r, ties=ties).tail()] for r in range(4)]
    loss = "broadcast loss 3 0,1,2,3"
    assert tails == [
        ["all_reduce ties 0,3", loss],
        ["all_reduce ties 1,3", loss],
        [loss],
        ["all_reduce ties 0,3", "all_reduce ties 1,3", loss],
    ]
    assert sched.program(0, ties=ties) is sched.program(0, ties=[list(t) for t in ties])  # derived once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 0}, r"dp \(0\) must be an integer >= 1"),
        ({"dp": True}, r"dp \(True\) must be an integer >= 1"),
        ({"ties": [(0, 2)]}, r"tie \(0, 2\) must be a sequence of stage indices in \[0, 2\)"),
        ({"ties": ["ab"]}, r"tie 'ab' must be a sequence of stage indices"),
        ({"ties": [3]}, r"tie 3 must be a sequence of stage indices"),
    ],
)
def test_bad_replicas_or_ties_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schedule("1f1b", 2, 2).program(0, **kwargs)  # type: ignore[arg-type]


def test_a_send_is_freed_at_the_wait_of_the_first_message_its_peer_sends_back() -> None:
    """1F1B on 2 ranks: rank 1 sends 1SEND_B{i} only after consuming 0SEND_F{i}."""
    program = schedule("1f1b", 2, 4).program(0)
    for i in range(4):
        k = program.instructions.index(Wait(Action(0, Kind.RECV_B, i)))
        assert program.instructions[k + 1] == Free((Action(0, Kind.SEND_F, i),))


def test_a_forward_only_schedule_has_no_reduction() -> None:
    sched = forward_only(schedule("1f1b", 2, 2))
    assert not [x for r in range(2) for x in sched.program(r) if isinstance(x, Reduce)]


@pytest.mark.parametrize("rank", [-1, 2, 1.0, True, "0"])
def test_a_rank_outside_the_schedule_is_refused(rank: object) -> None:
    with pytest.raises(ValueError, match=r"rank .* must be an integer in \[0, 2\)"):
        schedule("1f1b", 2, 2).program(rank)  # type: ignore[arg-type]


def test_derived_once_per_schedule() -> None:
    sched = schedule("1f1b", 4, 8)
    assert sched.program(3) is sched.program(3)


def test_custom_schedules_get_a_program_too() -> None:
    sched = Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1")
    assert sched.program(1).compute() == list(sched.compute[1])


@pytest.mark.parametrize("collector_on", [True, False])
def test_deriving_leaves_the_cycle_collector_as_it_found_it(collector_on: bool) -> None:
    # derivation pauses the collector (tens of thousands of acyclic objects); it must come back on,
    # and must not be turned on where the caller had it off
    was = gc.isenabled()
    try:
        gc.enable() if collector_on else gc.disable()
        schedule("1f1b", 4, 4).programs()
        assert gc.isenabled() is collector_on
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_stage_reduces_once_right_after_its_last_gradient_compute(name: str) -> None:
    # the reduction over the replicas reads final gradients: after the stage's last W where the
    # backward is split (its last B leaves the weight gradients unfinished), its last B otherwise
    e = entry(name)
    for p in (1, 2, 3, 4):
        for m in (p, 2 * p + (0 if e.m_multiple_of_p else 1)):
            sched = schedule(name, p, m, n_virtual=e.min_virtual)
            last = Kind.W if sched.split_backward else Kind.B
            for r in range(p):
                xs = sched.program(r, dp=2).instructions
                for s in sched.stages_of(r):
                    at = [k for k, x in enumerate(xs) if x == Reduce(s)]
                    assert len(at) == 1, (name, p, m, r, s)
                    computes = [k for k, x in enumerate(xs) if isinstance(x, Action) and x.stage == s]
                    finals = [k for k in computes if xs[k].kind is last]  # type: ignore[union-attr]
                    assert at[0] == max(finals) + 1 and max(computes) < at[0], (
                        name,
                        p,
                        m,
                        r,
                        s,
                        xs[max(finals)],
                    )
