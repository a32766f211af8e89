"""Per-rank compute orders of the built-in schedules.

    # p: ranks, v: stages per rank, m: micro-batches, r: rank, i: micro-batch, c: chunk,
    # t: position in a rank's order

Each generator returns, per rank, the ordered F/B/W actions; ``schedule.schedule``
wraps them in a ``Schedule`` and validates it.  Pictures for p = 4, m = 8 on rank r
(numbers are micro-batches; ``trace.render_grid`` draws the timed version)::

    gpipe       F0 F1 .. F7 B0 B1 .. B7
    1f1b        warm-up p-r-1 forwards, then F B pairs, then the remaining backwards
                r=0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    zb-h1       1f1b with B split into B and W; rank r delays its first r W's, which
                then fill the cool-down bubbles (at most p micro-batches in flight)
                r=3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 ... B7 W4 W5 W6 W7
    interleaved-zb   interleaved-1f1b with B split the same way (rank r's W's delayed by r)
    zb-v, dualpipe-v, v-half, v-min   two stages per rank in a V: timed grids in their docstrings
"""

from __future__ import annotations

import functools
import heapq

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.placement import rank_of

__all__ = [
    "dualpipe_v",
    "gpipe",
    "in_message_order",
    "interleaved_1f1b",
    "interleaved_zb",
    "one_f_one_b",
    "v_half",
    "v_min",
    "zb_h1",
    "zb_v",
]

Orders = tuple[tuple[Action, ...], ...]


def gpipe(p: int, m: int) -> Orders:
    """All forwards, then all backwards, in micro-batch order."""
    return tuple(
        tuple([Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)])
        for r in range(p)
    )


def _one_f_one_b_rank(r: int, p: int, m: int) -> list[tuple[Kind, int]]:
    # Rank r keeps at most p - r micro-batches in flight: warm-up, steady F/B pairs, cool-down.
    warmup = min(p - r - 1, m)
    order = [(Kind.F, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(Kind.F, warmup + i), (Kind.B, i)]
    order += [(Kind.B, i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Orders:
    """Non-interleaved 1F1B (PipeDream-flush): at most p - r activations on rank r, any m >= 1."""
    return tuple(tuple(Action(r, kind, i) for kind, i in _one_f_one_b_rank(r, p, m)) for r in range(p))


def zb_h1(p: int, m: int) -> Orders:
    """ZB-H1 (Qi et al. 2023): 1F1B order over F and B, with rank r's W's delayed by r.

    Rank r holds p - r micro-batches for 1F1B plus r whose W is pending: at most p.
    The delayed W's run in the cool-down, where 1F1B would leave rank r idle.
    """
    return _delayed_weights(one_f_one_b(p, m), list(range(p)))


def _delayed_weights(orders: Orders, delays: list[int]) -> Orders:
    """``orders`` with each B's W split off: rank r runs the W of its k-th B right after its
    (k + delays[r])-th B (in B order), the rest at its end, where they fill the cool-down."""
    out = []
    for r, actions in enumerate(orders):
        row: list[Action] = []
        pending: list[Action] = []
        for a in actions:
            row.append(a)
            if a.kind is Kind.B:
                pending.append(a)
                if len(pending) > delays[r]:
                    b = pending.pop(0)
                    row.append(Action(b.stage, Kind.W, b.microbatch))
        row += [Action(b.stage, Kind.W, b.microbatch) for b in pending]
        out.append(tuple(row))
    return tuple(out)


def interleaved_1f1b(p: int, v: int, m: int) -> Orders:
    """Megatron's interleaved 1F1B: rank r runs stages r, r + p, ..., r + (v-1)p.

    The m * v forwards of a rank run in groups of p micro-batches per stage, sweeping
    the rank's stages front to back; backwards sweep them back to front.  Needs m to be
    a multiple of p so that every group is full (``schedule_options`` checks it).
    """
    total = m * v

    def _action(t: int, kind: Kind, r: int) -> Action:
        c = (t % (p * v)) // p
        if kind is Kind.B:
            c = v - 1 - c
        return Action(c * p + r, kind, (t // (p * v)) * p + t % p)

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        out = [_action(t, Kind.F, r) for t in range(warmup)]
        for t in range(total - warmup):
            out += [_action(warmup + t, Kind.F, r), _action(t, Kind.B, r)]
        out += [_action(t, Kind.B, r) for t in range(total - warmup, total)]
        orders.append(tuple(out))
    return tuple(orders)


def interleaved_zb(p: int, v: int, m: int) -> Orders:
    """Interleaved zero-bubble: interleaved 1F1B over F and B, B split into B and W, rank r's W's
    delayed by r as in ZB-H1. Simulated with F = B = W (p = 4, v = 2, m = 8): 51 units against
    interleaved 1F1B's 57 and the ideal 48; the same delays beat 0, r * v and p - 1 - r at
    p = 2..8, v = 2, 3."""
    return _delayed_weights(interleaved_1f1b(p, v, m), list(range(p)))


def zb_v(p: int, v: int, m: int) -> Orders:
    """ZB-V (Qi et al. 2024): two stages per rank placed in a V (rank r holds stages r and
    2p - 1 - r, so the turn, stages p - 1 and p, is on rank p - 1 and needs no message), B split
    into B and W, at most 2p stage activations per rank for any m: 1F1B's peak (its rank 0 holds p
    micro-batches of a whole stage, 2p of these half-size ones; min(m, p) of them for m < p).

    From m = 2p - 1 on, the paper's order (torch's ``ScheduleZBVZeroBubble``), put in our channels'
    message order, W's moved into the gaps that leaves; from m = p, its F's and B's with the W's
    placed anew; fewer micro-batches, a list schedule (``_zb_v``). p = 4, m = 8 (F/B/W: rank r's
    stage r, f/b/w: its stage 2p - 1 - r; '.': idle) at F = B = W = 1: 51 units, the bound
    6m + p - 1 (rank p - 1 waits p - 1 units for its first input; ideal 48, interleaved-1f1b 57,
    zb-h1 54 at equal work), 2p = 8 held:

        r=0  FFFF...fbFwfbFwfbFwfbwFBWfbwBWfbwBWfbwBWfbwBWBWBWBW
        r=1  .FFFF.f.fbFwfbFwfbwFBWfbwFBWfbwBWfbwBWfbwBbBWBWBWwW
        r=2  ..FFFfFf.fbFwfbwFBWfbwFBWfbwFBWfbwBWfbwBbBWbBWBwwWW
        r=3  ...FfFfFfFfbwFBWfbwFBWfbwFBWfbwFBWfbwBbBWbBwbBwwWWW

    From m = p on the bubble (the step less a rank's work) is p - 1 at F = B = W = 1 and 2(p - 1)
    at F = 2B = 2W, the bound either way (rank p - 1 waits p - 1 forwards for its first input), and
    it does not grow with m at unequal costs. At every p <= 16, m <= 4p + 3 and those two costs and
    F = B = 2W it is no longer than the greedy order's this replaced, which held 3p - 1 (1.375x 1F1B
    at p = 4, 1.44x at p = 8; tests/test_zb_v.py, BENCHMARKS.md).
    """
    if v != 2:
        raise ValueError(f"zb-v places exactly 2 stages per rank, got n_virtual={v}; pass n_virtual=2")
    return _zb_v(p, m)


# F, B, W in time units, the costs p <= m < 2p - 1 places its W's at: so placed, the bubble is the
# bound at F = B = W (p - 1) and at F = 2B = 2W (2(p - 1)); placed at F = B = W, 3(p - 1) at
# F = 2B = 2W, and the list schedule zb-v ran there before, up to 113 units at p = 16 (BENCHMARKS.md).
_F_2B_2W = (2, 1, 1)


# a rank's forwards whose W has not run: an F holds one more, its W frees it
_HOLDS = {Kind.F: 1, Kind.B: 0, Kind.W: -1}


@functools.cache  # the auto search asks again for each candidate
def _zb_v(p: int, m: int) -> Orders:
    """m >= 2p - 1: the paper's order (``_zb_v_paper``), each rank pair's messages in the order they
    are sent (``in_message_order``), W's moved into the gaps that leaves (``_weights_into_gaps``).
    p <= m < 2p - 1, where the paper's steady state is never reached: its F's and B's in the same
    message order, every W taken out and brought back only where it fills a gap or frees the cap,
    played at F = 2B = 2W (``_F_2B_2W``). m < p: a list schedule (``_zb_v_listed``)."""
    if m >= 2 * p - 1:
        return _weights_into_gaps(in_message_order(_zb_v_paper(p, m), p, "zb-v"), p)
    if m >= p:
        return _weights_into_gaps(_weights_last(in_message_order(_zb_v_paper(p, m), p, "zb-v")), p, _F_2B_2W)
    return _zb_v_listed(p, m)


def _zb_v_paper(p: int, m: int) -> list[list[Action]]:
    """The ZB-V paper's order (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble``): rank r,
    stage d = r going down and u = 2p - 1 - r coming back, runs six phases; a B's W right after it
    unless deferred, the deferred ones run oldest first:

        1  2(p - r) - 1 x  F d                 warm-up: 2p - r - 1 forwards on d ...
        2  r x             F u, F d            ... and r on u, 2p - 1 held
        3  p - r x         F u, B u, W u       the first backwards from the V's end, at 2p held
        4  until m F's     F d, B d, W d, F u, B u, W u   steady: an F in, a W out, 2p held
        5  r x             B d, B u            cool-down, W's deferred...
        6  p - r x         B d, W (oldest d)   ...and the rest of them last, u's first

    Planned for max(m, 2p - 1) micro-batches (the warm-up's) with the others left out."""
    n = max(m, 2 * p - 1)
    return [[a for a in _zb_v_paper_rank(r, p, n) if a.microbatch < m] for r in range(p)]


def _zb_v_paper_rank(r: int, p: int, n: int) -> list[Action]:
    d, u = r, 2 * p - 1 - r
    out: list[Action] = []
    count: dict[tuple[int, Kind], int] = {}  # (stage, F or B) -> the next micro-batch
    deferred: dict[int, list[Action]] = {d: [], u: []}  # per stage, the W's of deferred B's

    def run(stage: int, kind: Kind, defer: bool = False) -> None:
        i = count.get((stage, kind), 0)
        count[stage, kind] = i + 1
        out.append(Action(stage, kind, i))
        if kind is Kind.B:
            (deferred[stage] if defer else out).append(Action(stage, Kind.W, i))

    for _ in range(2 * (p - r) - 1):
        run(d, Kind.F)
    for _ in range(r):
        run(u, Kind.F)
        run(d, Kind.F)
    for _ in range(p - r):
        run(u, Kind.F)
        run(u, Kind.B)
    while count[u, Kind.F] < n:
        if count[d, Kind.F] < n:
            run(d, Kind.F)
        run(d, Kind.B)
        run(u, Kind.F)
        run(u, Kind.B)
    for _ in range(r):
        run(d, Kind.B, defer=True)
        run(u, Kind.B, defer=True)
    for _ in range(p - r):
        run(d, Kind.B, defer=True)
        out.append(deferred[d].pop(0))
    return out + deferred[u] + deferred[d]


def _v_cap(p: int) -> int:
    """The stage activations a zb-v rank may hold: 1F1B's rank 0's p micro-batches of a whole stage,
    2p of these half-size ones."""
    return 2 * p


def _weights_last(orders: Orders) -> Orders:
    """Each rank's W's taken out of ``orders`` and put after its last F or B, in its B's order: with
    ``_weights_into_gaps`` a W then runs only where it fills a gap, or frees the cap for an F."""
    return tuple(
        tuple([a for a in row if a.kind is not Kind.W] + [Action(a.stage, Kind.W, a.microbatch)
                                                          for a in row if a.kind is Kind.B])
        for row in orders
    )  # fmt: skip


def _weights_into_gaps(orders: Orders, p: int, ticks: tuple[int, int, int] = (1, 1, 1)) -> Orders:
    """``orders`` played with an F, a B and a W taking ``ticks`` time units, each rank running, where its
    next action cannot run yet (its inputs have not arrived, or it is an F and the rank holds
    ``_v_cap(p)``), the first W further on whose B has run instead of idling (the cool-down's deferred
    W's fill the gaps a message order leaves). Only W's move, and only earlier: no message changes
    places, no rank holds more than ``orders`` did, nor more than the cap."""
    k, cap = 2 * p, _v_cap(p)
    cost = {Kind.F: ticks[0], Kind.B: ticks[1], Kind.W: ticks[2]}
    rows = [list(row) for row in orders]
    place = {a: (r, t) for r, row in enumerate(rows) for t, a in enumerate(row)}
    # actions as (rank, position): what each waits for, and each B's W (a rank's W's are its own)
    needs = [
        [[place[d] for d in (a.needs if a.kind is not Kind.F or a.stage > 0 else ()) if 0 <= d.stage < k]
         for a in row]
        for row in rows
    ]  # fmt: skip
    weight_of = {place[a]: place[Action(a.stage, Kind.W, a.microbatch)] for a in place if a.kind is Kind.B}
    started = [[False] * len(row) for row in rows]
    ended = [[False] * len(row) for row in rows]
    at = [0] * p  # each rank's first action not yet started
    free: list[list[int]] = [[] for _ in range(p)]  # per rank, a heap: positions of W's whose B has ended
    held = [0] * p  # forwards whose W has not started
    busy = [0] * p  # the time each rank is free from
    ends: dict[int, list[tuple[int, int]]] = {}  # time -> (rank, position) of the actions ending then
    out: list[list[Action]] = [[] for _ in range(p)]
    now, left = 0, sum(len(row) for row in rows)
    while left:
        for r, t in ends.pop(now, ()):
            ended[r][t] = True
            w = weight_of.get((r, t))
            if w is not None:
                heapq.heappush(free[r], w[1])
        for r, row in enumerate(rows):
            if busy[r] > now:
                continue
            while at[r] < len(row) and started[r][at[r]]:
                at[r] += 1
            if at[r] == len(row):
                continue
            t = at[r]
            if not all(ended[q][u] for q, u in needs[r][t]) or (row[t].kind is Kind.F and held[r] >= cap):
                heap = free[r]
                while heap and started[r][heap[0]]:  # run in its own turn since
                    heapq.heappop(heap)
                if not heap:
                    continue
                t = heapq.heappop(heap)
            a = row[t]
            started[r][t] = True
            held[r] += _HOLDS[a.kind]
            busy[r] = now + cost[a.kind]
            ends.setdefault(busy[r], []).append((r, t))
            out[r].append(a)
            left -= 1
        if left and not ends:
            raise RuntimeError(f"zb-v's order cannot run at p={p}")
        now += 1  # ticks are whole units
    return tuple(tuple(row) for row in out)


def _zb_v_listed(p: int, m: int, cap: int | None = None) -> Orders:
    """zb-v's order for m < p, a list schedule at unit costs: each time unit, every rank runs its
    oldest ready B, else its oldest ready F while it holds fewer than ``cap`` forwards whose W has not
    run, else its oldest pending W, else (at the cap) an F whose input waits on a rank pair, which
    frees the messages queued behind it, else idles; the later stage first of equals. A rank takes a
    message only when it is the oldest unconsumed one on its rank pair (sends and receives are posted
    in the same order; in a V one pair carries forwards and backwards both ways).

    zb-v needs no cap for m < p (None): a rank holds at most its two stages' m micro-batches, 2m,
    1F1B's 2 min(p, m). With cap = 2p + 1 this is the greedy order zb-v ran at every m before (commit
    3498704; from m = p on the cap binds, and a rank held up to 3p - 1), which tests/test_zb_v.py and
    scripts/bench_schedules.py compare it with."""
    k = 2 * p

    def rank(s: int) -> int:
        return rank_of("v", p, s)

    stages = [sorted((r, k - 1 - r), reverse=True) for r in range(p)]  # the later stage first
    ran_f = [0] * k  # per stage: micro-batches whose F (B) ran, in micro-batch order
    ran_b = [0] * k
    done: set[Action] = set()
    channel: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> sent, not yet consumed
    held = [0] * p  # forwards whose W has not run
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = 3 * k * m

    def ready(a: Action, r: int) -> bool:
        if a.kind is Kind.B and ran_f[a.stage] <= a.microbatch:
            return False  # its own F has not run
        d = _input_of(a, k)
        if d is None:
            return True
        if d not in done:
            return False
        src = rank(d.stage)
        return src == r or channel[(src, r)][0] == d

    def oldest(kind: Kind, r: int, received: bool = False) -> Action | None:
        ran = ran_f if kind is Kind.F else ran_b
        found = [
            a
            for s in stages[r]
            if ran[s] < m
            and ready(a := Action(s, kind, ran[s]), r)
            and (not received or ((d := _input_of(a, k)) is not None and rank(d.stage) != r))
        ]
        return min(found, key=lambda a: a.microbatch, default=None)  # the first of equals: later stage

    while len(done) < total:
        picks: list[tuple[int, Action]] = []
        for r in range(p):
            pick = oldest(Kind.B, r)
            if pick is None and (cap is None or held[r] < cap):
                pick = oldest(Kind.F, r)
            if pick is None and pending_w[r]:
                pick = pending_w[r].pop(0)
            if pick is None and cap is not None:
                pick = oldest(Kind.F, r, received=True)
            if pick is not None:
                picks.append((r, pick))
                if pick.kind is Kind.F:
                    ran_f[pick.stage] += 1
                elif pick.kind is Kind.B:
                    ran_b[pick.stage] += 1
        if not picks:
            raise RuntimeError(f"zb-v's list schedule stalls at p={p}, m={m}")
        for r, a in picks:
            d = _input_of(a, k)
            if d is not None and rank(d.stage) != r:
                channel[(rank(d.stage), r)].pop(0)
            orders[r].append(a)
            held[r] += _HOLDS[a.kind]
            if a.kind is Kind.B:
                pending_w[r].append(Action(a.stage, Kind.W, a.microbatch))
        for r, a in picks:  # what finished this unit: ready for the next
            done.add(a)
            out = a.stage + 1 if a.kind is Kind.F else a.stage - 1
            if a.kind is not Kind.W and 0 <= out < k and rank(out) != r:
                channel.setdefault((r, rank(out)), []).append(a)
    return tuple(tuple(row) for row in orders)


def dualpipe_v(p: int, v: int, m: int) -> Orders:
    """DualPipeV (DeepSeek's DualPipe folded into a V; torch's ``ScheduleDualPipeV``): zb-v's
    placement, B split into B and W. Each rank r (stages d = r, going down, and u = 2p - 1 - r,
    coming back) runs eight phases; ``F d + B u`` marks a pair DualPipeV overlaps (one micro-batch's
    forward beside another's backward), which we run as the two actions in that order, and a B
    with its W right after is DualPipeV's unsplit backward:

        1  2(p - r - 1) x  F d                       warm-up on the first chunk
        2  r + 1        x  F d, F u
        3  p - r - 1    x  B u, W u, F u             (zero bubble: the W fills the wait)
        4  m - 2p + r + 1 x  F d + B u W u, F u + B d W d    steady state, two pairs
        5  p - r - 1    x  B u W u, F u + B d W d
        6  r + 1        x  B u, B d                  from the middle on the W's are deferred...
        7  p - r - 1    x  W (oldest deferred), B d  ...and fill the cool-down
        8  r + 1        x  W (oldest deferred)

    p = 4, m = 8 at F = B = W = 1 (F/B/W: stage d, f/b/w: stage u; '.': idle), 51 units (ideal 48,
    the bound 6m + p - 1; zb-v 51, 1F1B at equal work 66), every rank at most 2p + 1 = 9 stage
    activations (DualPipeV's PP + 1; zb-v 8):

        r=0  FFFFF..fbFwfbFwfbwfFbwfBWbwfBWbwfBWbwfBWbwBWBW.BWBW
        r=1  .FFFFFf.fbFwfbwfFbwfBWFbwfBWbwfBWbwfBWbwBWbBw.BWBWW
        r=2  ..FFFfFfFfbwfFbwfBWFbwfBWFbwfBWbwfBWbwBWbwBb.BWBwWW
        r=3  ...FfFfFfFfFbwfBWFbwfBWFbwfBWFbwfBWbwBWbwBWbBbBwWwW

    Our channels match a rank pair's messages in posting order (as NCCL does), and from p = 3 on
    DualPipeV's receivers take some out of it (p = 3: rank 1 takes stage 5's gradient 0 before
    stage 0's activation 4, which rank 0 sent first): ``in_message_order`` then has the sender
    run that forward right after the message taken first (p = 4, m = 8: 3 forwards move, p = 8,
    m = 16: 21; none at p <= 2), which keeps the bubble and holds no more.

    DualPipeV needs m >= 2p (phase 4 runs at least once on rank 0; torch refuses m < 2p). Fewer run
    the order of m = 2p with the missing micro-batches left out, then put in message order: valid
    and complete, with a longer bubble (the test matrix and a plan's default run m = p; 1f1b and
    zb-v take any m too).
    """
    if v != 2:
        raise ValueError(f"dualpipe-v places exactly 2 stages per rank, got n_virtual={v}; pass n_virtual=2")
    return _dualpipe_v(p, m)


@functools.cache  # the auto search asks again for each candidate: 0.4 s at p = 64, m = 128
def _dualpipe_v(p: int, m: int) -> Orders:
    full = max(m, 2 * p)
    wanted = [[a for a in _dualpipe_v_rank(r, p, full) if a.microbatch < m] for r in range(p)]
    return in_message_order(wanted, p, "dualpipe-v")


def _dualpipe_v_rank(r: int, p: int, m: int) -> list[Action]:
    d, u = r, 2 * p - 1 - r
    out: list[Action] = []
    count: dict[tuple[int, Kind], int] = {}  # (stage, F or B) -> the next micro-batch
    deferred: list[Action] = []  # the W's of split B's, oldest first

    def run(stage: int, kind: Kind, split: bool = False) -> None:
        i = count.get((stage, kind), 0)
        count[stage, kind] = i + 1
        out.append(Action(stage, kind, i))
        if kind is Kind.B:
            w = Action(stage, Kind.W, i)
            if split:
                deferred.append(w)
            else:
                out.append(w)

    def weight() -> None:
        if deferred:
            out.append(deferred.pop(0))

    for _ in range(2 * (p - r - 1)):
        run(d, Kind.F)
    for _ in range(r + 1):
        run(d, Kind.F)
        run(u, Kind.F)
    for _ in range(p - r - 1):
        run(u, Kind.B, split=True)
        weight()
        run(u, Kind.F)
    for _ in range(m - 2 * p + r + 1):
        run(d, Kind.F)
        run(u, Kind.B)
        run(u, Kind.F)
        run(d, Kind.B)
    for _ in range(p - r - 1):
        run(u, Kind.B)
        run(u, Kind.F)
        run(d, Kind.B)
    split = False
    for k in range(r + 1):  # the split starts halfway: before B u on odd ranks, after it on even
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        run(u, Kind.B, split)
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        run(d, Kind.B, split)
    for _ in range(p - r - 1):
        weight()
        run(d, Kind.B, split=True)
    while deferred:
        weight()
    return out


def in_message_order(wanted: list[list[Action]], p: int, name: str) -> Orders:
    """``wanted`` (V placement) with each rank pair's messages taken in the order they are sent
    (dualpipe-v's order; scripts/bench_schedules.py puts torch's V orders through it to compare).

    Our channels, like NCCL's, match a pair's messages in posting order, and in a V one pair
    carries forwards one way and gradients the other way, so both ends must mix them alike. Where a
    receiver takes a message ``first`` while an ``early`` one sent before it on the same pair is
    still untaken, the sender runs ``early`` (and its W, if between) right after ``first``: the
    sender holds its activation shorter, nobody holds more, and the receiver keeps the order it
    wanted. A move changes only two sequences, the pair's posting order and the sender's order of
    taking from the rank that fed ``early`` (its input now comes after those it jumped over), so
    each pair keeps how far its two orders are known to agree and only a pair a move touched is
    looked at again, from there. That replaces a cost-free play restarted from the start after
    each move (moves x actions: 40 s at p = 32, m = 64; this 0.06 s); the orders are the same as
    that play's (checked for every p <= 12, m <= 4p, and up to p = 64, m = 128), and came out the
    same in every order of mending the clashes tried, though this one takes more moves than the
    play (608 to its 560 at p = 16, m = 32). That the result runs is the validator's to check (the
    play also found deadlocks; DualPipeV's orders have none)."""
    k = 2 * p
    rank = [rank_of("v", p, s) for s in range(k)]
    acts = [a for row in wanted for a in row]  # actions by id: lists of ints search and move in C
    ident = {a: n for n, a in enumerate(acts)}
    rows = [[ident[a] for a in row] for row in wanted]
    takes_on: list[tuple[int, int] | None] = [None] * len(acts)  # the pair an action takes its input on
    feed: list[int] = [-1] * len(acts)  # the action that sends it that input
    sent: dict[tuple[int, int], list[int]] = {}  # pair -> its messages in posting order
    taken: dict[tuple[int, int], list[int]] = {}  # pair -> its messages in taking order
    for r, row in enumerate(rows):
        for n in row:
            a = acts[n]
            out = a.stage + 1 if a.kind is Kind.F else a.stage - 1
            if a.kind is not Kind.W and 0 <= out < k and rank[out] != r:
                sent.setdefault((r, rank[out]), []).append(n)
            d = _input_of(a, k)
            if d is not None and rank[d.stage] != r:
                takes_on[n], feed[n] = (rank[d.stage], r), ident[d]
                taken.setdefault((rank[d.stage], r), []).append(ident[d])
    agree = dict.fromkeys(sent, 0)  # pair -> a prefix length where both orders are known to agree
    todo = list(sent)
    moves = 0
    while todo:
        key = todo.pop()
        posted, took = sent[key], taken[key]
        j = agree[key]
        while posted[j : j + 64] == took[j : j + 64] and j < len(posted):  # 64 at a time, in C
            j += 64
        if j >= len(posted):
            agree[key] = len(posted)
            continue
        while posted[j] == took[j]:
            j += 1
        agree[key] = j
        early, first = posted[j], took[j]
        moves += 1
        if moves > 2 * len(acts):  # a safety bound: p = 64, m = 128 moves 41904 of 49152 actions
            raise RuntimeError(f"{name}: no order of its messages found at p={p}")
        row = rows[key[0]]
        lo = row.index(early)
        hi = row.index(first, lo)
        span = row[lo : hi + 1]
        # its own dependents on the rank (a W right after its B, the next stage's F) must stay after it
        e = acts[early]
        moved = [n for n in span if acts[n].microbatch == e.microbatch and acts[n].stage in _near(e)]
        if any(n != early and acts[n].kind is not Kind.W for n in moved):
            raise RuntimeError(f"{name}: cannot put {e} after {acts[first]} on rank {key[0]} at p={p}")
        row[lo : hi + 1] = [n for n in span if n not in moved] + moved
        posted.pop(j)
        posted.insert(posted.index(first, j) + 1, early)
        todo.append(key)
        feeding = takes_on[early]  # the sender now takes early's input after those it jumped over
        if feeding is not None:
            over = sum(1 for n in span if n != early and takes_on[n] == feeding)
            if over:
                order = taken[feeding]
                i = order.index(feed[early])
                order.insert(i + over, order.pop(i))
                if agree[feeding] > i:  # outside i .. i + over the two orders are as they were
                    posted = sent[feeding]
                    bad = [x for x in range(i, i + over + 1) if posted[x] != order[x]]
                    if bad:
                        agree[feeding] = bad[0]
                todo.append(feeding)  # popped first: mended before the pair it came from
    return tuple(tuple(acts[n] for n in row) for row in rows)


def _input_of(a: Action, k: int) -> Action | None:
    """The action whose output ``a`` takes (None: a W, stage 0's forward, the last stage's backward)."""
    if a.kind is Kind.F and a.stage > 0:
        return Action(a.stage - 1, Kind.F, a.microbatch)
    if a.kind is Kind.B and a.stage < k - 1:
        return Action(a.stage + 1, Kind.B, a.microbatch)
    return None


def _near(a: Action) -> tuple[int, ...]:
    """The stages whose actions on micro-batch ``a.microbatch`` may depend on ``a`` locally."""
    return (a.stage, a.stage + 1 if a.kind is Kind.F else a.stage - 1)


def v_half(p: int, v: int, m: int) -> Orders:
    """V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): zb-v's placement
    and split backward at about half of 1F1B's activation memory, for a bubble about half of
    1F1B's. Built from one micro-batch's building block (``_v_block``) repeated every 6 units:
    the rising forwards (stages p + 1 .. 2p - 1) each start one unit late, which lets the block's
    backwards meet fewer slot clashes (a shorter block: less bubble) at one more micro-batch held.

    p = 4, m = 8 at F = B = W = 1 (F/B/W: rank r's stage r, f/b/w: its stage 2p - 1 - r;
    '.': idle), 58 units (ideal 48; 1F1B at equal work 66), every rank holds at most 6 stage
    activations, 3 micro-batches' worth ((p + 2) // 2; 1F1B's rank 0 holds p = 4):

        r=0  FF.....fbFw.fbFw.fbFBwWfbFBwWfbFBwWfbFBwWfbBwWfbBwW..BW.BW
        r=1  .FF...f..bFfw.bFfwBWbFfwBWbFfwBWbFfwBWbFfwBWbfwBWbw.BW.BW.
        r=2  ..F..fF..fbFw.fbFBwWfbFBwWfbFBwWfbFBwWfbFBwWfbBwW.bBwWBW..
        r=3  ...Ff..Ff..bFfBwWbFfBwWbFfBwWbFfBwWbFfBwWbFfBwWbBwWbBwW...
    """
    if v != 2:
        raise ValueError(f"v-half places exactly 2 stages per rank, got n_virtual={v}; pass n_virtual=2")
    return _repeat_v_block(p, m, rising_gap=1)


def v_min(p: int, v: int, m: int) -> Orders:
    """V-Min (Qi et al. 2024): zb-v's placement and split backward at about a third of 1F1B's
    activation memory (p + 4) // 3 micro-batches: its building block runs every action as early
    as the rank's free slots allow, so each activation lives as short as a repeating schedule can.

    p = 4, m = 8 at F = B = W = 1 (F/B/W: rank r's stage r, f/b/w: its stage 2p - 1 - r;
    '.': idle), 59 units (ideal 48; 1F1B at equal work 66), every rank holds at most 4 stage
    activations, 2 micro-batches' worth:

        r=0  FF.....fbwF..fbBwWFfbBwWFfbBwWFfbBwWFfbBwWFfbBwW.fbBwW...BW
        r=1  .F....fF.bw.fFBbwWfFBbwWfFBbwWfFBbwWfFBbwWfFBbwWf.BbwW..BW.
        r=2  ..F..f..F.bfwBFWbfwBFWbfwBFWbfwBFWbfwBFWbfwBFWbfwBW.bw.BW..
        r=3  ...Ff....FfbBwWFfbBwWFfbBwWFfbBwWFfbBwWFfbBwWFfbBwW..bBwW..
    """
    if v != 2:
        raise ValueError(f"v-min places exactly 2 stages per rank, got n_virtual={v}; pass n_virtual=2")
    return _repeat_v_block(p, m, rising_gap=0)


_PERIOD = 6  # a rank's units per micro-batch at F = B = W = 1: F, B and W on each of its 2 stages


def _v_block(p: int, rising_gap: int) -> dict[Action, int]:
    """When micro-batch 0's actions start in a schedule that repeats every ``_PERIOD`` units.

    Each action starts at the first unit after its input (F(s-1), or B(s+1); W after its B; the
    rising forwards ``rising_gap`` later) whose slot mod ``_PERIOD`` is still free on its rank, so
    that the repeated blocks never clash; W's take the two slots left. An activation lives from
    its F to its W: the block's lifespans decide the memory (the paper's observation)."""
    k = 2 * p
    free = [set(range(_PERIOD)) for _ in range(p)]
    start: dict[Action, int] = {}

    def put(a: Action, earliest: int) -> None:
        slots = free[rank_of("v", p, a.stage)]
        t = earliest
        while t % _PERIOD not in slots:
            t += 1
        slots.remove(t % _PERIOD)
        start[a] = t

    for s in range(k):
        gap = rising_gap if s > p else 0
        put(Action(s, Kind.F, 0), 0 if s == 0 else start[Action(s - 1, Kind.F, 0)] + 1 + gap)
    for s in reversed(range(k)):
        after = Action(s, Kind.F, 0) if s == k - 1 else Action(s + 1, Kind.B, 0)
        put(Action(s, Kind.B, 0), start[after] + 1)
    for s in sorted(range(k), key=lambda s: start[Action(s, Kind.B, 0)]):
        put(Action(s, Kind.W, 0), start[Action(s, Kind.B, 0)] + 1)
    return start


def _repeat_v_block(p: int, m: int, rising_gap: int) -> Orders:
    """Micro-batch i's block shifted by i * ``_PERIOD``; each rank runs its actions in start order.
    The blocks never clash, so the repeated timing is a valid run and its per-rank order is
    deadlock-free with every rank pair's messages in one order (sent and taken in start order);
    a rank's held activations change only at its own F's and W's, so the order holds the block's
    memory however the simulator or the runtime squeezes the idle time out."""
    block = _v_block(p, rising_gap)
    rows: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    for a, t in block.items():
        for i in range(m):
            rows[rank_of("v", p, a.stage)].append((t + _PERIOD * i, Action(a.stage, a.kind, i)))
    return tuple(tuple(a for _, a in sorted(row, key=lambda x: x[0])) for row in rows)
