"""The data-parallel gradient reducer on its own: weights by rows, buckets that hold the gradients,
missing gradients, gradients kept across steps, and where in a schedule each stage's reduction starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.replicas.dp import (
    GradReducer,
    assign_parameters,
    check_bucket_mb,
    reduction_points,
)
from pipeline.runtime.replicas.mesh import build_mesh, layout_of
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import schedule
from tests.dist import job

ROWS = (3, 5)  # replica d's batch rows: uneven, so that weighting by rows matters
STEPS = 3  # step 0 after zero_grad(set_to_none), step 1 after zero_grad(set_to_none=False), 2 without


class _Collectives:
    """The reducer's view of a group: asynchronous all-reduces waited with a timeout."""

    def __init__(self, group: Any) -> None:
        self.group, self.device = group, torch.device("cpu")
        self.world_size = dist.get_world_size(group)

    def start_all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> Any:
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def finish(self, work: Any, what: str) -> None:
        import datetime

        work.wait(datetime.timedelta(seconds=30))


def _stage(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 3, bias=False),  # unused: no gradient on any replica
        nn.Linear(6, 5),  # gradients from earlier micro-batches only; its bias none on replica 0
        nn.Linear(5, 4).double(),  # gradients accumulated by the last backward, too
        nn.Linear(4, 3).double(),
    )


def _earlier(d: int, s: int, module: nn.Module, weight: float, bias: bool = False) -> None:
    """Replica d's earlier micro-batches of the step, their loss weighted by ``weight`` (B_d / B);
    ``bias``: replica 0 uses its bias too."""
    g = torch.Generator().manual_seed(100 * d + s)
    x = torch.randn(ROWS[d], 6, generator=g)
    lin = module[1]  # replica 0 does not use its bias: no gradient there
    h = nn.functional.linear(x, lin.weight, lin.bias if d or bias else None)
    (module[3](module[2](h.double())).square().mean() * weight).backward()


def _last_backward(d: int, s: int, module: nn.Module, weight: float) -> None:
    g = torch.Generator().manual_seed(1000 + 100 * d + s)
    x = torch.randn(ROWS[d], 5, generator=g, dtype=torch.float64)
    (module[3](module[2](x)).square().mean() * weight).backward()


def _reduce(bucket_bytes: int) -> dict[str, Any]:
    mesh = build_mesh(2, 2, "cpu")
    lay = layout_of(mesh)
    stages = {s: _stage(s) for s in (lay.pp_rank, lay.pp_rank + 2)}  # two local stages, as interleaved
    params = {s: list(mod.parameters()) for s, mod in stages.items()}
    early = [lay.pp_rank + 2]  # stage r + 2 launches during its last backward, stage r after it
    reducer = GradReducer(params, _Collectives(mesh.get_group("dp")), bucket_bytes, dist.get_rank(),
                          lay.replicas, early=early)  # fmt: skip
    out: dict[str, Any] = {"early": {}, "views": True}
    # a step before the recorded ones where replica 0 uses its bias too: the bias's slot in its bucket
    # then holds a gradient, which step 0 (after zero_grad(set_to_none), no gradient there) must not add
    reducer.begin_step(record=False)
    reducer.start_rows(ROWS[lay.replica])
    share = float(reducer.share())
    for s in sorted(stages, reverse=True):
        _earlier(lay.replica, s, stages[s], share, bias=True)
        reducer.arm(s)
        _last_backward(lay.replica, s, stages[s], share)
        reducer.launch(s)
    reducer.wait(stages)
    for step in range(STEPS):
        for mod in stages.values():
            if step < 2:
                mod.zero_grad(set_to_none=step == 0)
        reducer.begin_step(record=True)
        reducer.start_rows(ROWS[lay.replica])
        share = float(reducer.share())
        for s, mod in stages.items():
            _earlier(lay.replica, s, mod, share)
        out["views"] &= _in_buckets(reducer)  # autograd's fresh tensors moved in at once, not at launch
        for s in sorted(stages, reverse=True):  # as interleaved: stage r + 2's last backward first
            reducer.arm(s)
            _last_backward(lay.replica, s, stages[s], share)
            out["early"][s] = [b.launched > 0 for b in reducer.buckets[s]]
            reducer.launch(s)
        out["views"] &= _in_buckets(reducer, reduced=True)
        reducer.wait(stages)
        for s, m in stages.items():
            out.update({f"{step}/{s}/{n}": None if p.grad is None else p.grad.clone()
                        for n, p in m.named_parameters()})  # fmt: skip
        out["views"] &= _in_buckets(reducer)  # nothing was copied out
    out["buckets"] = {s: len(b) for s, b in reducer.buckets.items()}
    out["events"] = [(e.stage, e.bucket) for e in reducer.events]
    try:
        reducer.wait([min(stages), 99])
    except RuntimeError as exc:
        out["unlaunched"] = str(exc)
    reducer.close()
    return out


def _in_buckets(reducer: GradReducer, reduced: bool = False) -> bool:
    """Every gradient of a bucket of several is a view of its flat buffer; ``reduced``: and a bucket of
    one parameter all-reduced that parameter's ``.grad`` itself (no copy either way)."""
    return all(
        p.grad is None
        or (b.single and (not reduced or b.reduced is p.grad))
        or (not b.single and b.flat is not None and p.grad.data_ptr() == b.views[k].data_ptr())
        for bs in reducer.buckets.values()
        for b in bs
        for k, p in enumerate(b.params)
    )


def _one_step(s: int) -> dict[str, torch.Tensor | None]:
    """What one process computes on both replicas' rows: each replica's part weighted by B_d / B."""
    total = sum(ROWS)
    parts: list[dict[str, torch.Tensor | None]] = []
    for d in range(2):
        mod = _stage(s)
        _earlier(d, s, mod, ROWS[d] / total)
        _last_backward(d, s, mod, ROWS[d] / total)
        parts.append({n: p.grad for n, p in mod.named_parameters()})
    out: dict[str, torch.Tensor | None] = {}
    for n in parts[0]:
        got = [g for part in parts if (g := part[n]) is not None]
        out[n] = sum(got[1:], got[0]) if got else None
    return out


_REDUCE = {cap: job(4, _reduce, cap, timeout=60.0) for cap in (1 << 30, 64)}


@pytest.fixture(scope="module", params=[1 << 30, 64])
def reduced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Any]:
    cap: int = request.param
    return cap, _REDUCE[cap].results(tmp_path_factory)


def test_gradients_are_the_row_weighted_mean_over_replicas(reduced: tuple[int, Any]) -> None:
    cap, results = reduced
    for g, res in enumerate(results):
        r = g % 2
        assert res["views"], g  # DDP's gradient_as_bucket_view: every .grad lives in its bucket
        for s in (r, r + 2):
            one = _one_step(s)
            for step in range(STEPS):
                # steps 0 and 1 start from no gradient; step 2 adds to step 1's (no zero_grad): counted once
                times = 2 if step == 2 else 1
                for n, want in one.items():
                    got = res[f"{step}/{s}/{n}"]
                    if want is None:  # no replica had one: None, as one process leaves an unused parameter
                        assert got is None, (g, step, s, n)
                        continue
                    err = float((got - times * want).abs().max() / want.abs().max())
                    assert got.dtype == want.dtype and err < 1e-6, (g, step, s, n, err)
        # reverse order, one bucket per dtype: [3.bias 3.weight 2.bias 2.weight] (float64),
        # [1.bias 1.weight 0.weight] (float32); with a 64-byte cap one per parameter
        big = cap > 1000
        assert res["buckets"] == ({r: 2, r + 2: 2} if big else {r: 7, r + 2: 7})
        # stage r + 2's float64 buckets start during its last backward, in order, until the first that
        # waits for the earlier micro-batches' gradients; stage r's only after its last backward
        assert res["early"][r + 2] == ([True, False] if big else [True] * 4 + [False] * 3)
        assert not any(res["early"][r])
        order = [(s, k) for s in (r + 2, r) for k in range(res["buckets"][s])]
        assert res["events"] == order
        # a new step (nothing launched yet) waited for: every stage is named
        assert res["unlaunched"] == (
            f"rank {g}: stages [{r}, 99] finished the step without launching their gradient all-reduce"
        )


def test_reduction_points_are_each_stage_s_last_weight_gradient() -> None:
    one = schedule("1f1b", 2, 4)
    assert reduction_points(one, 0) == {Action(0, Kind.B, 3): 0}
    zb = schedule("zb-h1", 2, 4)
    assert reduction_points(zb, 1) == {Action(1, Kind.W, 3): 1}
    inter = schedule("interleaved-1f1b", 2, 4, n_virtual=2)
    points = reduction_points(inter, 0)
    assert sorted(points.values()) == [0, 2]
    lowered = inter.lowered()[0]
    # stage 2's gradients are final before stage 0's: its reduction overlaps stage 0's last backwards
    assert lowered.index(next(a for a, s in points.items() if s == 2)) < lowered.index(
        next(a for a, s in points.items() if s == 0)
    )
    assert all(a.kind is Kind.B and a.microbatch == 3 for a in points)


def test_a_module_in_two_local_stages_is_reduced_once_after_the_later_one() -> None:
    shared = nn.Linear(2, 2)
    modules = {0: nn.Sequential(shared, nn.Linear(2, 2)), 2: nn.Sequential(nn.Linear(2, 2), shared)}
    inter = schedule("interleaved-1f1b", 2, 4, n_virtual=2)
    points = reduction_points(inter, 0)
    owned = assign_parameters(modules, points, inter.lowered()[0])
    ids = {s: [id(p) for p in ps] for s, ps in owned.items()}
    assert set(map(id, shared.parameters())) <= set(ids[0])  # stage 0's gradients are final last
    assert len(ids[0]) == 4 and len(ids[2]) == 2
    assert not set(ids[0]) & set(ids[2])


def test_bucket_size_is_checked() -> None:
    assert check_bucket_mb(25) == 25.0
    for bad in (0, -1.0, True, "25"):
        with pytest.raises(ValueError, match=r"bucket_mb .* must be a number of megabytes > 0"):
            check_bucket_mb(bad)  # type: ignore[arg-type]
