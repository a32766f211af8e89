"""Pipeline end to end: every schedule x checkpoint mode x model against one process and torchgpipe.

Ranks are slow to spawn, so each world size runs all its configurations inside
one launch and returns losses, gradients and measurements to the parent.
"""

from __future__ import annotations

import gc
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.reference.models import gpt, gpt_loss, mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.schedule import schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import Timeline
from tests.dist import run_ranks

M, BATCH = 4, 8
MODELS = ("mlp", "gpt")
CONFIGS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
CHECKPOINTS = ("never", "except_last", "always")


def _build(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    if name == "mlp":
        model, x = mlp(width=8, depth=8, batch_size=BATCH)
        return model, x, torch.randn(BATCH, 8), nn.functional.mse_loss
    model, x = gpt(vocab_size=16, width=16, n_layers=6, n_heads=2, max_seq_len=8, batch_size=BATCH)
    return model, x, torch.randint(0, 16, (BATCH, 8)), gpt_loss


def _balance(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (1 if k < n_layers % n_stages else 0) for k in range(n_stages)]


def _grads(named: Any) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in named}


def _matrix() -> dict[str, Any]:
    """On every rank: all configurations; per config the loss, local grads and peak activations."""
    p, out = dist.get_world_size(), {}
    for name, (sched, v), ckpt in itertools.product(MODELS, CONFIGS, CHECKPOINTS):
        model, x, y, loss_fn = _build(name)
        pipe = Pipeline(
            model, _balance(len(model), p * v), schedule=sched, n_microbatches=M, loss_fn=loss_fn,
            n_virtual=v, checkpoint=ckpt, timeout=30.0,
        )  # fmt: skip
        if ckpt == "never":  # forward-only evaluation first: it must leave no trace for the step
            ev = pipe.evaluate(x, y)
            no_grads = all(t.grad is None for t in pipe.parameters())
            modes_kept = all(mod.training for mod in pipe.module.modules())
            out[f"eval/{name}/{sched}"] = (ev, no_grads, modes_kept)
        loss = pipe.step(x, y)
        out[f"{name}/{sched}/{ckpt}"] = (loss, _grads(pipe.named_parameters()), pipe.peak_activations())
    # several optimizer steps; on the MLP: the GPT's key bias has an analytically zero gradient
    # (softmax ignores a constant shift of the keys), whose fp32 round-off Adam would normalise
    # into a full-size step in a random direction, in one process as much as in the pipeline
    for sched in ("1f1b", "zb-h1"):
        model, x, y, loss_fn = _build("mlp")
        pipe = Pipeline(model, _balance(len(model), p), schedule=sched, n_microbatches=M, loss_fn=loss_fn)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        out[f"adamw/{sched}"] = {k: t.detach().clone() for k, t in pipe.named_parameters()}
    # one recorded 1F1B step (after a warm-up step)
    model, x, y, loss_fn = _build("mlp")
    pipe = Pipeline(model, _balance(len(model), p), schedule="1f1b", n_microbatches=M, loss_fn=loss_fn)
    pipe.step(x, y)
    pipe.step(x, y, record=True)
    out["timeline"] = pipe.gather_timeline()
    out["busy"] = pipe.busy_time
    return out


def _reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y, loss_fn = _build(name)
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), _grads(model.named_parameters())


def _torchgpipe(name: str, n_stages: int) -> dict[str, torch.Tensor]:
    from torchgpipe import GPipe

    model, x, y, loss_fn = _build(name)
    gp = GPipe(model, _balance(len(model), n_stages), devices=["cpu"] * n_stages, chunks=M)
    loss_fn(gp(x), y).backward()
    return _grads(model.named_parameters())


def _adamw_reference(sched_name: str) -> dict[str, torch.Tensor]:
    model, x, y, loss_fn = _build("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {k: t.detach().clone() for k, t in model.named_parameters()}


def _assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(ref), label
    for k, g in got.items():
        rel = float((g - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12))
        assert rel < 1e-5, f"{label}: {k} relative error {rel:.2e}"


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[Any]]:
    p: int = request.param
    return p, run_ranks(tmp_path_factory.mktemp(f"w{p}"), _matrix, p, timeout=120.0)


@pytest.mark.parametrize("name", MODELS)
def test_every_schedule_matches_one_process_and_torchgpipe(world: tuple[int, list[Any]], name: str) -> None:
    p, results = world
    loss_ref, grads_ref = _reference(name)
    grads_gpipe = _torchgpipe(name, p)
    _assert_close(grads_gpipe, grads_ref, "torchgpipe vs one process")  # the two references agree
    for (sched, _), ckpt in itertools.product(CONFIGS, CHECKPOINTS):
        key = f"{name}/{sched}/{ckpt}"
        losses = [r[key][0] for r in results]
        assert all(abs(v - loss_ref) <= 1e-6 * abs(loss_ref) for v in losses), (key, losses, loss_ref)
        merged = {k: g for r in results for k, g in r[key][1].items()}  # every parameter exactly once
        assert sum(len(r[key][1]) for r in results) == len(grads_ref)
        _assert_close(merged, grads_ref, key)
        _assert_close(merged, grads_gpipe, key + " vs torchgpipe")


@pytest.mark.parametrize("name", MODELS)
def test_evaluate_is_the_forward_loss_and_leaves_no_trace(world: tuple[int, list[Any]], name: str) -> None:
    p, results = world
    model, x, y, loss_fn = _build(name)
    with torch.no_grad():
        losses = [loss_fn(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)]
        ref = float(torch.stack(losses).mean())
    for sched, _ in CONFIGS:
        for rank in range(p):
            ev, no_grads, modes_kept = results[rank][f"eval/{name}/{sched}"]
            assert abs(ev - ref) <= 1e-6 * abs(ref), f"{sched} rank {rank}: {ev} != {ref}"
            assert no_grads and modes_kept, f"{sched} rank {rank}"


def test_memory_bounds(world: tuple[int, list[Any]]) -> None:
    p, results = world
    for name, ckpt in itertools.product(MODELS, CHECKPOINTS):
        for j, r in enumerate(results):
            assert r[f"{name}/gpipe/{ckpt}"][2] == {j: M}
            assert r[f"{name}/1f1b/{ckpt}"][2] == {j: min(M, p - j)}  # never more than p - j
            assert r[f"{name}/zb-h1/{ckpt}"][2][j] <= p


def test_adamw_steps_match_one_process(world: tuple[int, list[Any]]) -> None:
    _, results = world
    for sched in ("1f1b", "zb-h1"):
        merged = {k: t for r in results for k, t in r[f"adamw/{sched}"].items()}
        _assert_close(merged, _adamw_reference(sched), f"adamw {sched}")


def test_measured_trace_has_the_simulated_shape(world: tuple[int, list[Any]], tmp_path: Path) -> None:
    from pipeline.schedules.trace import write_chrome_trace

    p, results = world
    measured: Timeline = results[0]["timeline"]
    assert all(r["timeline"] is None for r in results[1:])  # gathered on rank 0 only
    simulated = simulate(schedule("1f1b", p, M), forward=1.0, backward=2.0)
    for r in range(p):
        order = [e.action for e in measured.of_rank(r) if e.action.kind.is_compute]
        assert order == [e.action for e in simulated.of_rank(r) if e.action.kind.is_compute]
        waits = [e for e in measured.of_rank(r) if e.action.kind.is_recv]
        assert len(waits) == (M if r in (0, p - 1) else 2 * M)  # every receive waited for, once
        computes = [e for e in measured.of_rank(r) if e.action.kind.is_compute]
        for w in waits:  # waiting for an input is idle time, never part of a compute action
            assert all(c.start >= w.end or c.end <= w.start for c in computes), w
    assert measured.peak_activations == simulated.peak_activations
    for r, res in enumerate(results):
        busy = sum(e.duration for e in measured.of_rank(r) if e.action.kind.is_compute)
        assert abs(res["busy"] - busy) < 1e-3
    path = tmp_path / "1f1b.trace.json"
    write_chrome_trace(path, simulated, measured, names=["simulated", "measured"])
    events = json.loads(path.read_text())["traceEvents"]
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert threads == {(pid, r) for pid in (0, 1) for r in range(p)}


# ---- bf16 autocast around step(), and the lifetime of the communication thread


def _autocast_reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process under bf16 autocast, micro-batch by micro-batch like the pipeline: the bf16
    matmuls of the weight gradients round each micro-batch's sum, so a whole-batch run differs
    by bf16 round-off (about 5e-3), while the same micro-batches give the same numbers."""
    model, x, y, loss_fn = _build(name)
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for a, b in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = loss_fn(model(a), b)
            (loss * (1.0 / M)).backward()
            losses.append(loss.detach().float())
    return float(torch.stack(losses).mean()), _grads(model.named_parameters())


def _watchdogs() -> int:
    return sum(t.name == "stagewise-p2p-watchdog" for t in threading.enumerate())


def _settled(expected: int) -> int:
    """The number of watchdog threads once it reaches ``expected`` (threads stop asynchronously)."""
    deadline = time.monotonic() + 5.0
    while _watchdogs() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _watchdogs()


def _autocast_and_threads() -> dict[str, Any]:
    """On 2 ranks: a bf16 autocast step per model, then a plain one; then close / collect the pipes."""
    out: dict[str, Any] = {}
    before = _watchdogs()
    pipes = []
    for name in MODELS:
        model, x, y, loss_fn = _build(name)
        pipe = Pipeline(model, _balance(len(model), 2), schedule="1f1b", n_microbatches=M, loss_fn=loss_fn,
                        timeout=10.0)  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(x, y)
        ex = pipe.executor
        between = ex.out_sig[0] if pipe.rank == 0 else ex.in_sig[1]  # as sent, and as received
        out[f"bf16/{name}"] = (loss, _grads(pipe.named_parameters()), between)
        for t in pipe.parameters():
            t.grad = None
        out[f"fp32/{name}"] = (pipe.step(x, y), _grads(pipe.named_parameters()))  # dtypes derived anew
        pipes.append(pipe)
    out["threads"] = [before, _watchdogs()]
    pipes[0].close()
    out["threads"].append(_settled(before + 1))
    try:
        pipes[0].step(*_build(MODELS[0])[1:3])
    except RuntimeError as exc:
        out["closed"] = str(exc)
    del pipe, pipes, ex
    gc.collect()  # the executor's bound instructions refer to it: a cycle
    out["threads"].append(_settled(before))
    return out


@pytest.fixture(scope="module")
def autocast_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tmp_path_factory.mktemp("autocast"), _autocast_and_threads, 2, timeout=60.0)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_step_matches_one_process(autocast_run: list[dict[str, Any]], name: str) -> None:
    loss_ref, grads_ref = _autocast_reference(name)
    loss_fp32, grads_fp32 = _reference(name)
    losses = [r[f"bf16/{name}"][0] for r in autocast_run]
    assert all(abs(v - loss_ref) <= 1e-6 * abs(loss_ref) for v in losses), (losses, loss_ref)
    assert abs(losses[0] - loss_fp32) <= 1e-2 * abs(loss_fp32), (losses[0], loss_fp32)  # bf16 round-off
    merged = {k: g for r in autocast_run for k, g in r[f"bf16/{name}"][1].items()}
    assert all(type(g) is torch.Tensor and g.isfinite().all() for g in merged.values())
    _assert_close(merged, grads_ref, f"bf16 {name}")
    # the MLP's stages end in a Linear: bf16 between stages; the GPT's in a residual add: fp32
    b = BATCH // M
    shape, dtype = ((b, 8), torch.bfloat16) if name == "mlp" else ((b, 8, 16), torch.float32)
    assert [r[f"bf16/{name}"][2] for r in autocast_run] == [((shape, dtype),)] * 2
    # the next step without autocast re-derives the dtypes between stages: the fp32 result
    assert all(abs(r[f"fp32/{name}"][0] - loss_fp32) <= 1e-6 * abs(loss_fp32) for r in autocast_run)
    _assert_close({k: g for r in autocast_run for k, g in r[f"fp32/{name}"][1].items()}, grads_fp32, name)


def test_waiter_thread_stops_at_close_and_collection(autocast_run: list[dict[str, Any]]) -> None:
    for r in autocast_run:
        before = r["threads"][0]
        assert r["threads"] == [before, before + 2, before + 1, before]  # one per Pipeline, then none
        assert "communication was closed (Pipeline.close()); build a new Pipeline" in r["closed"]


def test_bf16_autocast_with_two_stages_on_one_rank() -> None:
    # the stages' shape inference ran in fake mode under the caller's autocast: its cached bf16
    # weight casts were fake, and the real forwards after it gave a 0.0 loss and fake gradients
    loss_ref, grads_ref = _autocast_reference("gpt")
    model, x, y, loss_fn = _build("gpt")
    pipe = Pipeline(model, _balance(len(model), 2), schedule="interleaved-1f1b", n_virtual=2,
                    n_microbatches=M, loss_fn=loss_fn)  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, y)
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    grads = _grads(pipe.named_parameters())
    assert all(type(g) is torch.Tensor for g in grads.values())
    _assert_close(grads, grads_ref, "bf16 on one rank")


# ---- one process (world size 1): interleaved stages all on one rank, meta models, bad input


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_on_one_rank(v: int) -> None:
    _, grads_ref = _reference("gpt")
    model, x, y, loss_fn = _build("gpt")
    pipe = Pipeline(model, _balance(len(model), v), schedule="interleaved-1f1b", n_virtual=v,
                    n_microbatches=M, loss_fn=loss_fn)  # fmt: skip
    assert isinstance(pipe.module, nn.ModuleList) and len(pipe.module) == v
    pipe.step(x, y)
    _assert_close(_grads(pipe.named_parameters()), grads_ref, f"v={v}")


def test_meta_model_materialises_local_stages() -> None:
    with torch.device("meta"):
        model, _ = mlp(width=8, depth=4, batch_size=BATCH)
    seen: list[nn.Module] = []
    pipe = Pipeline(model, [4], schedule="gpipe", n_microbatches=2, loss_fn=nn.functional.mse_loss,
                    init_fn=seen.append)  # fmt: skip
    assert len(seen) == 1
    assert all(not t.is_meta and t.abs().sum() > 0 for name, t in pipe.named_parameters() if "weight" in name)
    assert [k for k, _ in pipe.named_parameters()][:2] == ["0.0.weight", "0.0.bias"]
    assert pipe.step(torch.randn(4, 8), torch.randn(4, 8)) > 0


class _Plan:
    def __init__(self) -> None:
        self.balance = [2, 2]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(balance=[2, 2]), r"balance has 2 stages but world size \(1\) x n_virtual \(1\) is 1"),
        (dict(balance=[3]), r"balance \[3\] sums to 3 layers but the model has 4"),
        (dict(balance=_Plan(), n_virtual=2, schedule="1f1b"), r"n_virtual \(2\) must be 1 for '1f1b'"),
        (dict(balance=[4], checkpoint="sometimes"), r"unknown checkpoint mode 'sometimes'"),
        (dict(balance=[4], loss_fn=None), r"loss_fn is required"),
        (dict(balance=[4], schedule="1f1b2"), r"unknown schedule '1f1b2'; valid schedules are"),
        (dict(balance=[4], schedule=schedule("gpipe", 1, 2), n_microbatches=4),
         r"n_microbatches \(4\) does not match the schedule's \(2\)"),
        (dict(balance=[2, 2], n_virtual=2, schedule=schedule("interleaved-1f1b", 4, 4, n_virtual=2)),
         r"schedule 'interleaved-1f1b' has 4 stages on 2 ranks, but balance has 2 stages on a world of 1"),
    ],
)  # fmt: skip
def test_bad_construction(kwargs: dict[str, Any], error: str) -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    args: dict[str, Any] = dict(loss_fn=nn.functional.mse_loss, n_microbatches=None)
    args.update(kwargs)
    balance = args.pop("balance")
    with pytest.raises(ValueError, match=error):
        Pipeline(model, balance, **args)


def test_bad_step_input_in_one_process() -> None:
    model, _ = mlp(width=4, depth=2, batch_size=4)
    pipe = Pipeline(model, [2], schedule="gpipe", n_microbatches=4, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"inputs size \(10\) is not divisible by n_microbatches \(4\)"):
        pipe.step(torch.zeros(10, 4), torch.zeros(10, 4))
    with pytest.raises(ValueError, match=r"rank 0 holds the last stage \(0\) but step\(\) got no targets"):
        pipe.step(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"rank 0 holds stage 0 but step\(\) got no inputs"):
        pipe.step(None, torch.zeros(8, 4))


# ---- failures across ranks: each scenario in a fresh process group, all in one launch


class _Boom(nn.Module):
    """Raises at its ``at``-th call; sleeps ``sleep`` seconds on every call."""

    def __init__(self, at: int = -1, sleep: float = 0.0, grow_at: int = -1) -> None:
        super().__init__()
        self.calls, self.at, self.sleep, self.grow_at = 0, at, sleep, grow_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom in a stage")
        time.sleep(self.sleep)
        if self.grow_at >= 0 and self.calls >= self.grow_at:
            return torch.cat([x, x[:, :1]], dim=1)  # one more feature than at the first step
        return x


def _scenario(kind: str, group: Any) -> tuple[str, str, float]:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(2 * p)]
    loss_fn: Any = nn.functional.mse_loss
    m, timeout, batch = 4, 20.0, 8
    if kind == "raise":
        layers[2 * (p // 2)] = _Boom(at=3)  # stage p // 2 fails at its third forward
    elif kind == "timeout":
        layers[2 * (p - 1)], timeout = _Boom(), 1.0  # the last stage turns too slow after a good step
    elif kind == "shape":
        layers[1] = _Boom(grow_at=M + 2)  # grows at the second step (the shape inference is call 1)
        loss_fn = lambda out, y: ((out[:, :4] - y) ** 2).mean()  # noqa: E731
    elif kind == "scalar":
        loss_fn = lambda out, y: (out - y) ** 2  # noqa: E731
    elif kind == "disagree":
        m = 4 if rank == 0 else 8
    elif kind == "indivisible":
        batch = 10
    model = nn.Sequential(*layers)
    pipe = Pipeline(model, [2] * p, schedule="1f1b", n_microbatches=m, loss_fn=loss_fn, group=group,
                    timeout=timeout)  # fmt: skip
    x, y = torch.randn(batch, 4), torch.randn(8, 4)
    bf16 = kind == "autocast" and rank == 0  # autocast on rank 0 only
    if kind == "timeout":  # set up (shapes, first-use costs) before the clock starts: time the wait
        pipe.step(x if rank == 0 else None, y if rank == p - 1 else None)
        for layer in layers:
            if isinstance(layer, _Boom):
                layer.sleep = 3.0
    start = time.monotonic()
    try:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pipe.step(x if rank == 0 else None, None if kind == "targets" or rank != p - 1 else y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _failures() -> dict[str, list[tuple[str, str, float]]]:
    out = {}
    for kind in ("raise", "timeout", "shape", "scalar", "disagree", "indivisible", "targets", "autocast"):
        group = dist.new_group(backend="gloo")
        result = _scenario(kind, group)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)  # on the world group, which stays healthy
        out[kind] = gathered
    return out


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str, float]]]:
    results: dict[str, list[tuple[str, str, float]]] = run_ranks(
        tmp_path_factory.mktemp("fail"), _failures, 3, timeout=60.0
    )[0]
    return results


def test_a_rank_raising_makes_every_rank_fail_fast(failures: dict[str, Any]) -> None:
    (k0, m0, t0), (k1, m1, _), (k2, m2, t2) = failures["raise"]
    assert (k1, m1) == ("RuntimeError", "boom in a stage")
    for kind, msg, elapsed in ((k0, m0, t0), (k2, m2, t2)):
        assert kind == "PeerFailure" and elapsed < 5.0
        assert msg.startswith("rank 1 failed while rank ") and msg.endswith("RuntimeError: boom in a stage")
    assert " waited for 0RECV_B" in m0 and "from rank 1" in m0
    assert m2.startswith("rank 1 failed while rank 2 waited for 2RECV_F")


def test_timeout_names_rank_and_action(failures: dict[str, Any]) -> None:
    (k0, m0, t0), (k1, m1, _), (k2, m2, _) = failures["timeout"]
    # rank 0 starts waiting first (for the gradient of micro-batch 0), so it times out first
    assert k0 == "PipelineTimeout" and t0 < 2.0
    assert m0 == "rank 0 timed out after 1.0 s waiting for 0RECV_B0 from rank 1"
    for kind, msg in ((k1, m1), (k2, m2)):
        assert kind == "PeerFailure" and msg.startswith("rank 0 failed while rank ")
        assert msg.endswith("rank 0 timed out after 1.0 s waiting for 0RECV_B0 from rank 1")


@pytest.mark.parametrize(
    ("kind", "culprit", "error"),
    [
        ("shape", 0, "ValueError: stage 0 produced [2, 5] float32 for micro-batch 0, but stage 1 was set up "
                     "for [2, 4] float32"),
        ("scalar", 2, "ValueError: loss_fn must return a scalar (0-dim) tensor, got (2, 4)"),
        ("indivisible", 0, "ValueError: inputs size (10) is not divisible by n_microbatches (4)"),
        ("targets", 2, "ValueError: rank 2 holds the last stage (2) but step() got no targets"),
        ("autocast", 1, "ValueError: rank 1 runs the step with autocast off on cpu but rank 0 with "
                        "autocast(bfloat16) on cpu; wrap the step in the same torch.autocast (or none) on "
                        "every rank"),
    ],
)  # fmt: skip
def test_bad_step_input_fails_on_every_rank(
    failures: dict[str, Any], kind: str, culprit: int, error: str
) -> None:
    for rank, (exc, msg, elapsed) in enumerate(failures[kind]):
        assert elapsed < 5.0
        if rank == culprit:
            assert f"{exc}: {msg}".startswith(error)
        else:
            assert exc == "PeerFailure"
            assert msg.startswith(f"rank {culprit} failed while rank {rank} waited for")
            assert error in msg


def test_ranks_that_disagree_fail_at_the_first_step(failures: dict[str, Any]) -> None:
    # a rank that reads every configuration raises the ValueError itself; one still waiting for
    # a slower rank's configuration may see the first rank's published ValueError instead
    results = failures["disagree"]
    assert any(exc == "ValueError" for exc, _, _ in results)
    for exc, msg, elapsed in results:
        assert exc in ("ValueError", "PeerFailure") and elapsed < 5.0
        assert "ranks disagree about the pipeline: rank " in msg
        assert "m=4" in msg and "m=8" in msg and "same schedule, n_microbatches and balance" in msg


def test_evaluate_runs_layers_in_eval_mode_and_restores_modes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with torch.no_grad():
        ref = float(nn.functional.mse_loss(model.eval()(x), y))  # one chunk: the mean is the batch's
    model.train()
    pipe = Pipeline(model, [3], schedule="gpipe", n_microbatches=1, loss_fn=nn.functional.mse_loss)
    assert pipe.evaluate(x, y) == pytest.approx(ref, rel=1e-6)
    assert all(mod.training for mod in pipe.module.modules())
    assert all(t.grad is None for t in pipe.parameters())
