"""``Pipeline(compile=...)`` against eager: every registered schedule, split backward included.

The matrix runs on aot_eager, the cheapest backend that still runs AOTAutograd (the compiled
autograd functions whose one backward returns input and weight gradients together, which the
split backward must handle; inductor adds code generation on top of the same graphs). One job of 2
ranks runs every schedule x recompute mode on the GPT (loss and gradients against one process on
the whole batch, fp32 relative error < 1e-5) and a BatchNorm + dropout model (loss, gradients,
buffers and an evaluation against the same pipeline eager); 4 ranks run a few V and interleaved
schedules, a traced model and replicas (dp = 2). Compiled code is shared by every Pipeline of a
rank, so each kind of layer compiles once per autograd mode for the whole job. One inductor case
runs a split schedule on one rank.

Single-process tests count what runs: a counting backend proves each layer's compiled forward runs
once per micro-batch (twice when recomputed) and its compiled backward once (not again in W), and
dynamo's counters prove no recompilation per micro-batch or step and no kind of layer falling back
to eager at the recompile limit.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied
from pipeline.reference.models import gpt_loss
from pipeline.runtime.options import resolve
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.compiled import check_compile, check_compile_plan, for_recompute
from tests.dist import job
from tests.pipe_common import (
    BATCH,
    CONFIGS,
    RECOMPUTES,
    M,
    assert_close,
    balance_of,
    build,
    grads_of,
    reference,
)

BACKEND = "aot_eager"
FOUR = ("interleaved-zb", "zb-v", "dualpipe-v")  # 4 ranks: the V and interleaved split schedules
# a rank compiles inside its first step while its peers wait for it: on a loaded host, longer than 30 s
_WAIT = 180.0


def _bn_model() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """Layers with BatchNorm (buffers: running statistics, a step counter) and dropout (random)."""
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.25)) for _ in range(4)
    ]
    return nn.Sequential(*layers), torch.randn(BATCH, 8), torch.randn(BATCH, 8), nn.functional.mse_loss


def _frames() -> int:
    return int(counters["frames"]["total"])


def _step(pipe: Pipeline, x: Any, y: Any) -> float:
    torch.manual_seed(1)  # dropout: the same draws eager and compiled
    return pipe.step(x, y)


def _gpt_runs(configs: list[tuple[str, int]], modes: tuple[str, ...]) -> dict[str, Any]:
    p, out = dist.get_world_size(), {}
    for (sched, v), mode in itertools.product(configs, modes):
        model, x, y, loss_fn = build("gpt")
        pipe = Pipeline(model, balance_of(len(model), p * v), schedule=sched, n_microbatches=M, n_virtual=v,
                        recompute=mode, loss_fn=loss_fn, timeout=_WAIT, compile=BACKEND)  # fmt: skip
        out[f"{sched}/{mode}"] = (pipe.step(x, y), grads_of(pipe.named_parameters()))
    return out


def _bn_runs(configs: list[tuple[str, int]], modes: tuple[str, ...]) -> dict[str, Any]:
    """Per config, eager then compiled: loss, gradients, buffers after the step, an evaluation."""
    p, out = dist.get_world_size(), {}
    for (sched, v), mode in itertools.product(configs, modes):
        for compiled in (False, BACKEND):
            model, x, y, loss_fn = _bn_model()
            pipe = Pipeline(model, balance_of(len(model), p * v), schedule=sched, n_microbatches=M,
                            n_virtual=v, recompute=mode, loss_fn=loss_fn, timeout=_WAIT,
                            compile=compiled)  # fmt: skip
            loss = _step(pipe, x, y)
            buffers = {k: b.clone() for k, b in pipe.named_buffers()}
            out[f"{sched}/{mode}/{compiled}"] = (loss, grads_of(pipe.named_parameters()), buffers,
                                                 pipe.evaluate(x, y))  # fmt: skip
    return out


def _two() -> dict[str, Any]:
    out = {"gpt": _gpt_runs(CONFIGS, RECOMPUTES)}
    out["bn"] = _bn_runs([c for c in CONFIGS if c[0] in ("1f1b", "zb-h1", "zb-v")], ("never", "always"))
    # nothing compiles again: a second step of every kind of pipeline already run
    model, x, y, loss_fn = build("gpt")
    pipe = Pipeline(model, balance_of(len(model), 4), schedule="zb-v", n_microbatches=M, n_virtual=2,
                    recompute="except_last", loss_fn=loss_fn, timeout=_WAIT, compile=BACKEND)  # fmt: skip
    before = _frames()
    pipe.step(x, y)
    pipe.step(x, y)
    out["frames"] = (before, _frames(), dict(counters["frames"]), dict(counters["graph_break"]))
    return out


def _four(plan_json: str) -> dict[str, Any]:
    out = {"gpt": _gpt_runs([c for c in CONFIGS if c[0] in FOUR], ("never", "always"))}
    # a traced model: each stage one graph, compiled whole
    model, x, y, loss_fn = _traced()
    pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_fn, timeout=_WAIT, compile=BACKEND)
    out["traced"] = (pipe.step(x, y), {k: p.grad.clone() for k, p in pipe.named_parameters()})
    # replicas: dp = 2 pipelines of 2 ranks, zb-h1; W's accumulation must reach the reducer's hooks
    rows = slice(dist.get_rank() // 2 * (BATCH // 2), (dist.get_rank() // 2 + 1) * (BATCH // 2))
    for compiled in (False, BACKEND):
        model, x, y, loss_fn = build("gpt")
        plan = Plan(balance=balance_of(len(model), 2), schedule="zb-h1", n_microbatches=2, dp=2)
        pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=_WAIT, compile=compiled)
        out[f"dp/{compiled}"] = (pipe.step(x[rows], y[rows]), grads_of(pipe.named_parameters()))
    return out


def _traced() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=BATCH)
    return model, x, torch.randint(0, 16, x.shape), gpt_loss


def _traced_plan(_: Any) -> tuple[str]:
    from partitioner import partition, profile

    model, x, _, _ = _traced()
    made = profile(model, x[: BATCH // 4], warmup=0, repeat=1)
    plan = partition(model, 4, x[: BATCH // 4], profile=made)
    return (plan.replace(schedule="zb-h1", recompute="except_last").to_json(),)


def _emulated() -> dict[str, Any]:
    """Under the NCCL emulation: the default device is meta inside a step (nothing may rely on it)."""
    return {"gpt": _gpt_runs([c for c in CONFIGS if c[0] in ("1f1b", "zb-h1")], ("except_last",))}


_EMULATED = job(2, _emulated, backend="nccl-emulated", timeout=240.0, batch="compile")
_JOBS = {2: job(2, _two, timeout=240.0, batch="compile"),
         4: job(4, _four, make_args=_traced_plan, timeout=240.0, batch="compile")}  # fmt: skip


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return _JOBS[2].results(tmp_path_factory)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return _JOBS[4].results(tmp_path_factory)


def _check_gpt(results: list[Any], keys: list[str]) -> None:
    loss_ref, grads_ref = reference("gpt")
    for key in keys:
        losses = [r["gpt"][key][0] for r in results]
        assert all(abs(v - loss_ref) <= 1e-5 * abs(loss_ref) for v in losses), (key, losses, loss_ref)
        merged = {k: g for r in results for k, g in r["gpt"][key][1].items()}
        assert sum(len(r["gpt"][key][1]) for r in results) == len(grads_ref)
        assert_close(merged, grads_ref, f"compiled {key}")


def test_every_schedule_compiled_matches_one_process(two: list[Any]) -> None:
    _check_gpt(two, [f"{s}/{mode}" for (s, _), mode in itertools.product(CONFIGS, RECOMPUTES)])


def test_buffers_dropout_and_evaluation_match_eager(two: list[Any]) -> None:
    keys = {k.rsplit("/", 1)[0] for k in two[0]["bn"]}
    assert len(keys) == 6
    for key in sorted(keys):
        for rank, r in enumerate(two):
            eager, compiled = r["bn"][f"{key}/False"], r["bn"][f"{key}/{BACKEND}"]
            assert abs(compiled[0] - eager[0]) <= 1e-5 * abs(eager[0]), (key, rank)
            assert_close(compiled[1], eager[1], f"{key} rank {rank} gradients")
            floats = {k: b for k, b in eager[2].items() if b.is_floating_point()}
            assert_close({k: compiled[2][k] for k in floats}, floats, f"{key} rank {rank} buffers")
            assert {k: b for k, b in compiled[2].items() if k not in floats} == {
                k: b for k, b in eager[2].items() if k not in floats
            }  # the step counters: m per step, exactly
            assert abs(compiled[3] - eager[3]) <= 1e-5 * abs(eager[3]), (key, rank)


def test_no_recompilation_after_the_first_step(two: list[Any]) -> None:
    for rank, r in enumerate(two):
        before, after, frames, breaks = r["frames"]
        assert after == before, f"rank {rank}: {after - before} frames compiled in steps after the first"
        assert frames["ok"] == frames["total"] > 0, (rank, frames)  # compiled, and nothing refused
        assert not breaks, (rank, breaks)


def test_compiled_under_the_nccl_emulation(tmp_path_factory: pytest.TempPathFactory) -> None:
    _check_gpt(_EMULATED.results(tmp_path_factory), ["1f1b/except_last", "zb-h1/except_last"])


@pytest.mark.slow  # the suite's time on 2 cores: run with -m slow
def test_four_ranks_traced_and_replicas(four: list[Any]) -> None:
    _check_gpt(four, [f"{s}/{mode}" for (s, _), mode in itertools.product(
        [c for c in CONFIGS if c[0] in FOUR], ("never", "always"))])  # fmt: skip
    model, x, y, loss_fn = _traced()
    loss = loss_fn(model(x), y)
    loss.backward()
    for rank, r in enumerate(four):
        got_loss, grads = r["traced"]
        assert abs(got_loss - loss.item()) <= 1e-5 * loss.item(), rank
        assert_close(grads, {k: p.grad for k, p in model.named_parameters() if k in grads}, f"traced {rank}")
    for rank, r in enumerate(four):
        eager, compiled = r["dp/False"], r[f"dp/{BACKEND}"]
        assert abs(compiled[0] - eager[0]) <= 1e-5 * abs(eager[0]), rank
        assert_close(compiled[1], eager[1], f"dp rank {rank}")
    # the replicas' reduction ran: both replicas of a pipeline rank hold the same (global) gradients
    for r in (0, 1):
        assert_close(four[r]["dp/aot_eager"][1], four[r + 2]["dp/aot_eager"][1], f"replicas of rank {r}")


# ---- one process


class _Counting:
    """An AOTAutograd backend counting each compiled forward and backward call, by layer class."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.calls: collections.Counter[str] = collections.Counter()
        self.backend = aot_autograd(fw_compiler=self._compiler("F"), bw_compiler=self._compiler("B"))

    def _compiler(self, kind: str) -> Any:
        from torch._functorch.aot_autograd import make_boxed_func

        def compile_graph(gm: torch.fx.GraphModule, _: Any) -> Any:
            def run(*args: Any) -> Any:
                self.calls[kind] += 1
                return gm(*args)

            return make_boxed_func(run)

        return compile_graph


@pytest.mark.parametrize(
    ("sched", "mode"), [("zb-h1", "never"), ("zb-h1", "always"), ("1f1b", "except_last")]
)
def test_compiled_code_runs_forward_once_per_use_and_backward_once(sched: str, mode: str) -> None:
    """Per layer and micro-batch: one compiled forward (two when recomputed: F, then the replay) and
    one compiled backward, B's; W adds the kept gradients and runs none, through autograd's
    accumulation (a replica's reducer launches its buckets from the hooks that fire there)."""
    counting = _Counting()
    model, x, y, loss_fn = build("mlp")  # 8 layers, all one kind
    pipe = Pipeline(model, [len(model)], schedule=sched, n_microbatches=M, loss_fn=loss_fn, recompute=mode,
                    compile={"backend": counting.backend})  # fmt: skip
    accumulated = collections.Counter[str]()
    for name, p in pipe.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: accumulated.update([name]))
    loss_ref, grads_ref = reference("mlp")
    assert pipe.step(x, y) == pytest.approx(loss_ref, rel=1e-5)
    assert_close(grads_of(pipe.named_parameters()), grads_ref, f"{sched} {mode}")
    replays = {"never": 0, "always": M, "except_last": M - 1}[mode]
    assert counting.calls == {"F": len(model) * (M + replays), "B": len(model) * M}
    assert accumulated == {name: M for name in grads_ref}  # once per micro-batch, as in eager


def test_modules_and_names_untouched_and_eager_elsewhere() -> None:
    model, x, y, loss_fn = build("gpt")
    names = list(model.state_dict())
    pipe = Pipeline(model, [len(model)], schedule="zb-h1", n_microbatches=M, loss_fn=loss_fn, compile=BACKEND)
    pipe.step(x, y)
    assert list(pipe.module.state_dict()) == names  # no _orig_mod.: checkpoints see the model's keys
    assert [k for k, _ in pipe.named_parameters()] == [k for k, _ in model.named_parameters()]
    assert all("_compiled_call_impl" not in vars(m) or m._compiled_call_impl is None for m in model.modules())
    before = _frames()
    with torch.no_grad():
        model(x)  # the model itself stays eager
    assert _frames() == before


def test_uneven_micro_batches_compile_once_more_not_per_micro_batch() -> None:
    model, _, _, loss_fn = build("mlp")
    torch.manual_seed(0)
    x, y = torch.randn(BATCH + 2, 8), torch.randn(BATCH + 2, 8)  # rows 3, 3, 2, 2
    counting = _Counting()
    compiled = {"backend": counting.backend}
    pipe = Pipeline(model, [len(model)], schedule="1f1b", n_microbatches=M, loss_fn=loss_fn, compile=compiled)
    before = _frames()
    pipe.step(x, y)
    # one kind of layer, two entries (the first layer's input needs no gradient, the others' do), each
    # again for the second micro-batch size, then with a dynamic batch dimension
    assert _frames() - before == 4
    pipe.step(x, y)
    pipe.step(x[:9], y[:9])  # rows 3, 2, 2, 2: a third size, the dynamic graphs take it
    assert _frames() - before == 4


def _kinds(n: int) -> nn.Sequential:
    """``n`` kinds of layer: a class made per factor, as a model has many layer classes."""
    layers = []
    for k in range(n):
        cls = type(f"Kind{k}", (nn.Module,), {"forward": lambda self, x, k=k: torch.tanh(x * (1 + k / 10))})
        layers.append(cls())
    return nn.Sequential(*layers)


def test_many_kinds_of_layer_each_compile_none_falls_back_to_eager() -> None:
    """torch.compile(module) traces every module through one shared wrapper: its ninth kind of layer
    would hit dynamo's recompile limit (8) and run eagerly; each kind here has its own budget."""
    model = _kinds(10)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    before = dict(counters["frames"])
    pipe = Pipeline(model, [10], schedule="gpipe", n_microbatches=2, loss_fn=nn.functional.mse_loss,
                    compile="eager")  # fmt: skip
    pipe.step(x, y)
    ok = counters["frames"]["ok"] - before.get("ok", 0)
    total = counters["frames"]["total"] - before.get("total", 0)
    assert ok == total == 10


@pytest.mark.slow  # the suite's time on 2 cores: run with -m slow
def test_inductor_split_backward_matches_one_process() -> None:
    """The one inductor case (C++ code generation on this machine): zb-h1 on the MLP (one kind of
    layer: a forward and a backward graph to build, about 20 s on 2 CPU cores)."""
    model, x, y, loss_fn = build("mlp")
    plan = Plan(balance=[len(model)], schedule="zb-h1", n_microbatches=M)
    pipe = Pipeline(model, plan, loss_fn=loss_fn, compile=True)
    loss_ref, grads_ref = reference("mlp")
    assert pipe.step(x, y) == pytest.approx(loss_ref, rel=1e-5)
    assert_close(grads_of(pipe.named_parameters()), grads_ref, "inductor zb-h1")


def test_bad_compile_values_are_refused_with_the_fix() -> None:
    model, _, _, loss_fn = build("mlp")
    with pytest.raises(
        ValueError, match=r"compile backend 'nope' is not one torch.compile knows; pass one of"
    ):
        Pipeline(model, [len(model)], loss_fn=loss_fn, compile="nope")
    with pytest.raises(TypeError, match=r"compile must be True .* got int 3"):
        Pipeline(model, [len(model)], loss_fn=loss_fn, compile=3)
    with pytest.raises(ValueError, match=r"has keys \['fast'\] that torch.compile does not take"):
        Pipeline(model, [len(model)], loss_fn=loss_fn, compile={"fast": True})
    with pytest.raises(ValueError, match=r"uses CUDA graphs, which overwrite a layer's outputs"):
        Pipeline(model, [len(model)], loss_fn=loss_fn, compile={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match=r"use mode='default' or 'max-autotune-no-cudagraphs'"):
        check_compile({"options": {"triton.cudagraphs": True}})
    assert check_compile(False) is None and check_compile(True) == {}
    # inductor's own random numbers: eager's where a stage recomputes (its F and replay draw alike)
    resolved = resolve([4, 4], schedule="1f1b", n_microbatches=2, n_virtual=None,
                       recompute=("never", "always"), checkpoint=None, compile=True)  # fmt: skip
    assert resolved.compile == {"options": {"fallback_random": True}}
    assert for_recompute({"backend": "inductor", "options": {"fallback_random": False}}, True) == {
        "backend": "inductor", "options": {"fallback_random": False}}  # fmt: skip
    assert for_recompute({"backend": "aot_eager"}, True) == {"backend": "aot_eager"}
    assert for_recompute({}, False) == {}
    assert check_compile({"backend": "aot_eager", "dynamic": False}) == {
        "backend": "aot_eager",
        "dynamic": False,
    }
    with pytest.raises(ValueError, match=r"compile= is not supported yet with shard=2 or tp=1"):
        check_compile_plan({}, 2, 1)
    with pytest.raises(ValueError, match=r"shard=1 or tp=2"):
        check_compile_plan({"backend": "aot_eager"}, 1, 2)
    check_compile_plan(None, 2, 2)  # eager: anything goes
