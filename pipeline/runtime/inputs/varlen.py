"""Batches of text of every length: packed into micro-batches by a token budget, ordered by cost.

    # n: sequences in the step, j: a sequence, m: micro-batches, i: a micro-batch, L: a length

A step given a list of sequences (``Pipeline(..., varlen=VarLen(token_budget=...))``, then
``pipe.step(samples, targets)``) runs the schedule's m micro-batches as usual, but each micro-batch
is a group of sequences padded only to the longest of its own group, with its own shape (rows, L):

    lengths   j:  0   1   2   3   4   5   6   7          (n = 8, m = 3)
                 90  12 300  40  41 250  16  88
    sorted       300 | 250 90 | 88 41 40 16 12         contiguous groups, longest first
    padded       1 x 300  2 x 250  5 x 88               the most padded tokens of any group (500) is least
    run order    the fastest the simulator finds that fits the memory limit (costs: tokens, length²)

Packing. Sorted by length, the sequences are cut into m contiguous groups so that the largest
group's padded tokens (rows x its longest) is as small as it can be (a greedy fill against a
bisected cap; exact for contiguous groups of sorted lengths); the longest group must fit
``token_budget``, the bound the plan's memory was made for. Grouping similar lengths keeps padding
low; balancing the groups keeps the pipeline's stages evenly fed.

Documents. A model that takes document boundaries declares it (``VarLen(documents=True)``): its
first stage then takes ``(tokens, position_ids)``, each (1, W), and every micro-batch is one row
of whole sequences laid end to end, each one's positions counting from 0, so that the model can
keep every document's attention to itself (the convention of Hugging Face's packed rows; a varlen
kernel reads its ``cu_seqlens`` off the zeros). Nothing is padded but the row's tail up to
``pad_multiple`` (positions 0 there: each pad a document of its own, its target ignored); the
model carries the position ids to its later stages itself (they cross the cuts with its
activations), and ``max_len`` bounds each document, not the row. Where the balanced rows overflow
the token budget, rows are filled to the budget instead:

    lengths   j:  0   1   2   3   4   5   6   7          (n = 8, m = 3)
                 90  12 300  40  41 250  16  88
    rows          [300] [250 16] [90 88 41 40 12]        longest first, each to the lightest row
    tokens         300    266     271                    (the longest row is least, near enough)
    positions     0..299 | 0..249 0..15 | 0..89 0..87 ...

Each row is (1, W), priced as such below: a dense masked attention costs W², so the order is
exact for it; a varlen kernel costs less, and the order is then conservative.

Order. The schedule's shape stays; which group runs as micro-batch i changes. A few orders
(costliest first, cheapest first, alternating, and the most bytes spread p apart, each also
reversed) are played on the schedule's programs (``pipeline.schedules.program.play``), and the
fastest whose memory fits is kept. Relabelling micro-batches keeps every rank's program, so every
order run is the validated schedule's.

Cost. A compute of stage s on a micro-batch of shape (r, L), with the plan's time t0 at its own
micro-batch (R0, L0) and the share q of t0 that grows as rows x length² (attention's products;
``StagePlan.*_squared``, which the partitioner splits off from the profile's flops at two lengths,
``partitioner.lengths``)::

    t(r, L) = t0 [(1 - q) r L / (R0 L0) + q r L² / (R0 L0²)]

so 1 x 512 tokens costs more than 8 x 64 wherever attention weighs. Without a plan's predictions
(a balance given by hand) F 1, B 2, W 1 per stage, scaled by the padded tokens alone.

Memory. Where the plan carries the memory walk's figures per stage (``StagePlan.held``: what a
micro-batch holds, each figure with its own length² share, e.g. scores a kernel materialises),
each candidate is walked rank by rank (``pipeline.schedules.peaks``, the partitioner's own walk)
with every micro-batch's figures grown to its shape by the same rule; an order fits when every
rank's peak is within the ``memory_limit`` the plan was made under, less what its device holds
beyond the walk (``Plan.usable_limits``: workspaces, rounding, headroom), or, when it was made
without one, within the plan's own predicted peak (the plan was accepted at its micro-batch). None fits:
a ValueError naming the step's longest micro-batch, its best peak, the limit and the fix.

Loss by tokens. Micro-batch i's loss (``loss_fn``, a mean over the tokens its targets do not mark
``ignore_index``) is weighted by its share of the step's such tokens: the step's loss and gradients
are those of one process taking the mean over every target token of the step.

Every rank computes nothing of this but rank 0 (the samples) and the last stage's rank (the
targets), which pack alike from the same lengths; the step header carries the micro-batches'
shapes to the others and the lengths to the last stage's rank, which checks its targets against
them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pipeline.plan import replica_bytes
from pipeline.schedules.actions import Kind
from pipeline.schedules.peaks import PARTS, StageBytes, rank_peaks
from pipeline.schedules.program import play
from pipeline.schedules.schedule import Schedule

if TYPE_CHECKING:
    from pipeline.plan import Plan

__all__ = [
    "Packed",
    "StepCosts",
    "StepMemory",
    "VarLen",
    "is_ragged",
    "lengths_of",
    "order",
    "pack",
    "pad",
    "plan_step",
    "positions",
    "step_costs",
    "unpad",
    "widths_of",
]


@dataclass(frozen=True)
class VarLen:
    """How a Pipeline packs a step given as a list of sequences (see the module docstring).

    ``token_budget``: the most padded tokens (rows x length) of one micro-batch, the size the plan's
    memory was made for; ``max_len``: the longest sequence the model takes (None: no check);
    ``pad_id``: what pads the inputs; ``ignore_index``: what pads the targets (the loss must ignore
    it, as ``F.cross_entropy`` does -100); ``pad_multiple``: each micro-batch's length is rounded
    up to a multiple of it (fewer distinct shapes to set up, for a little more padding);
    ``documents``: the model takes ``(tokens, position_ids)`` and keeps each document's attention
    to itself, so each micro-batch is one row of whole sequences end to end (see "Documents")."""

    token_budget: int
    max_len: int | None = None
    pad_id: int = 0
    ignore_index: int = -100
    pad_multiple: int = 1
    documents: bool = False

    def __post_init__(self) -> None:
        for name in ("token_budget", "pad_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VarLen({name}={value!r}): must be an integer >= 1")
        if self.max_len is not None and (
            isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1
        ):
            raise ValueError(f"VarLen(max_len={self.max_len!r}): must be an integer >= 1, or None")
        for name in ("pad_id", "ignore_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"VarLen({name}={value!r}): must be an integer token id")
        if not isinstance(self.documents, bool):
            raise ValueError(f"VarLen(documents={self.documents!r}): must be True or False")


@dataclass(frozen=True)
class Packed:
    """One step's packing: ``groups[i]``, the sequences micro-batch i holds (in run order), padded to
    ``widths[i]`` (``documents``: laid end to end in one row of that width); ``lengths[j]``, sequence
    j's; ``seconds``, the time packing and ordering took; ``candidates``, each order's simulated
    step; ``peaks``, the chosen order's predicted peak per rank."""

    groups: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]
    lengths: tuple[int, ...]
    seconds: float = 0.0
    candidates: dict[str, float] = field(default_factory=dict)  # order name -> simulated step
    peaks: tuple[float, ...] = ()  # per rank, the chosen order's predicted peak bytes (empty: unchecked)
    documents: bool = False

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Each micro-batch's (rows, length): a row of documents is one row."""
        return _shapes(self.groups, self.widths, self.documents)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return sum(r * w for r, w in self.shapes)

    @property
    def padding_share(self) -> float:
        """The share of the step's padded tokens that are padding."""
        return 1.0 - self.tokens / self.padded_tokens


def is_ragged(batch: object) -> bool:
    """True for a step's samples (or targets) given as a list of sequences."""
    return isinstance(batch, list)


def unpad(value: object, what: str) -> object:
    """A step's samples (or targets) given as ``(padded, lengths)``: a (n, L, ...) tensor whose row j
    holds sequence j in its first ``lengths[j]`` positions, with ``lengths`` a list of n ints or a
    CPU integer tensor (read on the host: no device sync), as the list of those n sequences (views).
    Anything else is returned as it is (a list of sequences; other input is refused later)."""
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.Tensor)):
        return value
    padded, lengths = value
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu" or lengths.dim() != 1 or lengths.is_floating_point():
            raise ValueError(
                f"{what}'s lengths must be a list of ints or a 1-dim integer CPU tensor (read on the host), "
                f"got a {lengths.dim()}-dim {lengths.dtype} tensor on {lengths.device}; pass integer "
                "lengths, one per row, on the CPU or as a list"
            )
        lengths = lengths.tolist()
    if not isinstance(lengths, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in lengths
    ):
        raise ValueError(
            f"{what}'s lengths must be a list of ints or a CPU integer tensor, got {lengths!r:.80}"
        )
    if padded.dim() < 2 or len(lengths) != padded.shape[0]:
        raise ValueError(
            f"{what} given as (padded, lengths) needs a padded tensor of at least 2 dims (sequences, "
            f"length, ...) with one length per row: got shape {list(padded.shape)} and {len(lengths)} lengths"
        )
    bad = next((j for j, n in enumerate(lengths) if not 1 <= n <= padded.shape[1]), None)
    if bad is not None:
        fix = f"drop row {bad}" if lengths[bad] == 0 else "give each row's own length"
        raise ValueError(
            f"{what}'s lengths[{bad}] is {lengths[bad]}, outside the padded tensor's length "
            f"1..{padded.shape[1]}; {fix}"
        )
    return [padded[j, :n] for j, n in enumerate(lengths)]


def lengths_of(seqs: object, what: str, opts: VarLen) -> list[int]:
    """Each sequence's length (dim 0), checked: a non-empty list of non-empty tensors of one dtype and
    trailing shape, none longer than ``opts.max_len`` or ``opts.token_budget``."""
    if not isinstance(seqs, list) or not seqs:
        raise ValueError(f"{what} must be a non-empty list of tensors (one per sequence), got {seqs!r:.80}")
    first = seqs[0]
    for j, t in enumerate(seqs):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(
                f"{what}[{j}] must be a tensor of at least one dimension (its length first), got "
                f"{type(t).__name__ if not isinstance(t, torch.Tensor) else f'a {t.dim()}-dim tensor'}"
            )
        if t.shape[0] == 0:
            raise ValueError(f"{what}[{j}] is empty (length 0); drop it from the step's list")
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{what}[{j}] is {t.dtype} of shape {list(t.shape)} but {what}[0] is {first.dtype} of "
                f"shape {list(first.shape)}; sequences may differ only in length (dim 0)"
            )
        if opts.max_len is not None and t.shape[0] > opts.max_len:
            raise ValueError(
                f"{what}[{j}] has {t.shape[0]} tokens, more than the model's max_len {opts.max_len} "
                "(VarLen(max_len=...)); cut it into pieces of at most max_len"
            )
        if t.shape[0] > opts.token_budget:
            raise ValueError(
                f"{what}[{j}] has {t.shape[0]} tokens, more than VarLen(token_budget={opts.token_budget}) "
                "allows one micro-batch; raise token_budget to at least the longest sequence"
            )
    return [int(t.shape[0]) for t in seqs]


def _width(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _shapes(
    groups: Sequence[tuple[int, ...]], widths: Sequence[int], documents: bool
) -> list[tuple[int, int]]:
    """Each micro-batch's (rows, length): a group's sequences as rows, or one row of documents."""
    return [(1 if documents else len(g), w) for g, w in zip(groups, widths, strict=True)]


def widths_of(groups: Sequence[Sequence[int]], lengths: Sequence[int], opts: VarLen) -> list[int]:
    """Each group's padded length: its longest sequence's, or (documents) all of its sequences' end
    to end, rounded up to ``opts.pad_multiple``."""
    join = sum if opts.documents else max
    return [_width(join(lengths[j] for j in g), opts.pad_multiple) for g in groups]


def pack(lengths: Sequence[int], m: int, opts: VarLen) -> list[tuple[int, ...]]:
    """Sequences (by index) in m groups, one per micro-batch, with the most padded tokens of any
    group least (see the module docstring): contiguous groups of the lengths sorted longest first,
    or (documents) rows filled longest first; ValueError when it exceeds the token budget or
    there are fewer than m sequences."""
    n = len(lengths)
    if n < m:
        raise ValueError(
            f"the step has {n} sequences but the pipeline runs n_microbatches={m}, and every micro-batch "
            f"needs one; pass at least {m} sequences, or plan fewer micro-batches"
        )
    if opts.documents:
        return _pack_documents(lengths, m, opts)
    by_length = sorted(range(n), key=lambda j: (-lengths[j], j))
    widths = [_width(lengths[j], opts.pad_multiple) for j in by_length]

    def cut(cap: int) -> list[int] | None:
        """Group starts filling each group up to ``cap`` padded tokens, leaving one sequence for
        each group still to come; None if m groups cannot hold them."""
        starts: list[int] = []
        k = 0
        while k < n:
            if len(starts) == m or widths[k] > cap:
                return None
            starts.append(k)
            rows = cap // widths[k]  # the group's width is its first (longest) sequence's
            k = max(k + min(rows, n - k - (m - len(starts))), starts[-1] + 1)
        return starts if len(starts) == m else None

    lo, hi = widths[0], n * widths[0]  # the longest alone; everything at the longest's width
    while lo < hi:  # the smallest cap that m groups fit (bisection: feasibility grows with the cap)
        mid = (lo + hi) // 2
        if cut(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    starts = cut(lo)
    assert starts is not None  # hi = n x the longest always fits
    ends = [*starts[1:], n]
    groups = [tuple(by_length[a:b]) for a, b in zip(starts, ends, strict=True)]
    worst = max((b - a) * widths[a] for a, b in zip(starts, ends, strict=True))
    if worst > opts.token_budget:
        raise ValueError(
            f"the step's {n} sequences ({sum(lengths)} tokens, the longest {max(lengths)}) need "
            f"{worst} padded tokens in some micro-batch at best, more than VarLen(token_budget="
            f"{opts.token_budget}); pass fewer sequences per step, or raise token_budget or n_microbatches"
        )
    return groups


def _pack_documents(lengths: Sequence[int], m: int, opts: VarLen) -> list[tuple[int, ...]]:
    """m rows of whole sequences: each sequence, longest first, to the row holding the fewest tokens
    so far (the longest row within 4/3 of the least it can be; every row gets one of the m longest);
    where that overflows the token budget, rows filled to the budget instead (``_fill``)."""
    rows = _place(lengths, m, lambda tokens, n: min(range(m), key=lambda i: (tokens[i], i)))
    if max(widths_of(rows, lengths, opts)) > opts.token_budget:
        rows = _fill(lengths, m, opts)
    groups = [tuple(r) for r in rows]
    worst = max(widths_of(groups, lengths, opts))
    if worst > opts.token_budget:
        raise ValueError(
            f"the step's {len(lengths)} sequences ({sum(lengths)} tokens, the longest {max(lengths)}) "
            f"need a row of {worst} tokens in some micro-batch (rows filled longest first), more than "
            f"VarLen(token_budget={opts.token_budget}); pass fewer sequences per step, or raise "
            "token_budget or n_microbatches"
        )
    return groups


def _fill(lengths: Sequence[int], m: int, opts: VarLen) -> list[list[int]]:
    """m rows filled to the token budget: each sequence, longest first, to the first row it fits (to
    the emptiest where none does: refused by the caller); then each row left empty takes the last
    sequence of the row holding the most (there are at least m sequences)."""

    def first_fit(tokens: list[int], n: int) -> int:
        fits = (i for i in range(m) if _width(tokens[i] + n, opts.pad_multiple) <= opts.token_budget)
        return next(fits, min(range(m), key=lambda i: (tokens[i], i)))

    rows = _place(lengths, m, first_fit)
    for empty in [i for i in range(m) if not rows[i]]:
        donor = max(range(m), key=lambda i: (len(rows[i]), -i))
        rows[empty].append(rows[donor].pop())
    return rows


def _place(lengths: Sequence[int], m: int, choose: Callable[[list[int], int], int]) -> list[list[int]]:
    """m rows of the sequences, longest first, each to the row ``choose(tokens per row, its length)``."""
    rows: list[list[int]] = [[] for _ in range(m)]
    tokens = [0] * m
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        i = choose(tokens, lengths[j])
        rows[i].append(j)
        tokens[i] += lengths[j]
    return rows


def order(
    groups: Sequence[tuple[int, ...]],
    widths: Sequence[int],
    sched: Schedule,
    costs: StepCosts,
    documents: bool = False,
) -> tuple[list[int], dict[str, float], list[float]]:
    """The run order of ``groups`` (a permutation of their indices): of a few candidates, the one the
    schedule finishes first with each compute costing ``costs`` at its group's shape (rows, width),
    among those whose every rank's predicted peak fits ``costs.memory``'s limit; each candidate's
    simulated step; the chosen order's predicted peak per rank (empty: no memory check). A
    ValueError naming the step's longest micro-batch when no candidate fits."""
    m = len(groups)
    shapes = _shapes(groups, widths, documents)
    grow = _growth(shapes, costs.shape)
    # table[kind][s][g]: a compute of group g on stage s, in seconds
    table = {kind: [[_grown(t, q, *grow[g]) for g in range(m)]
                    for t, q in zip(costs.seconds[kind], costs.squared[kind], strict=True)]
             for kind in costs.seconds}  # fmt: skip
    memory = costs.memory
    # held[s][f][g]: figure f of the memory walk for group g on stage s, in bytes
    held = None if memory is None else [_held_at(st, grow) for st in memory.stages]
    work = [sum(row[g] for rows in table.values() for row in rows) for g in range(m)]  # each group's seconds
    by_work = sorted(range(m), key=lambda g: (-work[g], g))
    # the costliest, the cheapest, the second costliest, the second cheapest, ...
    alternating = [by_work[k // 2] if k % 2 == 0 else by_work[-1 - k // 2] for k in range(m)]
    # the groups holding the most bytes p apart: any p micro-batches in a row (what 1F1B's first
    # stage holds at once) take one of each tier, so the most held at once is least
    weight = (
        work
        if held is None
        else [sum(row[g] for figures in held for row in figures.values()) for g in range(m)]
    )
    by_weight = sorted(range(m), key=lambda g: (-weight[g], g))
    slots = [i for first in range(sched.n_ranks) for i in range(first, m, sched.n_ranks)]
    spread = [0] * m
    for g, i in zip(by_weight, slots, strict=True):
        spread[i] = g
    candidates = {
        "longest first": by_work,
        "shortest first": by_work[::-1],
        "alternating": alternating,
        "alternating, shortest first": alternating[::-1],
        "spread": spread,
        "spread, reversed": spread[::-1],
    }
    orders: dict[str, list[int]] = {}
    for name, perm in candidates.items():  # each order once, under its first name
        if perm not in orders.values():
            orders[name] = perm
    programs = sched.programs()
    results: dict[str, float] = {}
    for name, perm in orders.items():
        played = play(programs, lambda a, perm=perm: table[a.kind][a.stage][perm[a.microbatch]])  # type: ignore[misc]
        results[name] = max(played.ends) if played.ends else 0.0
    fastest = sorted(orders, key=results.__getitem__)  # stable: on a tie, the first of ``orders``
    if memory is None or held is None:
        return orders[fastest[0]], results, []
    tried: dict[str, list[float]] = {}
    for name in fastest:
        perm = orders[name]
        own = [{f: [row[g] for g in perm] for f, row in figures.items()} for figures in held]
        walked = rank_peaks(sched, memory.stages, memory.recompute, own)
        tried[name] = [peak + memory.beside for peak in walked]  # as the plan's rank_peaks
        if all(peak <= limit * (1 + 1e-9) for peak, limit in zip(tried[name], memory.limits, strict=True)):
            return perm, results, tried[name]
    raise ValueError(_too_big(groups, shapes, tried, memory, documents))


def _too_big(
    groups: Sequence[tuple[int, ...]],
    shapes: Sequence[tuple[int, int]],
    tried: dict[str, list[float]],
    memory: StepMemory,
    documents: bool,
) -> str:
    """Why no order fits: the step's longest micro-batch, the least overshoot of any order, the fix."""
    longest = max(range(len(groups)), key=lambda g: (shapes[g][1], shapes[g][0]))

    def over(name: str) -> tuple[float, int]:
        return max(
            (peak - limit, r) for r, (peak, limit) in enumerate(zip(tried[name], memory.limits, strict=True))
        )

    best = min(tried, key=over)
    r = over(best)[1]
    rows, width = shapes[longest]
    n = len(groups[longest])
    where = (
        f"rank {r}'s predicted peak is {tried[best][r] / 1e6:.4g} MB at best (order {best!r}), over its "
        f"limit {memory.limits[r] / 1e6:.4g} MB ({memory.bound})"
    )
    if documents:  # a row's width is the step's tokens over m: the budget does not shorten it
        return (
            f"no run order of this step's micro-batches fits the memory limit: with its longest row of "
            f"documents ({n} sequences end to end, {width} tokens: {list(groups[longest])}), {where}; "
            "pass fewer tokens per step or plan more n_microbatches, so that each row is shorter, or "
            "raise the limit (partition(..., memory_limit=...))"
        )
    return (
        f"no run order of this step's micro-batches fits the memory limit: with its longest micro-batch "
        f"({rows} sequence{'s' if rows > 1 else ''} padded to {width} tokens: {list(groups[longest])}), "
        f"{where}; lower VarLen(token_budget=...) below its {rows * width} padded tokens, so that long "
        "sequences go fewer to a micro-batch, or raise the limit (partition(..., memory_limit=...))"
    )


def plan_step(lengths: Sequence[int], sched: Schedule, opts: VarLen, costs: StepCosts) -> Packed:
    """Pack and order one step (what rank 0 and the last stage's rank both compute, alike)."""
    start = time.perf_counter()
    groups = pack(lengths, sched.n_microbatches, opts)
    widths = widths_of(groups, lengths, opts)
    perm, results, peaks = order(groups, widths, sched, costs, opts.documents)
    return Packed(
        tuple(groups[g] for g in perm),
        tuple(widths[g] for g in perm),
        tuple(lengths),
        time.perf_counter() - start,
        results,
        tuple(peaks),
        opts.documents,
    )


def pad(seqs: Sequence[torch.Tensor], packed: Packed, value: int) -> list[torch.Tensor]:
    """The micro-batches of ``seqs`` as ``packed`` groups them, each (rows, width, ...) filled with
    ``value`` past each sequence's end; documents: (1, width, ...), the group's sequences end to end,
    then ``value`` to the row's end."""
    out = []
    for (rows, width), group in zip(packed.shapes, packed.groups, strict=True):
        first = seqs[group[0]]
        batch = first.new_full((rows, width, *first.shape[1:]), value)
        at = 0
        for row, j in enumerate(group):
            n = seqs[j].shape[0]
            if packed.documents:
                batch[0, at : at + n] = seqs[j]
                at += n
            else:
                batch[row, :n] = seqs[j]
        out.append(batch)
    return out


def positions(packed: Packed, device: torch.device) -> list[torch.Tensor]:
    """A row of documents' position ids, (1, width) int64 per micro-batch on ``device`` (the
    sequences'): each sequence's positions from 0, and 0 for each pad past the last (a document of
    one token, its target ignored)."""
    out = []
    for group, width in zip(packed.groups, packed.widths, strict=True):
        row = torch.zeros((1, width), dtype=torch.int64, device=device)
        at = 0
        for j in group:
            n = packed.lengths[j]
            row[0, at : at + n] = torch.arange(n, device=device)
            at += n
        out.append(row)
    return out


@dataclass(frozen=True)
class StepMemory:
    """What each order's memory is checked against: per stage, the figures the walk holds of one
    micro-batch at the plan's shape (``StagePlan.held``, each with its length² shares); each
    stage's recompute mode; per rank, the limit; and what that limit is (for the message)."""

    stages: list[StageBytes]
    recompute: list[str]
    limits: list[float]
    bound: str
    beside: float = 0.0  # what each rank holds beside its stages (pipeline.plan.replica_bytes)


@dataclass(frozen=True)
class StepCosts:
    """What a step's order is chosen by (``step_costs``): per kind (F, B, W) and stage, a compute's
    seconds at the micro-batch ``shape`` (rows, length) and the share of them that grows as rows x
    length² (the rest as the tokens); ``shape`` None: at the step's mean padded tokens, all as the
    tokens; ``memory``: the limit every rank's predicted peak must fit (None: unchecked)."""

    seconds: dict[Kind, list[float]]
    squared: dict[Kind, list[float]]
    shape: tuple[int, int] | None = None
    memory: StepMemory | None = None


def step_costs(plan: Plan | None, sched: Schedule) -> StepCosts:
    """What the plan predicts of each compute and of memory, for ``order``.

    Times: its stages' forward, backward (the input-gradient part alone when split) and weight-
    gradient times at its micro-batch shape, each split into the part growing as the tokens and
    the part growing as rows x length² (``StagePlan.*_squared``). Without them (a plan given as a
    balance): F 1, B 2 and W 1 for every stage (B 1 when split), scaled by the tokens alone.

    Memory, where the plan carries the walk's figures (``StagePlan.held``) and its shape: every
    rank's peak must stay within the ``memory_limit`` the plan was made under less its device's
    reserve (``Plan.usable_limits``), or else within the plan's own predicted peak
    (``Plan.rank_peaks``: the plan was accepted at its micro-batch)."""
    stages = plan.stages if plan is not None else []
    k, split = sched.n_stages, sched.split_backward
    if plan is None or len(stages) != k or not all(st.forward_time > 0 for st in stages):
        seconds = {Kind.F: [1.0] * k, Kind.B: [1.0 if split else 2.0] * k, Kind.W: [1.0] * k}
        return StepCosts(seconds, {kind: [0.0] * k for kind in seconds})
    b = [st.backward_time - (st.weight_time if split else 0.0) for st in stages]
    # B's length² seconds: the whole backward's, less W's when W runs apart
    b_squared = [st.backward_time * st.backward_squared - (st.weight_time * st.weight_squared if split else 0)
                 for st in stages]  # fmt: skip
    seconds = {
        Kind.F: [st.forward_time for st in stages],
        Kind.B: b,
        Kind.W: [st.weight_time for st in stages],
    }
    squared = {
        Kind.F: [st.forward_squared for st in stages],
        Kind.B: [min(max(q / t, 0.0), 1.0) if t > 0 else 0.0 for q, t in zip(b_squared, b, strict=True)],
        Kind.W: [st.weight_squared for st in stages],
    }
    if len(plan.micro_batch_shape) != 2:
        return StepCosts(seconds, squared)
    rows, length = plan.micro_batch_shape
    held = [st.held for st in stages]
    limits, bound = plan.usable_limits(), "the memory_limit the plan was made under"
    if plan.device_memory.reserves:
        bound += f", less the device's reserve: {plan.device_memory.describe()}"
    if not limits:
        limits, bound = (
            plan.rank_peaks,
            f"no memory_limit: the plan's own predicted peak at {rows} x {length}",
        )
    memory = None
    if limits and all(h is not None for h in held):
        modes = [plan.recompute_of(s) for s in range(k)]
        beside = replica_bytes(plan.dp, plan.shard)  # as the plan's rank_peaks count them
        memory = StepMemory([h for h in held if h is not None], modes, list(limits), bound, beside)
    return StepCosts(seconds, squared, (rows, length), memory)


def _growth(shapes: Sequence[tuple[int, int]], shape: tuple[int, int] | None) -> list[tuple[float, float]]:
    """Per micro-batch of ``shapes`` (rows, length): how much its tokens and its rows x length² are
    of ``shape``'s (None: of the mean tokens, the second as the first)."""
    if shape is None:
        tokens = [r * w for r, w in shapes]
        mean = sum(tokens) / len(tokens)
        return [(t / mean, t / mean) for t in tokens]
    rows, length = shape
    return [(r * w / (rows * length), r * w * w / (rows * length * length)) for r, w in shapes]


def _grown(value: float, squared: float, tokens: float, square: float) -> float:
    """A figure of the plan's micro-batch at another shape: the share ``squared`` of it grows as rows
    x length² (``square``: how much that is of the plan's), the rest as the tokens (``tokens``)."""
    return value * ((1.0 - squared) * tokens + squared * square)


def _held_at(st: StageBytes, grow: Sequence[tuple[float, float]]) -> dict[str, list[float]]:
    """Per figure of ``st`` (one micro-batch's bytes at the plan's shape), its bytes at each shape
    whose growth ``grow`` gives (see ``_grown``); static bytes do not grow."""
    shares = st.squared or (0.0,) * len(PARTS)
    return {f: [_grown(getattr(st, f), q, *g) for g in grow] for f, q in zip(PARTS, shares, strict=True)}
