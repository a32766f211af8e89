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

__all__ = ["gpipe", "interleaved_1f1b", "interleaved_zb", "one_f_one_b", "zb_h1"]

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
