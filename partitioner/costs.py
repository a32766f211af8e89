"""From a profile to what ``solve`` splits: per-layer costs, cut costs per link, cuttable places.

    # p: ranks, v: stages per rank, k = p * v stages, s: stage, r: rank, l: layer

Per-layer cost (``layer_costs``), per micro-batch, rho being the share of micro-batches whose
forward runs again before the backward (1 for recompute="always", (m - 1) / m for "except_last")::

    time     f + b + rho * f      b: the whole backward, or input + weight gradient when the
                                     schedule splits it (each measured as that schedule runs it)
    flops    F + B + rho * F      forward and backward flops of every op
    params   parameter bytes
    uniform  1

The loss, when profiled, runs on the last stage: its figures are folded into the last layer
(``with_loss``), which always sits there.

A cut between stages s and s + 1 travels from rank_of(s) to rank_of(s + 1) (the schedule's
placement, ``pipeline.schedules.schedule.rank_of``) over link r = ``link_of(placement, p, s)``;
link r has a latency and a bandwidth. Per micro-batch the activation goes forward and its
gradient (as many bytes) comes back, and each transfer keeps both ends busy, so each of the two
stages pays::

    cut_s[l] = 2 * (latency[r] + bytes(cut after l) / bandwidth[r]),    r = link_of(placement, p, s)

and nothing when both stages are on one rank (the V's turn). Links are given per rank. "loop"
placement (stage s on rank s % p): link r is rank r -> (r + 1) % p, p - 1 of them when v = 1, p
when v > 1 (the last, p - 1 -> 0, carries the cuts between chunks). "v" placement: the V runs down
the ranks and back up, so a cut crosses ranks r and r + 1 either way; a link is taken as
symmetric and indexed by the lower rank of its pair: p - 1 links.

Not every place can be cut (``cut_groups``): the pipeline sends a tensor or a tuple of tensors,
and a stage's input is a leaf of autograd, which refuses a layer that writes into its input
(``nn.ReLU(inplace=True)``). Layers joined by such places form one group that no split breaks.
A traced model's profile says so per cut itself (``Profile.cut_reasons``: every value live
across the cut counts, not only the previous layer's output). And every stage holds a parameter:
a layer holding none (a ``Dropout``, a pooling, a final scale) joins its neighbour's group, so no
rank is left with nothing for its optimizer; where fewer groups hold parameters than there are
stages, ``partition`` refuses, naming them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from partitioner.figures import LayerProfile, Profile
from partitioner.graph import cut_bytes
from pipeline.schedules.schedule import rank_of

__all__ = [
    "COSTS",
    "backward_time",
    "cut_groups",
    "cut_problems",
    "cut_rows",
    "layer_costs",
    "link_of",
    "links",
    "n_links",
    "recomputed_share",
    "transfer",
    "with_loss",
]

COSTS: tuple[str, ...] = ("time", "flops", "params", "uniform")


def with_loss(profile: Profile) -> list[LayerProfile]:
    """The profile's layers, the loss's figures (if profiled) added to the last one's."""
    layers = list(profile.layers)
    loss = profile.loss
    if loss is None:
        return layers
    last = layers[-1]
    layers[-1] = dataclasses.replace(
        last,
        forward_time=last.forward_time + loss.forward_time,
        backward_time=last.backward_time + loss.backward_time,
        input_time=last.input_time + loss.input_time,
        weight_time=last.weight_time + loss.weight_time,
        flops=last.flops + loss.flops,
        backward_flops=last.backward_flops + loss.backward_flops,
        param_bytes=last.param_bytes + loss.param_bytes,
        buffer_bytes=last.buffer_bytes + loss.buffer_bytes,
        saved_bytes=last.saved_bytes + loss.saved_bytes,
        cache_bytes=last.cache_bytes + loss.cache_bytes,
    )
    return layers


def backward_time(lp: LayerProfile, split: bool) -> float:
    """The layer's backward as the schedule runs it: whole, or input then weight gradient."""
    return lp.input_time + lp.weight_time if split else lp.backward_time


def recomputed_share(recompute: str, m: int) -> float:
    """rho: the share of micro-batches whose forward runs twice."""
    if recompute == "always":
        return 1.0
    if recompute == "except_last":
        return (m - 1) / m
    return 0.0


def layer_costs(
    profile: Profile,
    cost: str,
    *,
    recompute: str = "never",
    n_microbatches: int = 1,
    split_backward: bool = False,
) -> list[float]:
    """Per-layer costs for ``cost`` (see the module docstring), the loss in the last layer's."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; valid costs are {', '.join(COSTS)}")
    rho = recomputed_share(recompute, n_microbatches)
    return [_layer_cost(lp, cost, rho, split_backward) for lp in with_loss(profile)]


def _layer_cost(lp: LayerProfile, cost: str, rho: float, split: bool) -> float:
    if cost == "time":
        return lp.forward_time + backward_time(lp, split) + rho * lp.forward_time
    if cost == "flops":
        return float(lp.flops + lp.backward_flops) + rho * lp.flops
    if cost == "params":
        return float(lp.param_bytes)
    return 1.0


def link_of(placement: str, p: int, s: int) -> int | None:
    """The link that the cut between stages s and s + 1 crosses (see the module docstring); None
    when both stages are on one rank."""
    a, b = rank_of(placement, p, s), rank_of(placement, p, s + 1)
    if a == b:
        return None
    return a if placement == "loop" else min(a, b)


def n_links(placement: str, n_ranks: int, n_virtual: int) -> int:
    """How many links a pipeline of ``n_virtual`` stages per rank uses (see the module docstring)."""
    return n_ranks - 1 if n_virtual == 1 or placement != "loop" else n_ranks


def links(
    name: str,
    value: float | Sequence[float] | None,
    n_ranks: int,
    n_virtual: int,
    placement: str = "loop",
) -> list[float] | None:
    """``latency`` or ``bandwidth`` per link (see the module docstring), checked; None if not given."""
    if value is None:
        return None
    wanted = n_links(placement, n_ranks, n_virtual)
    what = "seconds per message" if name == "latency" else "bytes per second"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * wanted
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        values = [float(x) for x in value]
        if len(values) != wanted:
            last = ", the last between chunks" if wanted == n_ranks else ""
            rule = "rank r -> (r + 1) % p" if placement == "loop" else "ranks r and r + 1, either way"
            placed = "" if placement == "loop" else f" (placement {placement!r})"
            raise ValueError(
                f"{name} has {len(values)} entries but {n_ranks} ranks with n_virtual={n_virtual}{placed} "
                f"have {wanted} links (link r: {rule}{last}); pass one number or {wanted}"
            )
    else:
        raise TypeError(f"{name} must be a number or a list of numbers ({what}), got {type(value).__name__}")
    for r, x in enumerate(values):
        ok = math.isfinite(x) and (x > 0 if name == "bandwidth" else x >= 0)
        if isinstance(x, bool) or not ok:
            bound = "> 0" if name == "bandwidth" else ">= 0"
            raise ValueError(f"{name}[{r}] is {x!r}; each must be a finite number of {what} {bound}")
    return values


def transfer(
    nbytes: int,
    s: int,
    n_ranks: int,
    latency: list[float] | None,
    bandwidth: list[float] | None,
    placement: str = "loop",
) -> float:
    """Seconds one message of ``nbytes`` takes over boundary s's link (0 with neither figure, or
    when stages s and s + 1 share a rank)."""
    r = link_of(placement, n_ranks, s)
    if r is None:
        return 0.0
    return (0.0 if latency is None else latency[r]) + (0.0 if bandwidth is None else nbytes / bandwidth[r])


def cut_rows(
    profile: Profile,
    k: int,
    n_ranks: int,
    latency: list[float] | None,
    bandwidth: list[float] | None,
    placement: str = "loop",
) -> list[list[float]] | None:
    """Row s: what the cut after each layer costs each of stages s and s + 1 (None: free cuts)."""
    if (latency is None and bandwidth is None) or k == 1:
        return None
    sent = np.asarray(cut_bytes(profile.graph), dtype=np.float64)
    per_link: dict[int | None, list[float]] = {None: [0.0] * len(sent)}  # None: one rank, free
    on = [link_of(placement, n_ranks, s) for s in range(k - 1)]
    for r in sorted({r for r in on if r is not None}):
        wait = 0.0 if latency is None else latency[r]
        seconds = wait + (0.0 if bandwidth is None else sent / bandwidth[r])
        per_link[r] = (2.0 * np.broadcast_to(seconds, sent.shape)).tolist()
    return [per_link[r] for r in on]


def _blocked(layers: Sequence[LayerProfile], cut: int, reasons: Sequence[str] | None = None) -> str:
    """Why the cut after layer ``cut`` is impossible ('' if it is possible); ``reasons``: a traced
    model's, per cut (``Profile.cut_reasons``), which replace the chain's rule."""
    if reasons:
        return reasons[cut]
    before, after = layers[cut], layers[cut + 1]
    if not before.sendable:
        return f"layer {cut} ({before.name}: {before.kind}) returns what the pipeline cannot send"
    if after.inplace:
        return f"layer {cut + 1} ({after.name}: {after.kind}) writes into its input"
    return ""


def cut_groups(
    layers: Sequence[LayerProfile], reasons: Sequence[str] | None = None
) -> tuple[list[int], list[str]]:
    """Sizes of the runs of layers that no cut may split, and the reasons for the joins.

    Every stage holds a parameter (``_bare``): when the profile names parameters, a run holding
    none joins the run before it (a first run, the run after it)."""
    sizes, joined = [1], []
    for cut in range(len(layers) - 1):
        why = _blocked(layers, cut, reasons)
        if why:
            sizes[-1] += 1
            joined.append(why)
        else:
            sizes.append(1)
    if not any(lp.params for lp in layers):  # no parameter named (a profile made by hand): no rule
        return sizes, joined
    out: list[int] = []
    start, waiting = 0, 0
    for size in sizes:
        bare = _bare(layers, start, start + size)
        if bare:
            joined.append(bare)
        if bare and out:
            out[-1] += size
        elif bare:
            waiting += size
        else:
            out.append(waiting + size)
            waiting = 0
        start += size
    return out, joined


def _bare(layers: Sequence[LayerProfile], start: int, stop: int) -> str:
    """Why layers [start, stop) cannot be a stage alone: they hold no parameter ('' if they do).

    A rank without parameters has nothing to train: ``torch.optim.AdamW(pipe.parameters())``
    raises there. One rule for the solver's groups and for a given balance's problems."""
    if any(lp.params for lp in layers[start:stop]):
        return ""
    what = f"layer {start} ({layers[start].name})" if stop - start == 1 else f"layers {start}..{stop - 1}"
    return f"{what} holds no parameter, so it stays with a stage that does"


def cut_problems(
    layers: Sequence[LayerProfile], balance: Sequence[int], reasons: Sequence[str] | None = None
) -> list[str]:
    """What makes ``balance`` unrunnable: stage boundaries at places that cannot be cut, and
    stages that would hold no parameter (when the profile names parameters)."""
    out, end = [], 0
    for s, size in enumerate(balance[:-1]):
        end += size
        why = _blocked(layers, end - 1, reasons)
        if why:
            out.append(f"the boundary between stages {s} and {s + 1}: {why}")
    if any(lp.params for lp in layers):
        start = 0
        for s, size in enumerate(balance):
            bare = _bare(layers, start, start + size)
            if bare:
                out.append(f"stage {s}: {bare}; its rank's optimizer would have nothing to train")
            start += size
    return out
