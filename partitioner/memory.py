"""Memory under a schedule: weights, gradients, optimizer state and held activations.

    # p: ranks, v: stages per rank, k = p * v stages, m: micro-batches, s: stage, l: layer, r: rank

Two models. The per-layer rows (``in_flight``, ``held``, ``layer_memory``) are what ``solve``
splits: additive per layer, so a balance can be searched, and upper bounds. The per-rank walk
(``stage_bytes`` then ``rank_peaks``) is the prediction of one plan's peak: it follows the
runtime's holders one by one, so it equals what ``pipe.memory_stats()`` measures
(``pipeline.runtime.memory``), each storage once.

Per-layer rows. A stage holds, at its peak::

    params * (1 + 1 + optimizer_state_factor)        weights, their gradients, optimizer state
    + buffers + cache                                buffers; autocast's low-precision weight
                                                     copies, made once and shared by every
                                                     micro-batch of the step
    + saved_bytes * sets[s]                          activation sets autograd keeps
    + input_bytes(s) * inputs[s]                     stage inputs a recomputing stage keeps

``in_flight`` walks the schedule itself: on each rank the actions run one after another,
so counting F (one more micro-batch held by its stage) and the last backward part (B, or
W when the schedule splits the backward: one fewer) gives each stage's exact peak, whatever
the timing. ``held`` turns that peak N into what a stage keeps under a recomputation mode::

    recompute      sets    inputs
    never          N       0          every in-flight micro-batch keeps its activations
    always         1       N          inputs only, plus the one being recomputed for its backward
    except_last    2       N          the last micro-batch keeps its activations (N >= 2; m >= 2)
                   1       1          (N = 1: the one held is the last, or one being recomputed)

``except_last`` with m = 1 recomputes nothing and counts as ``never``. Both recomputing rows
are upper bounds: they charge every held micro-batch its input besides the activation sets.
What the rows miss: a storage two adjacent layers both save (a ReLU's output is the next
Linear's input) counts twice; a rank's stages (interleaved) rarely peak together; transfer
buffers, zb-h1's output gradients kept from B to W, and a recomputing stage's sent output.

Per-rank walk. ``stage_bytes`` turns the profile into per-micro-batch figures of each stage
(``StageBytes``: its graph beyond input and output, input, output, a split chain's unsaved
outputs and output gradients, static bytes), counting a storage adjacent layers share once when
given ``saved_io`` (what each layer saves of its input and output). ``rank_peaks`` then runs each
rank's lowered actions (compute and comm blocks, receives posted one block ahead, sends kept
until a receive proves them delivered, as ``pipeline.runtime.program`` does) and returns, per
rank, static bytes plus the most activation bytes held at once. Recomputation is per stage.
The step's data (stage 0's input, the last stage's targets) is not counted: the caller holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from partitioner.figures import Profile
from pipeline.runtime.recompute import check_mode, recomputes
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule

__all__ = ["StageBytes", "held", "in_flight", "layer_memory", "rank_peaks", "saved_io", "stage_bytes"]


def in_flight(sched: Schedule) -> list[int]:
    """Peak number of micro-batches whose activations stage s holds, for every stage (k = p * v)."""
    last = Kind.W if sched.split_backward else Kind.B
    live, peak = [0] * sched.n_stages, [0] * sched.n_stages
    for actions in sched.compute:
        for a in actions:
            if a.kind is Kind.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is last:
                live[a.stage] -= 1
    return peak


def held(recompute: str, n_microbatches: int, in_flight_counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per stage, (activation sets, stage inputs) kept at the peak under ``recompute``; see above."""
    check_mode(recompute)
    if recompute == "never" or (recompute == "except_last" and n_microbatches < 2):
        return list(in_flight_counts), [0] * len(in_flight_counts)
    most = 1 if recompute == "always" else 2
    return [min(most, n) for n in in_flight_counts], list(in_flight_counts)


def layer_memory(
    param_bytes: Sequence[int],
    saved_bytes: Sequence[int],
    sets: Sequence[int],
    optimizer_state_factor: float,
    *,
    buffer_bytes: Sequence[int] | None = None,
    cache_bytes: Sequence[int] | None = None,
) -> list[list[float]]:
    """Row s, entry l: bytes layer l costs when it sits on stage s, which keeps ``sets[s]``
    activation sets (the rows ``solve`` takes; a recomputing stage's inputs come on top)."""
    if not optimizer_state_factor >= 0:
        raise ValueError(
            f"optimizer_state_factor ({optimizer_state_factor!r}) must be >= 0: bytes of optimizer state "
            "per parameter byte (2.0 for Adam, 1.0 for SGD with momentum, 0.0 for plain SGD)"
        )
    zeros = [0] * len(param_bytes)
    static = np.asarray(param_bytes, np.float64) * (2.0 + optimizer_state_factor)
    for once in (buffer_bytes, cache_bytes):
        static = static + np.asarray(once or zeros, np.float64)
    saved = np.asarray(saved_bytes, np.float64)
    if saved.shape != static.shape:
        raise ValueError(f"saved_bytes has {len(saved)} entries, param_bytes {len(static)}; one per layer")
    rows: dict[int, list[float]] = {n: (static + saved * float(n)).tolist() for n in set(sets)}
    return [rows[n] for n in sets]


# ---- the per-rank peak, walked action by action (what ``pipeline.runtime.memory`` measures)


@dataclass(frozen=True)
class StageBytes:
    """Bytes of one micro-batch on stage s, each storage once (see ``stage_bytes``)."""

    saved: float  # what its graph keeps beyond its input and output
    input: float  # the stage input (a receive buffer; 0 on stage 0, whose input is the step's data)
    output: float  # what it sends forward (0 on the last stage)
    chain: float = 0.0  # split backward: layer outputs the chain keeps that no layer saves
    grads: float = 0.0  # split backward: its layers' output gradients, kept from B to W
    static: float = 0.0  # weights, gradients, optimizer state, buffers, autocast's weight copies


def stage_bytes(
    profile: Profile,
    balance: Sequence[int],
    optimizer_state_factor: float = 2.0,
    saved_io: Sequence[tuple[int, int]] | None = None,
) -> list[StageBytes]:
    """Per stage of ``balance``: the figures ``rank_peaks`` walks, from the profile's layers (and loss).

    ``saved_io[l]``: bytes of layer l's input and of its output that layer l saves (the loss's
    entry, after the layers': its input and its target); with them a storage two adjacent layers
    save (a ReLU's output, the next Linear's input) counts once, and the step's data not at all.
    Without them (None) they are read from the profile when it records them (``LayerProfile``
    fields ``saved_input_bytes`` and ``saved_output_bytes``; the loss's ``saved_input_bytes`` and
    ``saved_target_bytes``), else every layer's saved bytes are taken as its own: an upper bound.
    """
    layers = list(profile.layers)
    io = list(saved_io) if saved_io is not None else _recorded_io(profile)
    if len(io) == len(layers):
        io.append((0, 0))
    loss = profile.loss
    out: list[StageBytes] = []
    start, k = 0, len(balance)
    for s, size in enumerate(balance):
        stop, last = start + size, s == k - 1
        lps = layers[start:stop]
        saved = float(sum(lp.saved_bytes for lp in lps)) - io[start][0]
        for j in range(start + 1, stop):  # a storage layer j - 1 saves as output and j as input
            saved -= min(io[j - 1][1], io[j][0])
        chain = float(sum(lp.activation_bytes for j, lp in enumerate(lps[:-1], start)
                          if io[j][1] == 0 and io[j + 1][0] == 0))  # fmt: skip
        grads = float(sum(lp.activation_bytes for lp in lps[:-1]))
        output = 0.0 if last else float(lps[-1].activation_bytes)
        if not last:
            saved -= min(io[stop - 1][1], output)  # the output is counted on its own
        elif loss is not None:  # the loss: its input once, its target (the step's data) never
            saved += loss.saved_bytes - min(io[stop - 1][1], io[-1][0]) - io[-1][1]
        static = sum(lp.param_bytes * (2.0 + optimizer_state_factor) + lp.buffer_bytes + lp.cache_bytes
                     for lp in lps)  # fmt: skip
        inp = 0.0 if s == 0 else float(layers[start - 1].activation_bytes)
        out.append(StageBytes(max(saved, 0.0), inp, output, chain, grads, static))
        start = stop
    return out


def _recorded_io(profile: Profile) -> list[tuple[int, int]]:
    """``saved_io`` as the profile records it, or zeros (nothing known to be shared)."""
    layers = profile.layers
    io = [(getattr(lp, "saved_input_bytes", 0), getattr(lp, "saved_output_bytes", 0)) for lp in layers]
    loss = profile.loss
    io.append((getattr(loss, "saved_input_bytes", 0), getattr(loss, "saved_target_bytes", 0)))
    return io


def rank_peaks(sched: Schedule, stages: Sequence[StageBytes], recompute: str | Sequence[str]) -> list[float]:
    """Per rank: its predicted peak bytes in a step (static bytes + the most activation bytes held).

    Walks each rank's lowered actions as the executor runs them, holding per micro-batch::

        F        input (all), graph + output (unless it recomputes)
        B        replay (recomputing): graph + a new output; split: + layer output grads
        end of B unsplit: everything of the micro-batch;  W: everything (split)
        SEND_*   the sent tensor until a receive proves it delivered (program.py's reaps)
        RECV_*   the buffer from its posting (one comm block ahead) to its compute's end

    ``recompute``: one mode for every stage, or one per stage.
    """
    modes = [recompute] * sched.n_stages if isinstance(recompute, str) else list(recompute)
    if len(modes) != sched.n_stages or len(stages) != sched.n_stages:
        raise ValueError(
            f"{len(stages)} stage figures and {len(modes)} recompute modes for {sched.n_stages} stages; "
            "give one per stage"
        )
    for mode in modes:
        check_mode(mode)
    lowered = sched.lowered()
    return [
        sum(st.static for st in stages[r :: sched.n_ranks]) + _walk(sched, lowered, r, stages, modes)
        for r in range(sched.n_ranks)
    ]


Lowered = tuple[tuple[Action, ...], ...]


def _walk(sched: Schedule, lowered: Lowered, r: int, stages: Sequence[StageBytes], modes: list[str]) -> float:
    """Rank r's most activation bytes held at once (see ``rank_peaks``)."""
    mine = lowered[r]
    refs: dict[tuple[str, int, int], int] = {}
    now, peak = 0.0, 0.0
    m = sched.n_microbatches

    def size(key: tuple[str, int, int]) -> float:
        kind, s, _ = key
        st = stages[s]
        return {"in": st.input, "gin": st.input, "out": st.output, "gout": st.output, "new": st.output,
                "set": st.saved, "chain": st.chain, "grads": st.grads}[kind]  # fmt: skip

    def take(*keys: tuple[str, int, int]) -> None:
        nonlocal now, peak
        for key in keys:
            refs[key] = refs.get(key, 0) + 1
            if refs[key] == 1:
                now += size(key)
        peak = max(peak, now)

    def drop(*keys: tuple[str, int, int]) -> None:
        nonlocal now
        for key in keys:
            if key in refs:
                refs[key] -= 1
                if refs[key] == 0:
                    del refs[key]
                    now -= size(key)

    def buffer(a: Action) -> tuple[str, int, int]:
        kind = {Kind.RECV_F: "in", Kind.RECV_B: "gout", Kind.SEND_F: "out", Kind.SEND_B: "gin"}[a.kind]
        return (kind, a.stage, a.microbatch)

    reaps = _reaps(sched, lowered, r)
    blocks: list[list[Action]] = []
    program: list[Action | int] = []  # a compute action, or the index of a comm block
    for a in mine:
        if a.kind.is_compute:
            program.append(a)
        elif program and isinstance(program[-1], int):
            blocks[-1].append(a)
        else:
            blocks.append([a])
            program.append(len(blocks) - 1)
    recvs = [[a for a in b if a.kind.is_recv] for b in blocks]
    if recvs:
        take(*(buffer(a) for a in recvs[0]))  # posted at the step's start
    posted: set[Action] = set()
    for item in program:
        if isinstance(item, int):
            ahead = recvs[item + 1] if item + 1 < len(blocks) else []
            sends = [a for a in blocks[item] if a.kind.is_send]
            posted.update(sends)
            take(*(buffer(a) for a in (*sends, *ahead)))
            continue
        a, s, i = item, item.stage, item.microbatch
        replays = recomputes(modes[s], i, m)
        got = Action(s, Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, i)
        consumed = [buffer(got)] if a.kind is not Kind.W and got in mine else []
        for sent in reaps.get(got, []):
            if sent in posted:
                posted.discard(sent)
                drop(buffer(sent))
        if a.kind is Kind.F:  # a recomputing F keeps its input; its output goes out as a send
            kept = [] if replays else [("set", s, i), ("out", s, i)]
            take(("in", s, i), *kept, *([("chain", s, i)] if kept and sched.split_backward else []))
        elif a.kind is Kind.B:
            if replays:
                take(("set", s, i), ("new", s, i), *([("chain", s, i)] if sched.split_backward else []))
            if sched.split_backward:
                take(("grads", s, i), ("gout", s, i))
            else:
                drop(("set", s, i), ("out", s, i), ("new", s, i), ("in", s, i))
        else:
            drop(("set", s, i), ("out", s, i), ("new", s, i), ("in", s, i), ("chain", s, i))
            drop(("grads", s, i), ("gout", s, i))
        drop(*consumed)
    return peak


def _reaps(sched: Schedule, lowered: Lowered, r: int) -> dict[Action, list[Action]]:
    """Per receive on rank r: the sends it proves delivered (the rule of ``pipeline.runtime.program``)."""
    out: dict[Action, list[Action]] = {}
    mine = set(lowered[r])
    for a in lowered[r]:
        if not a.kind.is_send:
            continue
        theirs = lowered[sched.rank_of(a.peer_stage)]
        consumer = (
            Action(a.stage + 1, Kind.F, a.microbatch)
            if a.kind is Kind.SEND_F
            else Action(a.stage - 1, Kind.B, a.microbatch)
        )
        if consumer not in theirs:
            continue
        for b in theirs[theirs.index(consumer) + 1 :]:
            if b.kind.is_send and sched.rank_of(b.peer_stage) == r:
                back = Action(b.stage + 1, Kind.RECV_F, b.microbatch) if b.kind is Kind.SEND_F else Action(
                    b.stage - 1, Kind.RECV_B, b.microbatch)  # fmt: skip
                if back in mine:
                    out.setdefault(back, []).append(a)
                break
    return out


def saved_io(
    model: nn.Sequential, sample: Any, loss_fn: Any = None, target: Any = None
) -> list[tuple[int, int]]:
    """Per layer of ``model`` (then the loss, when given): bytes of its input and of its output
    that it saves for backward, from one forward of ``sample`` (what ``stage_bytes`` takes)."""
    found: list[tuple[int, int]] = []

    def ptrs(x: Any) -> dict[int, int]:
        ts = [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)]
        return {t.untyped_storage().data_ptr(): t.nelement() * t.element_size() for t in ts}

    def run(fn: Any, x: Any, y: Any = None) -> Any:
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x) if y is None else fn(x, y)
        ins, outs = ptrs(x), ptrs(out) if y is None else ptrs(y)
        found.append(tuple(sum(n for key, n in d.items() if key in seen) for d in (ins, outs)))  # type: ignore[arg-type]
        return out

    with torch.enable_grad():
        x = sample.clone() if isinstance(sample, torch.Tensor) else sample
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_(True)
        for layer in model:
            x = run(layer, x)
        if loss_fn is not None:
            run(loss_fn, x, target)
    return found
