"""``partitioner.memory``: the schedule walk against closed forms and the simulator; recomputation.

# p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank, c: chunk (s = c * p + r)

The closed forms below are oracles, not library code: the walk over the built schedule is what
``partition`` uses, and these tests check it against them and against the simulator's timed count.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import profile
from partitioner._planning import memory_rows
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.memory import (
    PARTS,
    StageBytes,
    coefficients,
    held,
    in_flight,
    layer_bounds,
    layer_memory,
    rank_peaks,
    saved_io,
    stage_bytes,
)
from partitioner.solve import stage_memory
from pipeline.reference.models import mlp
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate

PM = [(p, m) for p in range(1, 6) for m in range(1, 10)]
COSTS = [(1.0, 1.0, 0.0), (1.0, 2.0, 1.0), (3.0, 1.0, 2.0)]  # (F, B, W)


def _closed_form(name: str, p: int, m: int, v: int = 1) -> list[int]:
    """Peak micro-batches held per stage.

        gpipe              m
        1f1b               min(m, p - s)
        zb-h1              min(m, p)        (m >= p: rank r adds r pending W's to 1F1B's p - r)
        interleaved-1f1b   min(m, (v - 1 - c) * p + min(p, 2 * (p - r - 1) + 1))   an upper bound

    The interleaved form follows Megatron's warm-up: rank r runs 2 (p - r - 1) + (v - 1) p
    forwards, chunk by chunk in groups of p micro-batches, before its first backward (of its
    last chunk); each earlier chunk c has (v - 1 - c) more groups in flight.
    """
    if name == "gpipe":
        return [m] * p
    if name == "1f1b":
        return [min(m, p - s) for s in range(p)]
    if name == "zb-h1":
        return [min(m, p)] * p
    return [min(m, (v - 1 - s // p) * p + min(p, 2 * (p - s % p - 1) + 1)) for s in range(p * v)]


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_walk_matches_closed_forms(name: str, p: int, m: int) -> None:
    assert in_flight(schedule(name, p, m)) == _closed_form(name, p, m)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in PM if m >= p])
def test_zb_h1_holds_activations_until_w(p: int, m: int) -> None:
    counts = in_flight(schedule("zb-h1", p, m))
    assert counts == _closed_form("zb-h1", p, m)
    if p > 1:
        assert counts != _closed_form("1f1b", p, m)  # counting to B instead of W would be too low


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_walk_matches_the_simulator(name: str, p: int, m: int) -> None:
    # one stage per rank: the simulator's timed per-rank peak is the walk's per-stage one
    sched = schedule(name, p, m)
    for f, b, w in COSTS:
        assert simulate(sched, f, b, w).peak_activations == in_flight(sched)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (2, 3, 4), (3, 2, 6), (4, 3, 8), (1, 2, 3)])
def test_interleaved_walk_within_the_closed_bound(p: int, v: int, m: int) -> None:
    sched = schedule("interleaved-1f1b", p, m, n_virtual=v)
    exact = in_flight(sched)
    bound = _closed_form("interleaved-1f1b", p, m, v)
    assert len(exact) == p * v
    assert all(e <= b for e, b in zip(exact, bound, strict=True))
    assert exact[0] == bound[0]  # stage 0 (rank 0, chunk 0) reaches the bound
    for f, b, w in COSTS:  # a rank never holds more than its stages' peaks together
        per_rank = simulate(sched, f, b, w).peak_activations
        assert all(per_rank[r] <= sum(exact[r::p]) for r in range(p))


@pytest.mark.parametrize(
    ("mode", "m", "counts", "sets", "inputs"),
    [
        ("never", 4, [3, 2, 1], [3, 2, 1], [0, 0, 0]),
        ("always", 4, [3, 2, 1], [1, 1, 1], [3, 2, 1]),
        ("except_last", 4, [3, 2, 1], [2, 2, 1], [3, 2, 1]),
        ("except_last", 1, [1, 1], [1, 1], [0, 0]),  # m = 1: the only micro-batch is the last
    ],
)
def test_held_under_recomputation(
    mode: str, m: int, counts: list[int], sets: list[int], inputs: list[int]
) -> None:
    assert held(mode, m, counts) == (sets, inputs)


def test_layer_memory_rows() -> None:
    rows = layer_memory([10, 0], [3, 5], [2, 1], optimizer_state_factor=2.0)
    assert rows == [[40.0 + 6.0, 10.0], [40.0 + 3.0, 5.0]]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="optimizer_state_factor"):
        layer_memory([1], [1], [1], optimizer_state_factor=-1.0)
    with pytest.raises(ValueError, match="'sometimes'"):
        held("sometimes", 2, [1])


# ---- the per-rank walk (rank_peaks) and the per-stage figures it takes (stage_bytes)

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 3),
    ("zb-v", 2),
]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 4), (2, 6)])
@pytest.mark.parametrize(("name", "v"), SCHEDULES)
def test_walk_of_graphs_alone_is_the_simulators_count(name: str, v: int, p: int, m: int) -> None:
    # graphs of 1 byte, nothing else: a rank's peak is the most micro-batches its stages hold at once
    sched = schedule(name, p, m, n_virtual=v)
    ones = [StageBytes(saved=1.0, input=0.0, output=0.0)] * (p * v)
    assert rank_peaks(sched, ones, "never") == simulate(sched, 1.0, 2.0, 1.0).peak_activations


@pytest.mark.parametrize(("name", "v"), [s for s in SCHEDULES if s[0] not in ("zb-h1", "zb-v")])
def test_always_recomputing_holds_one_graph(name: str, v: int) -> None:
    # unsplit: only the micro-batch being recomputed has a graph (zb-h1 keeps each until its W)
    sched = schedule(name, 3, 6, n_virtual=v)
    figures = [StageBytes(saved=10.0, input=0.0, output=0.0, static=5.0 * s) for s in range(3 * v)]
    statics = [sum(5.0 * s for s in range(r, 3 * v, 3)) for r in range(3)]
    assert rank_peaks(sched, figures, "always") == [10.0 + st for st in statics]
    assert max(rank_peaks(schedule("zb-h1", 3, 6), figures[:3], "always")) > 10.0 + 10.0


def test_received_and_sent_buffers_count_until_consumed_or_delivered() -> None:
    # 1f1b, p = 2, m = 4, rank 1 (the last stage), inputs of 1 byte alone (their gradients too):
    # receives are posted one comm block ahead, and the gradient sent after B_i lives until
    # rank 0's F_{i+2} arrives (rank 0 sends it after B_i: the proof that B_i's gradient came)
    #   start + block 0:  RECV_F0, RECV_F1                          in0 in1            2
    #   F0 B0, block 1:   SEND_B0, RECV_F2 (F0's receive consumed)  in1 gin0 in2       3
    #   F1 B1, block 2:   SEND_B1, RECV_F3                          gin0 in2 gin1 in3  4
    #   F2 (reaps gin0) B2, block 3: SEND_B2                        in3 gin1 gin2      3
    sched = schedule("1f1b", 2, 4)
    figures = [StageBytes(saved=0.0, input=0.0, output=0.0), StageBytes(saved=0.0, input=1.0, output=0.0)]
    assert rank_peaks(sched, figures, "always")[1] == 4.0


def test_recompute_per_stage() -> None:
    # one stage per rank: each rank's peak follows its own stage's mode
    sched = schedule("1f1b", 2, 4)
    figures = [StageBytes(saved=8.0, input=1.0, output=2.0), StageBytes(saved=8.0, input=2.0, output=0.0)]
    never, always = rank_peaks(sched, figures, "never"), rank_peaks(sched, figures, "always")
    assert rank_peaks(sched, figures, ("never", "always")) == [never[0], always[1]]
    assert rank_peaks(sched, figures, ["always", "never"]) == [always[0], never[1]]
    with pytest.raises(ValueError, match="one per stage"):
        rank_peaks(sched, figures, ("never",))
    with pytest.raises(ValueError, match="'sometimes'"):
        rank_peaks(sched, figures, ("never", "sometimes"))


def test_stage_bytes_counts_a_storage_two_layers_save_once() -> None:
    # each mlp layer (Linear, ReLU) saves its input and its output: the next layer's input
    torch.manual_seed(0)
    model, x = mlp(width=8, depth=4, batch_size=2)
    y = torch.randn(2, 8)
    prof = profile(model, x, loss_fn=nn.functional.mse_loss, target=y, warmup=0, repeat=1)
    io = saved_io(model, x, nn.functional.mse_loss, y)
    u = x.nbytes  # one activation: 2 rows of 8 floats
    assert io == [(u, u)] * 4 + [(u, u)]  # the loss saves its input and its target
    first, last = stage_bytes(prof, [2, 2], 0.0, io)
    # stage 0: y0 (x0 is the step's data; y1, sent, is its output); stage 1: y2, y3 (the target:
    # data), its input y1 held on its own, and the loss (4 bytes) its graph's root
    assert (first.saved, first.input, first.output) == (u, 0.0, u)
    assert (last.saved, last.input, last.output, last.kept) == (2 * u + 4, u, 0.0, 4)
    assert first.static == 2 * sum(lp.param_bytes for lp in prof.layers[:2])
    # the profile records what each layer saves of its input and output: the same figures
    assert [(lp.saved_input_bytes, lp.saved_output_bytes) for lp in prof.layers] == io[:-1]
    assert prof.loss is not None and (prof.loss.saved_input_bytes, prof.loss.saved_target_bytes) == io[-1]
    assert stage_bytes(prof, [2, 2], 0.0) == [first, last]
    unknown = dataclasses.replace(
        prof,
        layers=[dataclasses.replace(lp, saved_input_bytes=0, saved_output_bytes=0) for lp in prof.layers],
        loss=dataclasses.replace(prof.loss, saved_input_bytes=0, saved_target_bytes=0),
    )
    upper = stage_bytes(unknown, [2, 2], 0.0)  # nothing known to be shared: every layer's own bytes
    assert upper[0].saved == 4 * u  # all four, the output again beside them: an upper bound
    assert upper[1].saved == 6 * u + 4  # the layers' four, the loss's input and target, the loss


def test_a_view_or_in_place_layer_joins_the_storages_around_it() -> None:
    # Unflatten and Flatten return views (so do their backwards), the in-place ReLU its input: u each
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (2, 4)), nn.Flatten(), nn.Linear(8, 8),
                          nn.ReLU(inplace=True))  # fmt: skip
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    prof = profile(model, x, loss_fn=nn.functional.mse_loss, target=y, warmup=0, repeat=1)
    flags = [(lp.output_aliases_input, lp.input_grad_aliases) for lp in prof.layers]
    assert flags == [(False, False), (True, True), (True, True), (False, False), (True, False)]
    u = float(x.nbytes)
    first, last = stage_bytes(prof, [2, 3], 0.0)
    # stage 1 starts at the Flatten: the Linear saves a view of the received input (held as the
    # input), the ReLU its output in place, which the loss saves too: one storage
    assert (last.saved, last.input, last.output) == (u + 4, u, 0.0)  # and the loss, 4 bytes
    # split: the Flatten's output gradient is the input gradient it sends, kept until W; the
    # Linear's output gradient (the ReLU's input's) is a storage of its own; the loss's (ones)
    assert (last.grads, last.input_grad_kept) == (u + 4, True)
    # stage 0 sends the Unflatten's output, a view of the Linear's: one storage, counted as output
    assert (first.saved, first.output, first.grads, first.output_is_input) == (0.0, u, 0.0, False)
    mid = stage_bytes(prof, [4, 1], 0.0)[0]  # the second Linear saves a view of the first's output
    assert (mid.saved, mid.output, mid.grads) == (u, u, u)
    # a stage of the two views sends its input's storage, but receives a gradient of its own
    views = stage_bytes(prof, [1, 2, 2], 0.0)[1]
    assert (views.input, views.output, views.output_is_input) == (u, u, True)
    sched = schedule("1f1b", 3, 1)
    # rank 1 holds the input buffer (also what it sends), then the received gradient, never both
    # sent and input apart: u at once beside the input gradient it makes
    alone = [StageBytes(saved=0.0, input=0.0, output=0.0), dataclasses.replace(views, saved=0.0, static=0.0,
             transient_backward=0.0), StageBytes(saved=0.0, input=0.0, output=0.0)]  # fmt: skip
    apart = [alone[0], dataclasses.replace(alone[1], output_is_input=False), alone[2]]
    assert rank_peaks(sched, alone, "never")[1] == 2 * u  # the input, then the gradient beside it
    assert rank_peaks(sched, apart, "never")[1] == 3 * u  # a sent copy counted apart


# -- the solver's rows: coefficients from the walk with unit bytes, an upper bound of the walk ----------

MODES = ("never", "always", "except_last")


def _random_schedule(rng: random.Random) -> tuple[str, int, int, int]:
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
    p = rng.randint(1 if name != "interleaved-1f1b" else 2, 4)
    v = rng.randint(2, 3) if name == "interleaved-1f1b" else 2 if name == "zb-v" else 1
    m = p * rng.randint(1, 3) if name == "interleaved-1f1b" else rng.randint(1, 8)
    return name, p, m, v


def _figures(values: dict[str, float]) -> dict[str, Any]:
    return values  # StageBytes(**...) with its flag among the fields: no float for a bool, says mypy


@pytest.mark.parametrize("seed", range(6))
def test_coefficients_times_the_figures_bound_the_walk(seed: int) -> None:
    # any figures, any schedule, any modes per stage: a rank's walked peak <= sum over its stages of
    # static + coefficient x figure; with one figure alone (its count peaks at one moment) v = 1 is equal
    rng = random.Random(seed)
    for _ in range(25):
        name, p, m, v = _random_schedule(rng)
        sched, k = schedule(name, p, m, n_virtual=v), p * v
        modes = tuple(rng.choice(MODES) for _ in range(k))
        figures = [
            StageBytes(
                **_figures({f: float(rng.randint(0, 100)) for f in PARTS}), static=float(rng.randint(0, 100))
            )
            for s in range(k)
        ]
        coef = coefficients(sched, modes)
        walked = rank_peaks(sched, figures, modes)
        for r in range(p):
            bound = sum(figures[s].static + sum(coef[s][f] * getattr(figures[s], f) for f in PARTS)
                        for s in sched.stages_of(r))  # fmt: skip
            assert walked[r] <= bound
        for f in PARTS:
            alone = [StageBytes(**_figures({**dict.fromkeys(PARTS, 0.0), f: 1.0})) for _ in range(k)]
            per_rank = rank_peaks(sched, alone, modes)
            for r in range(p):
                chunks = sum(coef[s][f] for s in sched.stages_of(r))
                assert per_rank[r] <= chunks and (v > 1 or per_rank[r] == chunks)


def test_zb_h1_coefficients_count_the_output_gradients_kept_from_b_to_w() -> None:
    # zb-h1 holds each micro-batch's layer output gradients from its B to its W: with p = 2, m = 4
    # rank r has r W's deferred besides the one right after its B (the closed form's "r pending W's"),
    # 1f1b none (it has no such state)
    zb = coefficients(schedule("zb-h1", 2, 4), "never")
    assert [c["grads"] for c in zb] == [1.0, 2.0]
    assert all(c["grads"] == 0.0 for c in coefficients(schedule("1f1b", 2, 4), "never"))


def _shared_profile(n: int, seed: int) -> Profile:
    """n layers with random sizes, each saving some of its input and output (shared with its
    neighbours), and a loss saving its input and its target."""
    rng = random.Random(seed)
    layers = []
    for i in range(n):
        act = rng.randint(1, 8) * 256
        inp = rng.choice([0, 256, 512])
        out = rng.choice([0, act])
        layers.append(
            LayerProfile(
                i,
                f"l{i}",
                "Linear",
                1e-3,
                2e-3,
                10,
                rng.randint(0, 4) * 4096,
                act,
                inp + out + rng.randint(0, 4) * 256,
                (1,),
                "float32",
                buffer_bytes=rng.randint(0, 64),
                **{f: rng.randint(0, 8) * 256 for f in _TRANSIENTS},
                saved_input_bytes=inp,
                saved_output_bytes=out,
                output_aliases_input=rng.random() < 0.3,  # views: fewer storages, never more bytes
                input_grad_aliases=rng.random() < 0.3,
            )
        )
    # a loss larger than a scalar, so that each micro-batch's, kept to the step's end, weighs
    loss = LayerProfile(n, "loss", "MSELoss", 1e-4, 1e-4, 1, 0, rng.randint(1, 8) * 256, 512, (1,), "float32",
                        saved_input_bytes=256, saved_target_bytes=256,
                        **{f: rng.randint(0, 8) * 256 for f in _TRANSIENTS})  # fmt: skip
    return Profile(layers, "cpu", layer_graph(layers), input_bytes=256, loss=loss)


_TRANSIENTS = ("forward_transient_bytes", "backward_transient_bytes", "input_transient_bytes",
               "weight_transient_bytes", "closing_backward_transient_bytes",
               "closing_input_transient_bytes", "closing_weight_transient_bytes")  # fmt: skip


def test_each_compute_is_charged_its_own_transient() -> None:
    # distinct figures per part: W is charged the weight gradients' (not the whole backward's), B
    # (split) the input gradients', the last stage's last layer its closing figures (its output and
    # gradient freed inside, by the loss's: no read added), a recomputing F its outputs beside
    def lp(i: int, act: int, **figures: int) -> LayerProfile:
        return LayerProfile(i, str(i), "Linear", 1e-3, 1e-3, 1, 0, act, 0, (1,), "float32", **figures)

    layers = [lp(0, 64, forward_transient_bytes=1, backward_transient_bytes=10, weight_transient_bytes=30,
                 closing_backward_transient_bytes=9000),
              lp(1, 32, forward_transient_bytes=7, backward_transient_bytes=100, input_transient_bytes=200,
                 weight_transient_bytes=300, closing_backward_transient_bytes=400,
                 closing_input_transient_bytes=500, closing_weight_transient_bytes=600)]  # fmt: skip
    loss = lp(2, 4, forward_transient_bytes=3, backward_transient_bytes=5, input_transient_bytes=5)
    first, last = stage_bytes(Profile(layers, "cpu", layer_graph(layers), loss=loss), [1, 1], 0.0)
    assert (first.transient_backward, first.transient_input_grad, first.transient_weight) == (10, 0, 30)
    # B beside the loss's gradient it starts from (ones, the loss's 4 bytes); W reads it as held (grads)
    assert (last.transient_backward, last.transient_input_grad, last.transient_weight) == (404, 504, 600)
    assert first.transient_recompute == 1 + 64  # its transient and output (its input: the data)
    assert last.transient_recompute == 7 + 32  # more than the loss's: its input, transient, output
    # the walk charges each compute its own: W only in a split schedule, F's recompute figure only
    # where it recomputes
    split = coefficients(schedule("zb-h1", 2, 4), "never")
    unsplit = coefficients(schedule("1f1b", 2, 4), "never")
    assert all(c["transient_weight"] == 1.0 and c["transient_backward"] == 0.0 for c in split)
    assert all(c["transient_weight"] == 0.0 and c["transient_backward"] == 1.0 for c in unsplit)
    assert all(c["transient_recompute"] == 0.0 for c in split)
    assert all(c["transient_recompute"] == 1.0 for c in coefficients(schedule("1f1b", 2, 4), "always"))


@pytest.mark.parametrize("seed", range(4))
def test_rows_bound_the_walk_for_every_balance(seed: int) -> None:
    # the rows ``solve`` takes (plus each stage's offset) bound the walk of every balance: a balance
    # that fits them fits what a run holds
    rng = random.Random(seed)
    for _ in range(12):
        name, p, m, v = _random_schedule(rng)
        sched, k = schedule(name, p, m, n_virtual=v), p * v
        n = k + rng.randint(0, 6)
        prof = _shared_profile(n, rng.randint(0, 10_000))
        modes = tuple(rng.choice(MODES) for _ in range(k))
        rows, offsets = memory_rows(prof, sched, modes, 2.0)
        cuts = sorted(rng.sample(range(1, n), k - 1))
        balance = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        walked = rank_peaks(sched, stage_bytes(prof, balance, 2.0), modes)
        per_stage = [x + off for x, off in zip(stage_memory(rows, balance), offsets, strict=True)]
        for r in range(p):
            assert walked[r] <= sum(per_stage[s] for s in sched.stages_of(r)) * (1 + 1e-12)


def test_layer_bounds_count_a_storage_two_layers_save_once() -> None:
    # each layer saves its input and its output (the next layer's input): u each, counted once
    # (layer 0's input is the step's data, not counted); the loss saves its input and its target
    u = 1024
    layers = [LayerProfile(i, str(i), "ReLU", 1e-3, 1e-3, 1, 0, u, 2 * u, (1,), "float32",
                           saved_input_bytes=u, saved_output_bytes=u) for i in range(4)]  # fmt: skip
    loss = LayerProfile(4, "loss", "MSELoss", 1e-4, 1e-4, 1, 0, 4, 2 * u, (1,), "float32",
                        saved_input_bytes=u, saved_target_bytes=u)  # fmt: skip
    prof = Profile(layers, "cpu", layer_graph(layers), input_bytes=u, loss=loss)
    assert layer_bounds(prof, 2.0)["saved"] == [u, u, u, u + 4]  # the last: the loss too (4 bytes)
