"""Variable-length steps (``pipeline.runtime.inputs.varlen``): packing, order, and transparency end to end.

The unit tests pin the packing against brute force, the order against the simulator, and every
refusal. The launches run the reference GPT on sequences of many lengths under every schedule,
2 and 4 ranks, recomputation off and on, against one process taking the mean over every target
token of the step (each sequence padded, the padding ignored by the loss); and once under the
NCCL emulation, whose receive buffers then change shape with every micro-batch.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partitioner import plan_for, profile
from partitioner.figures import Profile
from partitioner.lengths import share
from pipeline.plan import REPLICA_BYTES, DeviceMemory, replica_bytes
from pipeline.reference.models import gpt, gpt_loss, with_documents
from pipeline.runtime.inputs.varlen import (
    StepCosts,
    StepMemory,
    VarLen,
    _fill,
    _width,
    lengths_of,
    order,
    pack,
    pad,
    plan_step,
    positions,
    step_costs,
    unpad,
    widths_of,
)
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.peaks import PARTS, StageBytes
from pipeline.schedules.program import play
from pipeline.schedules.registry import REGISTRY
from pipeline.schedules.schedule import Schedule, schedule
from tests.dist import job, run_ranks
from tests.pipe_common import assert_close, balance_of, grads_of

VOCAB, MAX_LEN, M = 16, 24, 4
LENGTHS = [3, 17, 9, 24, 5, 12, 1, 20, 7, 15, 2, 11]  # 12 sequences of every length up to MAX_LEN
OPTS = VarLen(token_budget=64, max_len=MAX_LEN)
DOCS = VarLen(token_budget=64, max_len=MAX_LEN, pad_multiple=3, documents=True)  # rows end to end, a pad tail
CONFIGS = [(name, e.default_virtual) for name, e in REGISTRY.items()]


# ---- packing


def _brute(lengths: list[int], m: int, multiple: int) -> int:
    """The least largest padded group over every contiguous split of the sorted lengths."""
    n = len(lengths)
    widths = [_width(x, multiple) for x in sorted(lengths, reverse=True)]
    return min(
        max((b - a) * widths[a] for a, b in zip((0, *cuts), (*cuts, n), strict=True))
        for cuts in itertools.combinations(range(1, n), m - 1)
    )


def test_packing_is_the_least_largest_micro_batch_of_sorted_groups() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        m, multiple = rng.randint(1, n), rng.choice([1, 1, 4])
        lengths = [rng.randint(1, 50) for _ in range(n)]
        groups = pack(lengths, m, VarLen(token_budget=10**6, pad_multiple=multiple))
        assert len(groups) == m and all(groups)
        assert sorted(j for g in groups for j in g) == list(range(n))  # each sequence once
        widest = max(len(g) * _width(max(lengths[j] for j in g), multiple) for g in groups)
        assert widest == _brute(lengths, m, multiple), (lengths, m, multiple)


def test_pad_fills_each_micro_batch_past_each_sequence() -> None:
    seqs = [torch.arange(1, n + 1) for n in (3, 1, 2)]
    sched = schedule("gpipe", 1, 2)
    packed = plan_step([3, 1, 2], sched, VarLen(token_budget=8), step_costs(None, sched))
    batches = pad(seqs, packed, -1)
    shapes = [(len(g), w) for g, w in zip(packed.groups, packed.widths, strict=True)]
    assert [tuple(b.shape) for b in batches] == shapes
    for batch, group in zip(batches, packed.groups, strict=True):
        for row, j in zip(batch, group, strict=True):
            assert row[: len(seqs[j])].tolist() == seqs[j].tolist()
            assert (row[len(seqs[j]) :] == -1).all()
    assert packed.tokens == 6 and packed.padded_tokens >= 6 and 0 <= packed.padding_share < 1


def test_documents_fill_rows_longest_first_within_a_third_of_the_best() -> None:
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 7)
        m, multiple = rng.randint(1, min(n, 3)), rng.choice([1, 1, 4])
        lengths = [rng.randint(1, 50) for _ in range(n)]
        opts = VarLen(token_budget=10**6, pad_multiple=multiple, documents=True)
        groups = pack(lengths, m, opts)
        assert len(groups) == m and all(groups)  # every row holds a document
        assert sorted(j for g in groups for j in g) == list(range(n))  # each sequence once
        widest = max(widths_of(groups, lengths, opts))
        best = min(  # every assignment of the sequences to m rows
            max(
                _width(sum(x for x, r in zip(lengths, rows, strict=True) if r == i), multiple)
                for i in range(m)
            )
            for rows in itertools.product(range(m), repeat=n)
            if len(set(rows)) == m
        )
        assert widest <= best * 4 / 3 + multiple, (lengths, m, multiple)  # LPT's bound, the rounding on top


def test_documents_fill_rows_to_the_budget_where_balancing_overflows_it() -> None:
    # balanced longest first: 3 + 2 + 2 = 7 | 3 + 2, over 6; filled to 6: 3 + 3 | 2 + 2 + 2
    opts = VarLen(token_budget=6, documents=True)
    assert sorted(pack([3, 3, 2, 2, 2], 2, opts)) == [(0, 1), (2, 3, 4)]
    # filled to the budget, a row left empty takes the last sequence of the row holding the most
    assert _fill([1, 1, 1, 2], 3, opts) == [[3, 0], [2], [1]]


def test_documents_are_laid_end_to_end_with_positions_from_zero() -> None:
    seqs = [torch.arange(1, n + 1) for n in (3, 1, 2, 4)]
    sched = schedule("gpipe", 1, 2)
    opts = VarLen(token_budget=8, pad_multiple=3, documents=True)
    packed = plan_step([3, 1, 2, 4], sched, opts, step_costs(None, sched))
    assert packed.documents and sorted(packed.groups) == [(0, 2), (3, 1)]  # 4 + 1 and 3 + 2 tokens
    assert packed.shapes == [(1, 6)] * 2 and packed.padded_tokens == 12 and packed.tokens == 10
    rows, pos = pad(seqs, packed, -1), positions(packed, torch.device("cpu"))
    by_group = {g: (r[0].tolist(), p[0].tolist()) for g, r, p in zip(packed.groups, rows, pos, strict=True)}
    assert by_group[(3, 1)] == ([1, 2, 3, 4, 1, -1], [0, 1, 2, 3, 0, 0])  # the pad: a document of its own
    assert by_group[(0, 2)] == ([1, 2, 3, 1, 2, -1], [0, 1, 2, 0, 1, 0])


def test_with_documents_keeps_the_weights_and_their_names() -> None:
    built = gpt(vocab_size=VOCAB, width=16, n_layers=1, n_heads=2, max_seq_len=MAX_LEN, batch_size=3)
    with torch.no_grad():
        built[0][-2].weight.normal_()  # a trained final norm, not its initial ones
    before = {k: v.clone() for k, v in built[0].state_dict().items()}
    storage = built[0][-2].weight.data_ptr()
    model, (tokens, pos) = with_documents(built)
    assert model[-2].weight.data_ptr() == storage  # the norm's own tensor: its device and dtype kept
    torch.testing.assert_close(dict(model.state_dict()), before, rtol=0, atol=0)
    assert tokens is built[1] and pos.tolist() == [list(range(MAX_LEN))] * 3  # one document a row


def test_a_row_of_documents_attends_within_each_document_alone() -> None:
    """with_documents(gpt(...)) on one packed row equals gpt(...) on each sequence alone, token by token."""
    model = _model(documents=True)
    plain = _model()
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (5, 1, 9)]
    row, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(x)) for x in seqs])[None]  # (1, 15)
    packed = model((row, pos))[0]  # (15, V)
    alone = torch.cat([plain(x[None])[0] for x in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_a_row_of_documents_is_priced_as_one_row() -> None:
    sched = schedule("1f1b", 4, 4)
    rows = [(0, 1), (2,), (3, 4, 5), (6,)]
    widths = [40, 20, 30, 3]
    costs = _costs(4, squared=0.5)
    as_single_rows = order([(g,) for g in range(4)], widths, sched, costs)
    assert order(rows, widths, sched, costs, documents=True) == as_single_rows
    assert order(rows, widths, sched, costs)[1] != as_single_rows[1]  # as padded groups, other costs


def test_the_order_is_the_fastest_the_simulator_finds() -> None:
    sched = schedule("1f1b", 4, 4)
    groups = [(0,), (1, 2), (3, 4, 5, 6), (7,)]
    widths = [40, 20, 6, 3]
    costs = step_costs(None, sched)
    perm, results, peaks = order(groups, widths, sched, costs)
    assert sorted(perm) == [0, 1, 2, 3] and len(results) >= 4 and peaks == []  # no plan: no memory check
    assert max(results.values()) > min(results.values())  # the orders differ here
    # the order returned, played on its own: the least step of the candidates
    size = [len(g) * w for g, w in zip(groups, widths, strict=True)]
    scale = [size[g] / (sum(size) / len(size)) for g in perm]
    played = play(sched.programs(), lambda a: costs.seconds[a.kind][a.stage] * scale[a.microbatch])
    assert max(played.ends) == pytest.approx(min(results.values()))
    packed = plan_step([40, 10, 10, 2, 2, 2, 2, 3], sched, VarLen(token_budget=64), costs)
    assert packed.seconds < 0.05  # a few milliseconds per step


# ---- the cost of a micro-batch's shape, and the memory limit


def _costs(p: int, squared: float, memory: StepMemory | None = None) -> StepCosts:
    """Hand-made costs at micro-batches of 4 x 64: F 1, B 2, W 1 on every stage, ``squared`` of each
    growing as rows x length²."""
    seconds = {Kind.F: [1.0] * p, Kind.B: [2.0] * p, Kind.W: [1.0] * p}
    return StepCosts(seconds, {kind: [squared] * p for kind in seconds}, (4, 64), memory)


def _played(sched: Schedule, groups: list[tuple[int, ...]], widths: list[int], perm: list[int],
            costs: StepCosts) -> float:  # fmt: skip
    """The step of ``perm`` played with ``costs`` worked out here: t0 [(1 - q) rL / 256 + q rL² / 64²/4]."""
    shapes = [(len(groups[g]), widths[g]) for g in perm]

    def cost(a: Action) -> float:
        rows, length = shapes[a.microbatch]
        q = costs.squared[a.kind][a.stage]
        return costs.seconds[a.kind][a.stage] * (
            (1 - q) * rows * length / 256 + q * rows * length**2 / (4 * 64**2)
        )

    return max(play(sched.programs(), cost).ends)


def _groups(shapes: list[tuple[int, int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Groups of consecutive sequence indices with these (rows, width)."""
    groups, start = [], 0
    for rows, _ in shapes:
        groups.append(tuple(range(start, start + rows)))
        start += rows
    return groups, [w for _, w in shapes]


def test_the_length_squared_term_changes_the_order_it_prices() -> None:
    # 128, 512, 224 and 48 tokens; rows x length² 16384, 32768, 7168 and 768: a token count ranks
    # them otherwise than attention's cost does
    sched = schedule("1f1b", 2, 4)
    groups, widths = _groups([(1, 128), (8, 64), (7, 32), (3, 16)])
    linear, _, _ = order(groups, widths, sched, _costs(2, 0.0))
    squared, results, _ = order(groups, widths, sched, _costs(2, 0.8))
    assert squared != linear
    true = _costs(2, 0.8)  # priced with the length² term, the order chosen with it is the fastest
    assert _played(sched, groups, widths, squared, true) == pytest.approx(min(results.values()))
    assert _played(sched, groups, widths, linear, true) > 1.1 * _played(sched, groups, widths, squared, true)


def test_the_fastest_order_that_fits_the_memory_limit_is_chosen() -> None:
    # per micro-batch of 4 x 64: 1000 bytes kept by its graph, 100 sent and received
    sched = schedule("1f1b", 2, 4)
    stages = [
        StageBytes(saved=1000.0, input=0.0, output=100.0),
        StageBytes(saved=1000.0, input=100.0, output=0.0),
    ]
    groups, widths = _groups([(3, 128), (2, 32), (2, 64), (8, 64)])  # 384, 64, 128 and 512 tokens

    def limited(limit: float) -> StepCosts:
        return _costs(2, 0.0, StepMemory(stages, ["never", "never"], [limit, limit], "a test's limit"))

    fastest, _, peaks = order(groups, widths, sched, limited(1e12))
    # the two largest (512 + 384 tokens) held at once on rank 0: 1000 x 3.5 + 1000 x 0.5 + buffers
    assert max(peaks) == 4200.0 and fastest == [3, 0, 2, 1]
    fits, _, peaks = order(groups, widths, sched, limited(4000.0))
    assert fits != fastest and max(peaks) <= 4000.0
    plain = _costs(2, 0.0)  # it is slower: chosen for the limit alone
    assert _played(sched, groups, widths, fits, plain) > _played(sched, groups, widths, fastest, plain)
    with pytest.raises(ValueError, match=(
        r"no run order of this step's micro-batches fits the memory limit: with its longest micro-batch "
        r"\(3 sequences padded to 128 tokens: \[0, 1, 2\]\), rank 0's predicted peak is 0.0027 MB at best "
        r"\(order '.*'\), over its limit 0.0025 MB \(a test's limit\); lower VarLen\(token_budget=...\) "
        r"below its 384 padded tokens.*or raise the limit \(partition\(..., memory_limit=...\)\)"
    )):  # fmt: skip
        order(groups, widths, sched, limited(2500.0))
    # rows of documents: a row is the step's tokens over m, which the token budget cannot shorten
    with pytest.raises(ValueError, match=(
        r"with its longest row of documents \(3 sequences end to end, 512 tokens: \[0, 1, 2\]\), rank "
        r"\d's predicted peak .*; pass fewer tokens per step or plan more n_microbatches"
    )):  # fmt: skip
        order(groups, [512, 32, 64, 64], sched, limited(2500.0), documents=True)


def test_each_rank_s_replica_bytes_count_against_the_limit() -> None:
    # a rank of replicas or shards also holds their scalars (pipeline.plan.replica_bytes), as the
    # plan's rank_peaks count them: an order whose walk meets the limit exactly no longer fits
    sched = schedule("gpipe", 1, 1)
    stages = [StageBytes(saved=1000.0, input=0.0, output=0.0)]
    beside = replica_bytes(2, 1)
    assert beside == REPLICA_BYTES and replica_bytes(1, 1) == 0.0 and replica_bytes(1, 2) == beside

    def limited(extra: float) -> StepCosts:
        return _costs(1, 0.0, StepMemory(stages, ["never"], [1000.0], "a test's limit", extra))

    assert order([(0, 1, 2, 3)], [64], sched, limited(0.0))[2] == [1000.0]
    with pytest.raises(ValueError, match="no run order of this step's micro-batches fits the memory limit"):
        order([(0, 1, 2, 3)], [64], sched, limited(beside))


def test_memory_grows_with_the_tokens_and_the_length_squared_share() -> None:
    # one micro-batch alone: its rank holds its graph's saved bytes, 1000 at 4 x 64, half of them
    # growing as rows x length² (scores a kernel materialises), half as the tokens
    sched = schedule("gpipe", 1, 1)
    shares = tuple(0.5 if f == "saved" else 0.0 for f in PARTS)
    memory = StepMemory(
        [StageBytes(saved=1000.0, input=0.0, output=0.0, squared=shares)], ["never"], [1e12], ""
    )
    costs = _costs(1, 0.0, memory)

    def peak(rows: int, length: int) -> float:
        return order([tuple(range(rows))], [length], sched, costs)[2][0]

    assert peak(4, 64) == 1000.0  # the plan's own shape
    assert peak(4, 32) == pytest.approx(500 * 0.5 + 500 * 0.25)  # half the tokens, a quarter the squares
    assert peak(1, 256) == pytest.approx(500 * 1 + 500 * 4)  # the same tokens, 4 x the length
    assert peak(8, 32) == pytest.approx(500 * 1 + 500 * 0.5)


class _Attention(nn.Module):
    """Self-attention whose scores are materialised (a math kernel's): (R, L, W) -> (R, L, W)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1)
        return x + scores @ v


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(x)))


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.fixture(scope="module")
def toy() -> tuple[nn.Sequential, Profile]:
    """Attention then an MLP, width 16, profiled at 2 x 32 tokens (and probed at 4 x 16)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(16), _Mlp(16))
    x, y = torch.randn(2, 32, 16), torch.randint(0, 16, (2, 32))
    return model, profile(model, x, loss_fn=_token_loss, target=y, warmup=0, repeat=1)


def test_the_profile_splits_attention_s_length_squared_share_from_an_mlp_s(
    toy: tuple[nn.Sequential, Profile],
) -> None:
    _, prof = toy
    assert prof.shape == (2, 32) and prof.probe is not None and prof.probe.shape == (4, 16)
    probe = prof.probe

    def q(layer: int, figure: str) -> float:
        return share(
            getattr(prof.layers[layer], figure), getattr(probe.layers[layer], figure), (2, 32), (4, 16)
        )

    # attention's forward per token: 6 W² + W (its Linear, the residual) + L (4 W + 2) (q k^T, scale,
    # softmax, scores v): the last term's share at L = 32, W = 16 is 2112 / 3664
    assert q(0, "flops") == pytest.approx(2112 / 3664, rel=0.01)
    for figure in ("backward_flops", "weight_flops", "saved_bytes"):  # (layer 0 has no input gradient)
        assert q(0, figure) > 0.2, figure  # the scores' products, and the scores it keeps
    for figure in (
        "flops",
        "backward_flops",
        "input_flops",
        "weight_flops",
        "saved_bytes",
        "activation_bytes",
    ):
        assert q(1, figure) == 0.0, figure  # per token the same at any length
    plan = plan_for(prof, [1, 1], n_microbatches=2)
    first, second = plan.stages
    assert first.held is not None and second.held is not None and plan.micro_batch_shape == [2, 32]
    assert min(first.forward_squared, first.backward_squared, first.held.squared[PARTS.index("saved")]) > 0.2
    assert (second.forward_squared, second.backward_squared, any(second.held.squared)) == (0.0, 0.0, False)
    # a layer that cannot take half the length (features, not tokens) leaves no probe: all linear
    assert profile(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), warmup=0, repeat=1).probe is None


def test_a_plan_bounds_each_step_by_its_memory(toy: tuple[nn.Sequential, Profile]) -> None:
    model, prof = toy
    plan = plan_for(prof, [2], n_microbatches=2)  # one rank: a Pipeline in this process
    sched = plan.build_schedule()
    costs = step_costs(plan, sched)
    assert (
        costs.memory is not None and costs.memory.limits == plan.rank_peaks
    )  # no memory_limit: its own peak
    assert order(*_groups([(2, 32), (2, 32)]), sched, costs)[2] == plan.rank_peaks  # the partitioner's walk
    replicated = plan_for(prof, [2], n_microbatches=2, dp=2)  # its ranks hold the replicas' scalars too
    assert replicated.rank_peaks == [peak + REPLICA_BYTES for peak in plan.rank_peaks]
    walked = order(*_groups([(2, 32), (2, 32)]), sched, step_costs(replicated, sched))[2]
    assert walked == replicated.rank_peaks
    pipe = Pipeline(model, plan, loss_fn=_token_loss, varlen=VarLen(token_budget=64))

    def step(lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(0)
        pipe.step([torch.randn(n, 16, generator=g) for n in lengths],
                  [torch.randint(0, 16, (n,), generator=g) for n in lengths])  # fmt: skip

    step([20, 12, 30, 10, 16, 16])  # 2 x 30 and 4 x 16: within 2 x 32's
    assert pipe.last_packing is not None and max(pipe.last_packing.peaks) <= max(plan.rank_peaks)
    # as many tokens as 2 x 32 in one sequence of 64: its scores (L²) are over the plan's peak
    with pytest.raises(ValueError, match=r"longest micro-batch \(1 sequence padded to 64 tokens: \[0\]\)"):
        step([64, 8, 8, 8, 8])
    roomy = plan.replace(memory_limit=[2 * plan.rank_peaks[0]])  # the limit partition was given, when it was
    assert order(*_groups([(1, 64), (4, 8)]), sched, step_costs(roomy, sched))[2]
    # a device that keeps workspaces and a headroom: the steps get the limit less that (0.3 x the peak)
    device = DeviceMemory(device="cuda:0", workspace_bytes=1.5 * plan.rank_peaks[0], headroom=0.1)
    reserved = roomy.replace(device_memory=device)
    costs = step_costs(reserved, sched)
    assert costs.memory is not None and costs.memory.limits == reserved.usable_limits()
    with pytest.raises(
        ValueError, match=r"the memory_limit the plan was made under, less the device's reserve"
    ):
        order(*_groups([(2, 32), (2, 32)]), sched, costs)


@pytest.mark.parametrize(
    ("lengths", "opts", "match"),
    [
        ([5, 5, 5], VarLen(token_budget=64), r"3 sequences but the pipeline runs n_microbatches=4"),
        ([30, 30, 30, 30, 30], VarLen(token_budget=32), r"need 60 padded tokens .*token_budget=32"),
        (
            [30, 30, 30, 3, 30],
            VarLen(token_budget=32, documents=True),
            r"need a row of 33 tokens .*token_budget=32",
        ),
    ],
)
def test_a_step_that_cannot_be_packed_is_refused(lengths: list[int], opts: VarLen, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack(lengths, 4, opts)


@pytest.mark.parametrize(
    ("seqs", "opts", "match"),
    [
        ([torch.arange(30)], VarLen(token_budget=64, max_len=24), r"more than the model's max_len 24"),
        ([torch.arange(30)], VarLen(token_budget=16), r"30 tokens, more than VarLen\(token_budget=16\)"),
        ([torch.arange(3), torch.arange(0)], OPTS, r"inputs\[1\] is empty"),
        ([torch.arange(3), torch.arange(3.0)], OPTS, r"inputs\[1\] is torch.float32 .* only in length"),
        ([], OPTS, r"inputs must be a non-empty list"),
        ([torch.tensor(3)], OPTS, r"inputs\[0\] must be a tensor of at least one dimension"),
    ],
)
def test_bad_sequences_are_refused(seqs: list[Any], opts: VarLen, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lengths_of(seqs, "inputs", opts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_budget": 0}, r"token_budget=0\): must be an integer >= 1"),
        ({"token_budget": 8, "max_len": 0}, r"max_len=0\)"),
        ({"token_budget": 8, "pad_multiple": 2.0}, r"pad_multiple=2.0\)"),
        ({"token_budget": 8, "ignore_index": None}, r"ignore_index=None\): must be an integer"),
        ({"token_budget": 8, "documents": 1}, r"documents=1\): must be True or False"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VarLen(**kwargs)


# ---- end to end


def _data(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step's sequences and their next-token targets, a few target tokens ignored."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)  # seed 0: LENGTHS; later steps: other lengths, so other shapes
    lengths = list(LENGTHS) if seed == 0 else [rng.randint(1, MAX_LEN) for _ in LENGTHS[:-1]] + [17]
    lengths[1] = max(lengths[1], 6)
    xs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ys = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ys[1][:5] = -100  # a prompt whose tokens the loss ignores: weights count target tokens, not lengths
    return xs, ys


def _model(documents: bool = False) -> nn.Sequential:
    """The same weights either way; ``documents``: it also takes (tokens, position ids)."""
    torch.manual_seed(0)
    built = gpt(vocab_size=VOCAB, width=16, n_layers=6, n_heads=2, max_seq_len=MAX_LEN)
    return with_documents(built)[0] if documents else built[0]


def _reference(seeds: tuple[int, ...] = (0,)) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, every sequence of a step padded to the longest: each step's mean over every
    target token, and the gradients summed over the steps."""
    model = _model()
    losses = []
    for seed in seeds:
        xs, ys = _data(seed)
        x = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
        y = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
        loss = gpt_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses, grads_of(model.named_parameters())


def _matrix() -> dict[str, Any]:
    p, out = dist.get_world_size(), {}
    for (sched, v), mode, opts in itertools.product(CONFIGS, ("never", "always"), (OPTS, DOCS)):
        model = _model(opts.documents)
        pipe = Pipeline(
            model, balance_of(len(model), p * v), schedule=sched, n_virtual=v, n_microbatches=M,
            recompute=mode, loss_fn=gpt_loss, varlen=opts, timeout=30.0,
        )  # fmt: skip
        xs, ys = _data()
        loss = pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None)
        packing = pipe.last_packing
        key = f"{sched}/{mode}{'/documents' if opts.documents else ''}"
        out[key] = (loss, grads_of(pipe.named_parameters()), packing)
    return out


_JOBS = {p: job(p, _matrix, timeout=180.0, batch="c") for p in (2, 4)}


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_one_process_over_the_same_tokens(
    p: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = _JOBS[p].results(tmp_path_factory)
    (loss_ref,), grads_ref = _reference()
    for key in results[0]:
        losses = [r[key][0] for r in results]
        assert all(abs(v - loss_ref) <= 1e-5 * abs(loss_ref) for v in losses), (key, losses, loss_ref)
        merged = {k: g for r in results for k, g in r[key][1].items()}
        assert sum(len(r[key][1]) for r in results) == len(grads_ref)
        assert_close(merged, grads_ref, f"p={p} {key}")
        first, last = results[0][key][2], next(r[key][2] for r in reversed(results) if r[key][2] is not None)
        assert first is not None and first.groups == last.groups  # packed alike at both ends
        assert max(r * w for r, w in first.shapes) <= OPTS.token_budget
        # documents: one row each, padded only to the next multiple of 3, every sequence whole once
        assert first.documents == key.endswith("/documents")
        if first.documents:
            assert {r for r, _ in first.shapes} == {1} and all(w % 3 == 0 for w in first.widths)
            assert first.padded_tokens - sum(LENGTHS) < 3 * M and first.padded_tokens > sum(LENGTHS)
            assert sorted(j for g in first.groups for j in g) == list(range(len(LENGTHS)))


SEEDS = (0, 1, 2)  # three steps: the first sets up the shape rules, the others' new shapes use them


def _emulated(
    opts: VarLen,
) -> tuple[list[float], dict[str, torch.Tensor], list[list[tuple[int, int]]], int, int]:
    model = _model(opts.documents)
    p = dist.get_world_size()
    pipe = Pipeline(model, balance_of(len(model), p), schedule="1f1b", n_microbatches=M, loss_fn=gpt_loss,
                    varlen=opts, timeout=30.0)  # fmt: skip
    losses, shapes = [], []
    for seed in SEEDS:
        xs, ys = _data(seed)
        losses.append(pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None))
        shapes.append([tuple(sig[0][0]) for sig in pipe.runner.describer.micro])
    described = pipe.runner.describer
    distinct = len({sig for step in shapes for sig in step})
    return losses, grads_of(pipe.named_parameters()), shapes, described.fake_derivations, distinct  # type: ignore[return-value]


@pytest.mark.parametrize("opts", [OPTS, DOCS], ids=["padded", "documents"])
def test_shapes_that_change_per_micro_batch_pass_the_nccl_emulation(tmp_path: Path, opts: VarLen) -> None:
    results = run_ranks(tmp_path, _emulated, 2, opts, timeout=60.0, backend="nccl-emulated")
    losses_ref, grads_ref = _reference(SEEDS)
    for r in results:
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r[0], losses_ref, strict=True)), (
            r[0],
            losses_ref,
        )
    assert_close({k: g for r in results for k, g in r[1].items()}, grads_ref, "emulated")
    shapes, fake, distinct = results[1][2], results[1][3], results[1][4]
    assert shapes == results[0][2]
    per_step = [len(set(step)) for step in shapes]  # distinct shapes in each step
    # padded: each micro-batch its own shape; rows of documents balance their tokens, so their
    # widths are near (a step may have one), but differ within some step and from step to step
    assert min(per_step) == M if not opts.documents else max(per_step) > 1 and distinct > max(per_step)
    # after the first step, new shapes come from the rules: fake tensors set up only the first
    # step's and those a rule does not cover (padded: a micro-batch of one row; rows of documents
    # have a rule of their own, for one row)
    first = len(set(shapes[0]))
    later = {sig for step in shapes[1:] for sig in step} - set(shapes[0])
    uncovered = 0 if opts.documents else sum(rows == 1 for rows, _ in later)
    assert fake == results[0][3] and fake < distinct and fake <= first + uncovered


def _one_row_first() -> list[tuple[int, list[tuple[int, int]]]]:
    """Padded steps whose first has one sequence per micro-batch (every shape one row): per step,
    the fake-tensor derivations so far and the shapes new at that step."""
    model = _model()
    pipe = Pipeline(model, balance_of(len(model), 2), schedule="1f1b", n_microbatches=M, loss_fn=gpt_loss,
                    varlen=OPTS, timeout=30.0)  # fmt: skip
    xs, ys = _data()
    out, seen = [], set()
    for x, y in [(xs[:M], ys[:M]), *(_data(seed) for seed in SEEDS)]:
        pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
        shapes = {tuple(sig[0][0]) for sig in pipe.runner.describer.micro}
        out.append((pipe.runner.describer.fake_derivations, sorted(shapes - seen)))
        seen |= shapes
    return out  # type: ignore[return-value]


_ONE_ROW_FIRST = job(2, _one_row_first, timeout=120.0, batch="c")


def test_a_first_step_of_single_rows_leaves_later_rows_of_many_to_the_rules(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A rule traced at one row fixes the rows at 1; a padded run waits for a step with rows of
    many to trace its rules, and from then on only one-row shapes need fake tensors."""
    steps = _ONE_ROW_FIRST.results(tmp_path_factory)[0]
    assert all(rows == 1 for rows, _ in steps[0][1])  # the first step: every shape one row
    for (before, _), (after, new) in itertools.pairwise(steps[1:]):  # rules from step 3 on
        assert after - before == sum(rows == 1 for rows, _ in new), steps


def _both_forms() -> tuple[float, float, bool]:
    """One step given as lists, and the same as (padded, lengths) (the lengths a CPU tensor for the
    inputs, a list for the targets): both losses, and whether the gradients are equal."""
    xs, ys = _data()
    lengths = [len(x) for x in xs]
    padded_x = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=7)  # not pad_id: unread
    padded_y = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=5)
    out = []
    for x, y in [(xs, ys), ((padded_x, torch.tensor(lengths)), (padded_y, lengths))]:
        model = _model()
        pipe = Pipeline(model, balance_of(len(model), 2), schedule="1f1b", n_microbatches=M,
                        loss_fn=gpt_loss, varlen=OPTS, timeout=30.0)  # fmt: skip
        loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
        out.append((loss, grads_of(pipe.named_parameters())))
    same = all(torch.equal(g, out[1][1][k]) for k, g in out[0][1].items())
    return out[0][0], out[1][0], same


_BOTH_FORMS = job(2, _both_forms, timeout=120.0, batch="c")


def test_a_padded_tensor_with_lengths_is_the_list_of_its_sequences(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    assert all(a == b and same for a, b, same in _BOTH_FORMS.results(tmp_path_factory))
    xs = _data()[0]
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    seqs = unpad((padded, [len(x) for x in xs]), "inputs")
    assert isinstance(seqs, list) and all(torch.equal(a, b) for a, b in zip(seqs, xs, strict=True))
    assert unpad(xs, "inputs") is xs  # a list passes through


def test_predict_refuses_sequences_in_either_form() -> None:
    model = _model()
    pipe = Pipeline(model, [len(model)], schedule="1f1b", n_microbatches=M, loss_fn=gpt_loss, varlen=OPTS)
    xs = _data()[0]
    padded = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    for inputs in (xs, (padded, [len(x) for x in xs])):
        with pytest.raises(ValueError, match=r"predict\(\) takes a batch tensor .* per group of equal"):
            pipe.predict(inputs)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((torch.zeros(2, 4), [1, 2, 3]), r"got shape \[2, 4\] and 3 lengths"),
        ((torch.zeros(2, 4), [1, 5]), r"lengths\[1\] is 5, outside the padded tensor's length 1..4"),
        ((torch.zeros(2, 4), [0, 2]), r"lengths\[0\] is 0, outside .*; drop row 0"),
        ((torch.zeros(2, 4), torch.tensor([1.0, 2.0])), r"lengths must be a list of ints or a 1-dim integer"),
        ((torch.zeros(2, 4), "12"), r"lengths must be a list of ints or a CPU integer tensor, got '12'"),
        ((torch.zeros(4), [1, 2, 3, 4]), r"at least 2 dims"),
    ],
)
def test_bad_padded_forms_are_refused(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpad(value, "inputs")


def _mismatch(kind: str) -> str:
    model = _model()
    pipe = Pipeline(model, balance_of(len(model), 2), schedule="1f1b", n_microbatches=M, loss_fn=gpt_loss,
                    varlen=OPTS, timeout=30.0)  # fmt: skip
    xs, ys = _data()
    if kind == "lengths" and pipe.needs_targets:
        ys = [*ys[:-1], torch.cat([ys[-1], ys[-1][:1]])]  # one target token more than its input
    if kind == "tensor" and pipe.needs_inputs:
        xs = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)  # type: ignore[assignment]
    try:
        pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None)
    except Exception as e:  # the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("lengths", r"sequence 11 has 11 input tokens but 12 target tokens"),
        ("tensor", r"got a Tensor for inputs, but this Pipeline packs variable-length steps"),
    ],
)
def test_targets_that_do_not_match_the_inputs_fail_before_any_compute(
    kind: str, match: str, tmp_path: Path
) -> None:
    results = run_ranks(tmp_path, _mismatch, 2, kind, timeout=60.0)
    assert any(re.search(match, r) for r in results), results
    assert all(r != "no error" for r in results), results


# ---- replicas: each weighs by its target tokens, as one process over every replica's sequences

REPLICA_SEEDS = (3, 4)  # replica d's sequences: _data(REPLICA_SEEDS[d])


def _replicated() -> dict[bool, tuple[float, dict[str, torch.Tensor], int]]:
    """Per packing (documents or not): the loss, this rank's gradients, its replica."""
    from pipeline.plan import Plan

    out = {}
    for opts in (OPTS, DOCS):
        model = _model(opts.documents)
        plan = Plan(balance=balance_of(len(model), 2), schedule="1f1b", n_microbatches=M, dp=2)
        pipe = Pipeline(model, plan, loss_fn=gpt_loss, varlen=opts, timeout=30.0)
        xs, ys = _data(REPLICA_SEEDS[pipe.replica])
        loss = pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None)
        out[opts.documents] = (loss, grads_of(pipe.named_parameters()), pipe.replica)
    return out


def test_replicas_weigh_their_losses_by_target_tokens(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _replicated, 4, timeout=60.0)
    model = _model()  # one process: every replica's sequences, the mean over all their target tokens
    xs, ys = [], []
    for seed in REPLICA_SEEDS:
        a, b = _data(seed)
        xs += a
        ys += b
    x = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    y = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
    loss = gpt_loss(model(x), y)
    loss.backward()
    ref_loss = float(loss.detach())
    tokens = [sum(int((t != -100).sum()) for t in _data(seed)[1]) for seed in REPLICA_SEEDS]
    assert tokens[0] != tokens[1]  # the replicas weigh differently: a row-weighted mean would be off
    ref = grads_of(model.named_parameters())
    for documents in (False, True):  # sequences grouped and padded, or rows of documents
        runs = [r[documents] for r in results]
        assert all(abs(r[0] - ref_loss) <= 1e-5 * abs(ref_loss) for r in runs), [r[0] for r in runs]
        for d in (0, 1):  # every replica ends with the global gradient
            got = {k: g for r in runs if r[2] == d for k, g in r[1].items()}
            assert_close(got, ref, f"replica {d}, documents={documents}")


def test_the_token_budget_takes_its_own_size_and_refuses_one_token_more() -> None:
    opts, sched = VarLen(token_budget=16), schedule("1f1b", 2, 2)
    # one sequence: exactly the budget is taken, one token more refused, naming both
    assert lengths_of([torch.zeros(16)], "inputs", opts) == [16]
    with pytest.raises(ValueError, match=r"inputs\[0\] has 17 tokens, more than VarLen\(token_budget=16\)"):
        lengths_of([torch.zeros(17)], "inputs", opts)
    # one micro-batch: two rows padded to 8 make exactly the budget; padded to 9 they are one over
    packed = plan_step([16, 8, 8], sched, opts, step_costs(None, sched))
    assert sorted(r * w for r, w in zip(map(len, packed.groups), packed.widths, strict=True)) == [16, 16]
    with pytest.raises(ValueError, match=r"need 18 padded tokens in some micro-batch at best, more than "
                                         r"VarLen\(token_budget=16\)"):  # fmt: skip
        plan_step([16, 9, 8], sched, opts, step_costs(None, sched))
