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
"""

from __future__ import annotations

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.placement import rank_of

__all__ = ["gpipe", "interleaved_1f1b", "interleaved_zb", "one_f_one_b", "zb_h1", "zb_v"]

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
    into B and W. The order is a greedy list schedule simulated at unit costs (F = B = W = 1):
    each time unit every rank runs a ready B (oldest micro-batch, later stage first), else a ready
    F when it holds fewer than 2p + 1 forwards whose W has not run, else its oldest pending W, else
    a received F over the cap (which frees the messages queued behind it), else idles. A message is
    consumed only when it is the oldest unconsumed one on its rank pair, so that sends and receives
    are posted in the same order (in a V one pair carries forwards and backwards both ways).

    Simulated with F = B = W (p = 6, m = 18): 113 units, the same as interleaved-zb and the bound
    6m + p - 1 (rank p - 1 waits p - 1 units for its first input), against interleaved-1f1b's 123
    and zb-h1's 118 at equal work; a rank holds at most 3p - 1 stage activations (interleaved-zb
    the same; 1F1B's rank 0 holds 2p in these half-size stages); the cap 2p + 1 gave the shortest
    steps of 2p - 1 .. 2p + 2 at no more memory.
    """
    if v != 2:
        raise ValueError(f"zb-v places exactly 2 stages per rank, got n_virtual={v}; pass n_virtual=2")
    return _greedy_v(p, m, cap=2 * p + 1)


def _greedy_v(p: int, m: int, cap: int) -> Orders:
    k = 2 * p

    def rank(s: int) -> int:
        return rank_of("v", p, s)

    stages = [sorted((r, k - 1 - r), reverse=True) for r in range(p)]  # the later stage first
    done: set[Action] = set()
    channel: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> sent, not yet consumed
    held = [0] * p  # forwards whose W has not run
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = 3 * k * m

    def need(a: Action) -> Action | None:
        """The input ``a`` takes from another stage (None: none)."""
        if a.kind is Kind.F:
            return Action(a.stage - 1, Kind.F, a.microbatch) if a.stage > 0 else None
        return Action(a.stage + 1, Kind.B, a.microbatch) if a.stage < k - 1 else None

    def ready(a: Action, r: int) -> bool:
        if a in done or (a.kind is Kind.B and Action(a.stage, Kind.F, a.microbatch) not in done):
            return False
        d = need(a)
        if d is None:
            return True
        if d not in done:
            return False
        src = rank(d.stage)
        return src == r or channel[(src, r)][0] == d

    def received(a: Action, r: int) -> bool:
        # an input waiting on a rank pair is taken whatever the cap: messages behind it wait for it
        d = need(a)
        return d is not None and rank(d.stage) != r

    # each stage runs its F's, and its B's, in micro-batch order (the oldest ready one is taken, and a
    # later one is never ready before it: its input queues behind the earlier's on the rank pair), so
    # only each stage's next F and next B are candidates: the oldest micro-batch, then the later stage
    after = {Kind.F: [0] * k, Kind.B: [0] * k}  # per stage: micro-batches that ran

    def oldest(kind: Kind, r: int, only_received: bool = False) -> Action | None:
        found = [
            a
            for s in stages[r]
            if after[kind][s] < m
            and ready(a := Action(s, kind, after[kind][s]), r)
            and (not only_received or received(a, r))
        ]
        return min(found, key=lambda a: a.microbatch, default=None)  # the first of equals: later stage

    while len(done) < total:
        ran: list[tuple[int, Action]] = []
        for r in range(p):
            pick = oldest(Kind.B, r)
            if pick is None and held[r] < cap:
                pick = oldest(Kind.F, r)
            if pick is None and pending_w[r]:
                pick = pending_w[r].pop(0)
            if pick is None:  # over the cap with nothing else to run: take a waiting input, which
                # frees the messages behind it on its rank pair (else the pipeline would stall)
                pick = oldest(Kind.F, r, only_received=True)
            if pick is not None:
                ran.append((r, pick))
                if pick.kind is not Kind.W:
                    after[pick.kind][pick.stage] += 1
        if not ran:
            raise RuntimeError(f"zb-v's list schedule stalls at p={p}, m={m}, cap={cap}")
        for r, a in ran:
            d = need(a) if a.kind is not Kind.W else None
            if d is not None and rank(d.stage) != r:
                channel[(rank(d.stage), r)].pop(0)
            orders[r].append(a)
            if a.kind is Kind.F:
                held[r] += 1
            elif a.kind is Kind.B:
                pending_w[r].append(Action(a.stage, Kind.W, a.microbatch))
            else:
                held[r] -= 1
        for r, a in ran:  # what finished this unit: ready for the next
            done.add(a)
            out = a.stage + 1 if a.kind is Kind.F else a.stage - 1
            if a.kind is not Kind.W and 0 <= out < k and rank(out) != r:
                channel.setdefault((r, rank(out)), []).append(a)
    return tuple(tuple(row) for row in orders)
