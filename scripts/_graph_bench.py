"""Part 5 of ``bench_partition.py``: models that are not an ``nn.Sequential``, split on their layer graph.

    # p: ranks, m: micro-batches, k: stages (v = 1), n: layers (groups of traced calls)

For the reference models written as users write them (tied GPT, U-Net, two-stream blocks) and a
ResNet-like whose every resolution also feeds the head (skips that cross every later cut), each
profiled once, and p = 2 and 4 ranks over a 10 GbE-like link (1.25 GB/s, 20 us): the bottleneck
(cost ms: compute plus transfers, per micro-batch) and the bytes sent per step (activations
forward and gradients back, m micro-batches) of

    ours        partition(): the exact split with every live tensor charged at every cut
    equal       equal numbers of layers per stage
    torchgpipe  balance_by_time's block partition of the per-layer times (the flattened sequence;
                it knows no transfers)
    split@k     a stage boundary before every k-th block (a ModuleList entry), as a user of
                torch.distributed.pipelining places SplitPoints: blocks spread evenly

Then the partition time for a traced graph of several thousand nodes: a tied GPT of 96 blocks
(~3300 fx nodes) traced once (reported apart: torch.export's own time), then grouping, liveness,
cut checks, costs and the exact solve with transfers for p = 8 (the goal: under a second).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from partitioner import Plan, equal_balance, layer_costs, partition, plan_for, profile, torchgpipe_balance
from partitioner.figures import LayerProfile, Profile
from partitioner.graph import layer_graph
from partitioner.graph_profile import traced_record
from pipeline.reference.graph_models import gpt_tied, two_stream, unet
from pipeline.runtime.trace.layers import cut_blocks, group_layers, live_values
from pipeline.runtime.trace.tracing import trace

__all__ = ["graph_tables"]

BANDWIDTH, LATENCY = 1.25e9, 20e-6


class PyramidResNet(nn.Module):
    """Residual stages at falling resolution; each stage's pooled features also go to the head."""

    def __init__(
        self, widths: tuple[int, ...] = (32, 64, 128, 256), blocks: int = 2, classes: int = 10
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        self.blocks = nn.ModuleList()
        self.taps: list[int] = []
        c_in = widths[0]
        for c in widths:
            for j in range(blocks):
                self.blocks.append(_Residual(c_in, c, stride=2 if (c != c_in and j == 0) else 1))
                c_in = c
            self.taps.append(len(self.blocks) - 1)
        self.head = nn.Linear(sum(widths), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        features = []
        for at, block in enumerate(self.blocks):
            h = block(h)
            if at in self.taps:
                features.append(F.adaptive_avg_pool2d(h, 4))  # kept until the head: a skip
        pooled = torch.cat([f.mean(dim=(2, 3)) for f in features], dim=1)
        out: torch.Tensor = self.head(pooled)
        return out


class _Residual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = (
            nn.Conv2d(c_in, c_out, 1, stride=stride) if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.skip(x))


def _models() -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]]:
    return {
        "tied GPT (8 blocks)": lambda: gpt_tied(
            vocab_size=512, width=128, n_layers=8, max_seq_len=64, batch_size=4
        ),
        "U-Net (4 levels)": lambda: unet(widths=(16, 32, 64, 128), image_size=64, batch_size=4),
        "two-stream (12 blocks)": lambda: two_stream(in_features=64, width=256, depth=12, batch_size=32),
        "ResNet-like + taps": lambda: (PyramidResNet(), torch.randn(4, 3, 32, 32)),
    }


def _split_points(prof: Profile, p: int) -> list[int] | None:
    """Stages that begin before every (blocks / p)-th block: SplitPoint.BEGINNING at those blocks."""
    blocks = [at for at, lp in enumerate(prof.layers) if lp.name.rsplit(".", 1)[-1].isdigit()]
    if len(blocks) < p:
        return None
    starts = [0] + [blocks[(len(blocks) * s) // p] for s in range(1, p)]
    ends = [*starts[1:], len(prof.layers)]
    return [b - a for a, b in zip(starts, ends, strict=True)]


def _row(label: str, plan: Plan | None, ours: Plan) -> str:
    if plan is None:
        return f"    {label:<11} {'-':>10}"
    sent = 2 * plan.n_microbatches * sum(st.sent_bytes for st in plan.stages) / 1e6
    bad = "  (cuts where no boundary can be)" if plan.problems else ""
    ratio = plan.bottleneck / ours.bottleneck
    return f"    {label:<11} {plan.bottleneck * 1e3:>10.3f} {ratio:>7.3f} {sent:>11.2f}   {plan.balance}{bad}"


def quality() -> None:
    print(f"\nnon-Sequential models, 1f1b, m = p, link {BANDWIDTH / 1e9:g} GB/s + {LATENCY * 1e6:g} us:")
    print(f"    {'split':<11} {'cost ms':>10} {'/ ours':>7} {'MB / step':>11}   balance (layers per stage)")
    for name, build in _models().items():
        torch.manual_seed(0)
        model, x = build()
        prof = profile(model, x, warmup=1, repeat=3)
        print(f"  {name}: n = {len(prof)} layers, {prof.traced['method'] if prof.traced else ''}")
        link = {"bandwidth": BANDWIDTH, "latency": LATENCY}
        costs = layer_costs(prof, "time")
        for p in (2, 4):
            ours = partition(model, p, x, profile=prof, **link)  # type: ignore[arg-type]
            print(f"   p = {p}")
            print(_row("ours", ours, ours))
            print(_row("equal", plan_for(prof, equal_balance(len(prof), p), **link), ours))  # type: ignore[arg-type]
            gp = torchgpipe_balance(costs, p)
            print(_row("torchgpipe", plan_for(prof, gp, **link) if min(gp) > 0 else None, ours))  # type: ignore[arg-type]
            points = _split_points(prof, p)
            print(_row("split@k", plan_for(prof, points, **link) if points else None, ours))  # type: ignore[arg-type]


def _synthetic(layers: list[LayerProfile]) -> list[LayerProfile]:
    return [
        LayerProfile(lp.index, lp.name, lp.kind, 1e-3, 2e-3, 0, 1 << 20, 0, 1 << 20, (1,), "float32")
        for lp in layers
    ]


def scale() -> None:
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=64, width=32, n_layers=96, n_heads=2, max_seq_len=16, batch_size=2)
    start = time.perf_counter()
    traced = trace(model, x)
    traced_s = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        layers = group_layers(traced.graph, model)
        values = live_values(traced.graph, layers, traced.inputs)
        reasons = cut_blocks(traced.graph, layers, values, model)
        figures = _synthetic(
            [
                LayerProfile(at, layer.name, layer.kind, 0, 0, 0, 0, 0, 0, (), "")
                for at, layer in enumerate(layers)
            ]
        )
        tensors = [(v.name, v.layer, v.uses, v.nbytes) for v in values.values()]
        prof = Profile(figures, "cpu", layer_graph(figures, tensors=tensors), cut_reasons=reasons,
                       traced=traced_record(traced))  # fmt: skip
        partition(model, 8, x, profile=prof, bandwidth=BANDWIDTH, latency=LATENCY)
        times.append(time.perf_counter() - start)
    print(
        f"\ntraced graph of {len(traced.graph.nodes)} fx nodes ({len(traced.layers)} layers, tied GPT of 96 "
        f"blocks): torch.export {traced_s:.1f} s once; then layers, liveness, cut checks, costs and the "
        f"exact solve for p = 8 with transfers: {statistics.median(times) * 1e3:.0f} ms (median of 5; "
        "goal < 1 s)"
    )


def graph_tables() -> None:
    quality()
    scale()
