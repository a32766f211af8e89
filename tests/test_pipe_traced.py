"""Non-Sequential models through ``Pipeline``: traced stages, skips across cuts, two tensors, tied weights.

Each model written as users write it (tied GPT, U-Net with long skips, blocks passing two tensors)
is partitioned once, then run by ``Pipeline`` on 2 and 4 ranks under 1f1b, gpipe and zb-h1, with
activation recomputation off and on: the loss and every gradient must equal one process's on the
whole batch (fp32, relative error < 1e-5). The tied weight's copies must each hold the
single-process gradient, and stay identical to the single-process parameter through AdamW steps
with gradient clipping (which counts the tied weight once).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition, profile
from pipeline.plan import Plan
from pipeline.reference.graph_models import gpt_tied, image_loss, two_stream, unet
from pipeline.reference.models import gpt_loss
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import BATCH, assert_close

ALL = [
    ("1f1b", "never"), ("gpipe", "always"), ("zb-h1", "never"), ("1f1b", "always"), ("gpipe", "never"),
    ("zb-h1", "always"),
]  # fmt: skip


def _build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """(model, inputs, targets, loss_fn), the same on every call (seeded)."""
    torch.manual_seed(0)
    if name == "gpt_tied":
        model, x = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8, batch_size=BATCH)
        return model, x, torch.randint(0, 16, x.shape), gpt_loss
    if name == "unet":
        model, x = unet(widths=(4, 8, 16), image_size=8, batch_size=BATCH)
        return model, x, torch.randn(x.shape), image_loss
    model, x = two_stream(in_features=5, width=8, depth=4, n_classes=3, batch_size=BATCH)
    return model, x, torch.randint(0, 3, (BATCH,)), nn.functional.cross_entropy


MODELS = ("gpt_tied", "unet", "two_stream")


@functools.cache
def _profiles() -> dict[str, Any]:
    """One profile per model (one micro-batch of 2 ranks; the batch dimension is free in the trace)."""
    out = {}
    for name in MODELS:
        model, x, _, _ = _build(name)
        out[name] = profile(model, x[: BATCH // 2], warmup=0, repeat=1)
    return out


@functools.cache
def _plan(name: str, p: int) -> Plan:
    model, x, _, _ = _build(name)
    # balanced by flops: the host's load must not choose the stages (a rank without parameters has
    # nothing for AdamW); each rank then holds parameters, the same plan on any machine
    return partition(model, p, x[: BATCH // p], profile=_profiles()[name], cost="flops")


def _reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    model, x, y, loss_fn = _build(name)
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


Grads = dict[str, torch.Tensor]


def _rank(plans: dict[str, str], configs: list[tuple[str, str]], adamw_steps: int) -> dict[str, Any]:
    """On every rank: each model under each (schedule, recompute), one step each; then AdamW steps
    of the tied GPT. Losses, gradients, parameters and the gathered state, by model."""
    out: dict[str, Any] = {}
    for name, plan_json in plans.items():
        model, x, y, loss_fn = _build(name)
        runs = []
        for schedule, recompute in configs:
            plan = Plan.from_json(plan_json).replace(schedule=schedule, recompute=recompute)
            pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=60.0)
            loss = pipe.step(x, y)
            runs.append((loss, {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}))
            model.zero_grad(set_to_none=True)  # the pipeline's parameters are the model's own
            pipe.close()
        out[name] = runs
    model, x, y, loss_fn = _build("gpt_tied")
    pipe = Pipeline(model, Plan.from_json(plans["gpt_tied"]), loss_fn=loss_fn, timeout=60.0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(adamw_steps):
        losses.append(pipe.step(x, y))
        norms.append(pipe.clip_grad_norm_(0.05))  # small: clipping acts on every step
        opt.step()
        opt.zero_grad()
    params = {k: p.detach().clone() for k, p in pipe.named_parameters()}
    out["adamw"] = (losses, norms, params, pipe.gather_state_dict())
    pipe.close()
    return out


def _configs(p: int) -> list[tuple[str, str]]:
    return ALL if p == 2 else ALL[:3]


def _rank_args(p: int) -> tuple[dict[str, str], list[tuple[str, str]], int]:
    return {name: _plan(name, p).to_json() for name in MODELS}, _configs(p), 4


# 4 ranks in a launch of their own: the tie's group of ranks 0 and 3 (dist.new_group with local
# synchronization) hung after other jobs in a shared launch
_RAN = {
    p: job(p, _rank, make_args=lambda _, p=p: _rank_args(p), timeout=400.0, batch="b" if p == 2 else "ties")
    for p in (2, 4)
}


@pytest.fixture(scope="module", params=[2, 4])
def ran(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(p, configs, plans, every rank's results): one job of p ranks for every check below."""
    p = request.param
    results = _RAN[p].results(tmp_path_factory)
    return p, _configs(p), {name: _plan(name, p) for name in MODELS}, results


@pytest.mark.parametrize("name", MODELS)
def test_losses_and_gradients_equal_one_process(ran: Any, name: str) -> None:
    p, configs, plans, results = ran
    if name == "gpt_tied":
        assert plans[name].ties == {"tok.weight": [0, p - 1]}  # the head sits on the last rank
    ref_loss, ref = _reference(name)
    for c, (schedule, recompute) in enumerate(configs):
        merged: Grads = {}
        for r in range(p):
            loss, grads = results[r][name][c]
            assert loss == pytest.approx(ref_loss, rel=1e-5), (schedule, recompute, r)
            for k, g in grads.items():
                assert_close({k: g}, {k: ref[k]}, f"{name} p={p} {schedule} {recompute} rank {r}")
                merged[k] = g
        assert set(merged) == set(ref), (schedule, recompute)  # every parameter, by the model's name


def test_tied_copies_stay_identical_through_adamw(ran: Any) -> None:
    """The tied weight, the losses and the clipped norms are compared with one process's; not every
    parameter: a key bias has no gradient in exact arithmetic (softmax ignores a shift), and AdamW
    turns its rounding noise into full-size steps of either sign, in one process as in any other."""
    p, _, _, results = ran
    model, x, y, loss_fn = _build("gpt_tied")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want_losses, want_norms = [], []
    for _ in range(4):
        loss = loss_fn(model(x), y)
        loss.backward()
        want_losses.append(float(loss.detach()))
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    for r in range(p):
        losses, norms, _, _ = results[r]["adamw"]
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert norms == pytest.approx(want_norms, rel=1e-5)  # the tied weight's gradient counted once
    first, last = results[0]["adamw"][2]["tok.weight"], results[p - 1]["adamw"][2]["tok.weight"]
    assert torch.equal(first, last)  # the copies: bit for bit the same
    want = model.tok.weight.detach()
    assert_close({"tok.weight": first}, {"tok.weight": want}, f"p={p}, tied weight after 4 AdamW steps")
    state = results[0]["adamw"][3]
    names = {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
    assert state is not None and set(state) == names  # the tied weight once, by its first name
    assert torch.equal(state["tok.weight"], first)


def test_one_rank_refuses_another_model_and_other_shapes() -> None:
    model, x, y, loss_fn = _build("gpt_tied")
    plan = _plan("gpt_tied", 1)
    pipe = Pipeline(model, plan, loss_fn=loss_fn)
    assert pipe.step(x, y) == pytest.approx(float(loss_fn(model(x), y).detach()), rel=1e-5)
    with pytest.raises(ValueError, match=r"stage 0 was traced for inputs of shapes \[\[any, 8\]\]"):
        pipe.step(x[:, :4], y[:, :4])
    other, _ = gpt_tied(vocab_size=16, width=16, n_layers=3, n_heads=2, max_seq_len=8)
    with pytest.raises(ValueError, match=r"this plan was made for another model \(layer 5 is norm in this"):
        Pipeline(other, plan, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"or make the plan with partition\(model, n_ranks, sample\)"):
        Pipeline(other, [1], loss_fn=loss_fn)


def _replicated(plan_json: str) -> tuple[list[float], list[float], Grads, torch.Tensor]:
    """dp = 2 replicas of 2 pipeline ranks: global rank g = d * 2 + r holds rows [d * 4, d * 4 + 4)."""
    import torch.distributed as dist

    model, x, y, loss_fn = _build("gpt_tied")
    rows = slice(dist.get_rank() // 2 * (BATCH // 2), (dist.get_rank() // 2 + 1) * (BATCH // 2))
    pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_fn, timeout=60.0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, norms, first = [], [], {}
    for step in range(3):
        losses.append(pipe.step(x[rows], y[rows]))
        if step == 0:
            first = {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}
        norms.append(pipe.clip_grad_norm_(0.05))
        opt.step()
        if step:  # step 1 adds to step 0's gradients: tied copies and replicas count them once
            opt.zero_grad()
    weight = dict(pipe.named_parameters())["tok.weight"].detach().clone()
    pipe.close()
    return losses, norms, first, weight


def _tied_plan(_: Any, **changes: Any) -> tuple[str]:
    """(the tied GPT's 2-rank plan with ``changes``, as JSON): a job's arguments."""
    return (_plan("gpt_tied", 2).replace(**changes).to_json(),)


_REPLICATED = job(
    4, _replicated, make_args=functools.partial(_tied_plan, dp=2), timeout=240.0, batch="ties-dp"
)


def test_tied_weights_with_pipeline_replicas(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tied copies and data parallelism together: each replica sums its copies' gradients after the
    replicas' mean; every rank ends with one process's gradient on the global batch."""
    results = _REPLICATED.results(tmp_path_factory)
    model, x, y, loss_fn = _build("gpt_tied")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want_losses, want_norms, ref = [], [], {}
    for step in range(3):
        loss = loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            ref = {k: p.grad.clone() for k, p in model.named_parameters()}
        want_losses.append(float(loss.detach()))
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        if step:
            opt.zero_grad()
    for g, (losses, norms, grads, weight) in enumerate(results):
        assert losses == pytest.approx(want_losses, rel=1e-5), g
        assert norms == pytest.approx(want_norms, rel=1e-5), g
        assert_close(grads, {k: ref[k] for k in grads}, f"dp=2 x p=2, rank {g}")
        assert torch.equal(weight, results[0][3])  # every copy, in every replica
    assert_close({"w": results[0][3]}, {"w": model.tok.weight.detach()}, "tied weight after 3 AdamW steps")


def _emulated(plan_json: str) -> tuple[float, Grads]:
    model, x, y, loss_fn = _build("gpt_tied")
    pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_fn, timeout=60.0)
    loss = pipe.step(x, y)
    grads = {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}
    pipe.close()
    return loss, grads


_EMULATED = job(
    2, _emulated, make_args=functools.partial(_tied_plan, schedule="zb-h1"), backend="nccl-emulated",
    timeout=240.0, batch="b",
)  # fmt: skip


def test_tied_weights_on_the_nccl_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The NCCL code path (emulated on gloo: strict devices and streams) sums the tied copies too."""
    results = _EMULATED.results(tmp_path_factory)
    ref_loss, ref = _reference("gpt_tied")
    for r, (loss, grads) in enumerate(results):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_close(grads, {k: ref[k] for k in grads}, f"nccl-emulated rank {r}")
    assert "tok.weight" in results[0][1] and "tok.weight" in results[1][1]


def _checkpointed(folder: str, plan_json: str) -> tuple[list[float], list[float], list[str]]:
    """Train a step, save; a differently seeded model loads it; both train on: the same losses."""
    from torch.distributed.checkpoint import FileSystemReader

    from pipeline import checkpointing

    runs = []
    for load in (False, True):
        model, x, y, loss_fn = _build("gpt_tied")
        if load:
            torch.manual_seed(7)
            model = gpt_tied(vocab_size=16, width=16, n_layers=4, n_heads=2, max_seq_len=8)[0]
        pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_fn, timeout=60.0)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        if load:
            checkpointing.load(folder, pipe=pipe, optimizer=opt)
        else:
            pipe.step(x, y)
            opt.step()
            opt.zero_grad()
            checkpointing.save(folder, 1, pipe=pipe, optimizer=opt)
        losses = []
        for _ in range(2):
            losses.append(pipe.step(x, y))
            opt.step()
            opt.zero_grad()
        runs.append(losses)
        pipe.close()
    keys = sorted(FileSystemReader(str(checkpointing.latest(folder))).read_metadata().state_dict_metadata)
    return runs[0], runs[1], keys


def _checkpointed_args(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return str(tmp_path_factory.mktemp("tied") / "ckpt"), *_tied_plan(None)


_CHECKPOINTED = job(2, _checkpointed, make_args=_checkpointed_args, timeout=240.0, batch="b")


def test_a_tied_weight_is_saved_once_and_restored_on_every_copy(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _CHECKPOINTED.results(tmp_path_factory)
    for saved, loaded, keys in results:
        assert loaded == saved  # the loaded run continues exactly: every copy of tok.weight restored
        assert [k for k in keys if k.startswith("model/") and "weight" in k and "tok" in k] == [
            "model/tok.weight"
        ]
        assert not any("head.weight" in k for k in keys)  # one entry, by its first name
