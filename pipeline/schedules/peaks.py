"""The per-rank memory walk: each rank's program run instruction by instruction, holding each
micro-batch's figures (``StageBytes``) from the action that makes them to the one that frees them.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, i: micro-batch, r: rank

ONE rule of what a rank holds when, read by the partitioner (``partitioner.memory``: its figures
from a profile, its solver rows from ``coefficients``, a plan's ``rank_peaks``) and by the runtime
(``pipeline.runtime.inputs.varlen``: a variable-length step's run order, each micro-batch's figures
scaled to its own shape, checked against the plan's memory limit). It lives here, in the
runtime's package, because the runtime may not import the partitioner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.modes import check_mode, recomputes
from pipeline.schedules.program import Free, Post, Wait, gc_paused
from pipeline.schedules.schedule import Schedule

__all__ = ["PARTS", "StageBytes", "coefficients", "rank_peaks", "walk"]


@dataclass(frozen=True)
class StageBytes:
    """Bytes of one micro-batch on stage s, each storage once (``partitioner.memory.stage_bytes``
    makes them from a profile; a plan carries them per stage, ``StagePlan.held``)."""

    saved: float  # what its graph keeps beyond its input and output
    input: float  # the stage input (a receive buffer; 0 on stage 0, whose input is the step's data)
    output: float  # what it sends forward (0 on the last stage)
    chain: float = 0.0  # split backward: layer outputs the chain keeps that no layer saves
    grads: float = 0.0  # split backward: its layers' output gradients, kept from B to W
    static: float = 0.0  # weights, gradients, optimizer state, buffers, autocast's weight copies
    # split backward: the input gradient it sends is a layer's output gradient too (a view's
    # backward; counted in ``input``, not ``grads``): held from B until sent and until W
    input_grad_kept: bool = False
    # the output it sends is its input's storage (a view: ``nn.Flatten`` last): what it sends and a
    # replay's output are the input buffer, while the gradient it receives is a buffer of its own
    output_is_input: bool = False
    # the last stage: each micro-batch's loss kept from its F to the step's end, the step's result
    # (``StageRuntime._loss`` records a copy); the same for every micro-batch, not one of PARTS
    kept: float = 0.0
    # held only while one compute runs: the most a layer's forward allocates and frees again; the
    # most a layer's backward allocates at once, plus the gradient of its output it reads (the
    # stage's last layer reads the received one, counted in ``output``; on the last stage the
    # loss makes it, and the last layer's output goes with its graph: its closing figures)
    transient_forward: float = 0.0
    transient_backward: float = 0.0
    # split backward's B: the input gradients only (``input_transient_bytes``); on stage 0 its first
    # layer computes none (the step's data needs no gradient: StageRuntime's B stops there)
    transient_input_grad: float = 0.0
    # split backward's W: the weight gradients only (``weight_transient_bytes``): no input gradient,
    # and the output gradients it reads are held anyway (``grads``, the received one)
    transient_weight: float = 0.0
    # a recomputing F (under no_grad: no graph keeps its layers' outputs): each layer's input beside
    # the most its forward holds under no_grad (its output, intermediates Python still refers to),
    # the stage's input held apart
    transient_recompute: float = 0.0
    # per figure of PARTS, the share of its bytes that grows as rows x length² at fixed tokens (the
    # attention scores a kernel materialises), the rest growing as the tokens; empty: all as tokens
    squared: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "squared", tuple(float(q) for q in self.squared))  # JSON gives a list
        shares = self.squared
        if shares and (len(shares) != len(PARTS) or not all(0.0 <= q <= 1.0 for q in shares)):
            raise ValueError(
                f"StageBytes(squared={list(self.squared)}): give one share in [0, 1] per figure of PARTS "
                f"({len(PARTS)}: {', '.join(PARTS)}), or none (every figure grows as the tokens)"
            )


def rank_peaks(
    sched: Schedule,
    stages: Sequence[StageBytes],
    recompute: str | Sequence[str],
    microbatches: Sequence[Mapping[str, Sequence[float]]] | None = None,
) -> list[float]:
    """Per rank: its predicted peak bytes in a step (static bytes + the most activation bytes held).

    Walks each rank's program (``Schedule.program``, what the executor runs), holding per micro-batch::

        F        input (all), graph + output (unless it recomputes)
        B        replay (recomputing): graph + a new output; split: + layer output grads
        end of B unsplit: everything of the micro-batch;  W: everything (split)
        SEND_*   the sent tensor from its post to the program's free of it
        RECV_*   the buffer from its posting (one comm block ahead) to its compute's end
        F, B, W  while it runs: its layers' transients (``StageBytes.transient_*``): F's
                 (a recomputing F's: its no-grad forward's most, no graph keeps them), B's
                 (split: the input gradients', beside the output gradients kept so far), W's
                 (the weight gradients'); on the last stage its last layer's closing figures
                 (its output and gradient freed inside, by the loss's)
        F, last  the recorded loss (``kept``), to the step's end
        a view   a stage whose output is its input's storage (``output_is_input``): what it
                 sends and replays is its input buffer; its received gradient its own

    ``recompute``: one mode for every stage, or one per stage. ``microbatches[s][f][i]``: figure f
    (of ``PARTS``) of micro-batch i on stage s, where micro-batches differ (a variable-length
    step's shapes); None: each weighs ``stages[s]``. Static bytes, ``kept`` and the flags are
    ``stages``'.
    """
    modes = [recompute] * sched.n_stages if isinstance(recompute, str) else list(recompute)
    if len(modes) != sched.n_stages or len(stages) != sched.n_stages:
        raise ValueError(
            f"{len(stages)} stage figures and {len(modes)} recompute modes for {sched.n_stages} stages; "
            "give one per stage"
        )
    for mode in modes:
        check_mode(mode)
    m = sched.n_microbatches
    if microbatches is not None and (
        len(microbatches) != sched.n_stages
        or any(len(figures.get(f, ())) != m for figures in microbatches for f in PARTS)
    ):
        raise ValueError(
            f"microbatches must give each figure of PARTS for {m} micro-batches on each of "
            f"{sched.n_stages} stages; got {len(microbatches)} stages"
        )

    def weigh(key: tuple[str, int, int]) -> tuple[int, float]:
        kind, s, _ = key
        return 0, getattr(stages[s], _FIELD[kind])

    def weigh_own(key: tuple[str, int, int]) -> tuple[int, float]:
        kind, s, i = key
        if kind == "kept":
            return 0, stages[s].kept
        return 0, microbatches[s][_FIELD[kind]][i]  # type: ignore[index]

    own = microbatches is not None
    gin_kept = [st.input_grad_kept for st in stages]
    views = [st.output_is_input for st in stages]
    return [
        sum(stages[s].static for s in sched.stages_of(r))
        + walk(sched, r, weigh_own if own else weigh, 1, modes, gin_kept, views, by_stage=not own)[0]
        for r in range(sched.n_ranks)
    ]


# what a message's buffer holds: the tensor it receives or sends
_BUFFER = {Kind.RECV_F: "in", Kind.RECV_B: "gout", Kind.SEND_F: "out", Kind.SEND_B: "gin"}
# what each holder of the walk weighs: a field of ``StageBytes``
_FIELD = {"in": "input", "gin": "input", "out": "output", "gout": "output", "new": "output",
          "set": "saved", "chain": "chain", "grads": "grads", "tf": "transient_forward",
          "tb": "transient_backward", "tbi": "transient_input_grad", "tw": "transient_weight",
          "tfr": "transient_recompute", "kept": "kept"}  # fmt: skip
# the per-micro-batch figures of StageBytes
PARTS = ("saved", "input", "output", "chain", "grads", "transient_forward", "transient_backward",
         "transient_input_grad", "transient_weight", "transient_recompute")  # fmt: skip


def coefficients(sched: Schedule, recompute: str | Sequence[str]) -> list[dict[str, float]]:
    """Per stage s: for each figure of ``StageBytes`` (``PARTS``), the most micro-batches' worth of
    it that s's rank holds at once in the walk, each figure on its own (the walk with unit bytes).

    The walk is linear in the figures for a fixed order of actions, so a rank's activation peak is
    max over moments t of sum over its stages s and figures f of count[t, s, f] * bytes[s, f]
    <= sum over s, f of (max over t of count[t, s, f]) * bytes[s, f]: these coefficients times the
    bytes bound the walk for every balance (equal when every figure peaks at the same moment)."""
    modes = [recompute] * sched.n_stages if isinstance(recompute, str) else list(recompute)
    if len(modes) != sched.n_stages:
        raise ValueError(f"{len(modes)} recompute modes for {sched.n_stages} stages; give one per stage")
    for mode in modes:
        check_mode(mode)
    p, width = sched.n_ranks, len(PARTS)
    column = {kind: PARTS.index(f) for kind, f in _FIELD.items() if f in PARTS}

    def weigh(key: tuple[str, int, int]) -> tuple[int, float]:  # a slot per (stage of r, figure)
        kind, s, _ = key
        if kind == "kept":  # not a per-micro-batch figure: no row of its own
            return (s // p) * width, 0.0
        return (s // p) * width + column[kind], 1.0

    out: list[dict[str, float]] = [{} for _ in range(sched.n_stages)]
    with gc_paused():  # each walk makes thousands of small lists and tuples, none in a cycle
        for r in range(p):
            peak = walk(sched, r, weigh, width * (sched.n_stages // p), modes, by_stage=True)
            for s in sched.stages_of(r):
                out[s] = {f: peak[(s // p) * width + j] for j, f in enumerate(PARTS)}
    return out


def walk(
    sched: Schedule,
    r: int,
    weigh: Callable[[tuple[str, int, int]], tuple[int, float]],
    width: int,
    modes: list[str],
    gin_kept: Sequence[bool] = (),
    views: Sequence[bool] = (),
    *,
    by_stage: bool = False,
) -> list[float]:
    """Rank r's most bytes held at once (see ``rank_peaks``), per slot: ``weigh(key)`` is a held
    tensor's (slot, bytes), and each of the ``width`` slots gets its own maximum over the step (one
    slot: the peak itself). It walks ``sched.program(r)``, the order the executor runs: what a post
    holds, a free releases, and a receive's buffer goes at the end of the compute that waited for
    it. ``gin_kept[s]``: stage s's sent input gradient is held until its W too
    (``StageBytes.input_grad_kept``); ``views[s]``: its output is its input's storage
    (``StageBytes.output_is_input``). ``by_stage``: ``weigh``'s answer is the same for every
    micro-batch, so it is asked once per (kind, stage). Slots are plain numbers, not arrays: planning
    walks thousands of programs of thousands of instructions."""
    gins = {s for s, kept in enumerate(gin_kept) if kept}
    refs: dict[tuple[str, int, int], list[Any]] = {}
    now, peak = [0.0] * width, [0.0] * width
    m = sched.n_microbatches
    weights: dict[str, dict[int, tuple[int, float]]] = {name: {} for name in _FIELD}  # by_stage's

    # a neighbour stage on this rank (the V's turn) hands its tensor over locally: stage s's input
    # is stage s - 1's output, and stage s's output gradient stage s + 1's input gradient. The
    # hand-over holds it from the compute that makes it to the end of the one that takes it (F(s - 1)
    # to F(s), B(s + 1) to B(s)), whatever runs between: nothing else may (a recomputing F keeps no
    # output, and a B's input gradient is no stage's until the B before takes it)
    mine = sched.stages_of(r)
    local_in = {s for s in mine if s > 0 and sched.rank_of(s - 1) == r}
    local_gout = {s for s in mine if s < sched.n_stages - 1 and sched.rank_of(s + 1) == r}

    # a stage whose output is a view of its input sends, and replays, that storage: one holder's
    viewed = {s for s in mine if s < len(views) and views[s]}

    def same(key: tuple[str, int, int]) -> tuple[str, int, int]:
        while True:  # the V turn's stage before may send a view of its input in turn
            kind, s, i = key
            if kind in ("out", "new") and s in viewed:
                key = ("in", s, i)
            elif kind == "in" and s in local_in:
                key = ("out", s - 1, i)
            elif kind == "gout" and s in local_gout:
                return ("gin", s + 1, i)
            else:
                return key

    handover = bool(local_in or local_gout or viewed)
    last = sched.n_stages - 1
    split = sched.split_backward

    def weighed_by_stage(key: tuple[str, int, int]) -> tuple[int, float]:
        kind, s, _ = key
        got = weights[kind].get(s)
        if got is None:
            got = weights[kind][s] = weigh(key)
        return got

    weighed = weighed_by_stage if by_stage else weigh

    # refs: a held tensor -> [holders, its slot, its bytes] (weighed once, when first taken)
    def take(key: tuple[str, int, int]) -> None:
        # only increments: each slot's maximum is reached at the end of a take
        if handover:
            key = same(key)
        held = refs.get(key)
        if held is None:
            slot, n = weighed(key)
            refs[key] = [1, slot, n]
            now[slot] += n
            if now[slot] > peak[slot]:
                peak[slot] = now[slot]
        else:
            held[0] += 1

    def drop(key: tuple[str, int, int]) -> None:
        if handover:
            key = same(key)
        held = refs.get(key)
        if held is None:
            return
        if held[0] == 1:
            del refs[key]
            now[held[1]] -= held[2]
        else:
            held[0] -= 1

    def momentary(key: tuple[str, int, int]) -> None:
        # a transient, held while one compute runs: only this takes its kinds ("tf", "tfr", "tb",
        # "tbi", "tw"), each dropped at once, so no one else holds it: take and drop with no count
        slot, n = weighed(key)
        now[slot] += n
        if now[slot] > peak[slot]:
            peak[slot] = now[slot]
        now[slot] -= n

    # per stage of this rank and micro-batch: whether its forward is recomputed (asked once each)
    by_mode = {mode: [recomputes(mode, i, m) for i in range(m)] for mode in {modes[s] for s in mine}}
    replayed = {s: by_mode[modes[s]] for s in mine}
    buffer = _BUFFER
    consumed: list[tuple[str, int, int]] = []
    for x in sched.program(r):
        # by exact type, not isinstance: planning walks tens of thousands of instructions
        if type(x) is Post:
            for a in x.sends:
                take((buffer[a.kind], a.stage, a.microbatch))
            for a in x.recvs:
                take((buffer[a.kind], a.stage, a.microbatch))
        elif type(x) is Wait:
            a = x.recv
            consumed.append((buffer[a.kind], a.stage, a.microbatch))
        elif type(x) is Free:
            for a in x.sends:
                drop((buffer[a.kind], a.stage, a.microbatch))
        elif isinstance(x, Action):
            kind, s, i = x.kind, x.stage, x.microbatch
            row = replayed.get(s)
            replays = row[i] if row is not None and 0 <= i < m else recomputes(modes[s], i, m)
            if kind is Kind.F:  # a recomputing F keeps its input; its output goes out as a send
                take(("in", s, i))
                if not replays:
                    take(("set", s, i))
                    take(("out", s, i))
                    if split:
                        take(("chain", s, i))
                momentary(("tfr" if replays else "tf", s, i))
                if s == last:  # its loss, recorded until the step's end
                    take(("kept", s, i))
                if s in local_in:  # taken out of the hand-over at this compute's end
                    consumed.append(("in", s, i))
                if s + 1 in local_in:  # handed to the next stage here: held until its F takes it
                    take(("in", s + 1, i))
            elif kind is Kind.B:
                if replays:
                    take(("set", s, i))
                    take(("new", s, i))
                    if split:
                        take(("chain", s, i))
                    momentary(("tf", s, i))
                momentary(("tbi" if split else "tb", s, i))
                if split:  # held until the W
                    take(("grads", s, i))
                    take(("gout", s, i))
                    if s in gins:
                        take(("gin", s, i))
                else:
                    drop(("set", s, i))
                    drop(("out", s, i))
                    drop(("new", s, i))
                    drop(("in", s, i))
                if s in local_gout:  # taken out of the hand-over at this compute's end
                    consumed.append(("gout", s, i))
                if s - 1 in local_gout:  # the input gradient handed to the stage before, until its B
                    take(("gout", s - 1, i))
            else:
                momentary(("tw", s, i))
                for f in ("set", "out", "new", "in", "chain", "grads", "gout"):
                    drop((f, s, i))
                if s in gins:
                    drop(("gin", s, i))
            if consumed:
                for key in consumed:
                    drop(key)
                consumed = []
    return peak
