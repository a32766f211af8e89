"""``Pipeline.step(..., scaler=)`` and ``Pipeline.unscale_``: torch's GradScaler over a pipeline.

    loss = pipe.step(x, y, scaler=scaler)   # backward of scaler.scale(loss); the loss returned unscaled
    pipe.unscale_(scaler, opt)              # scaler.unscale_, the overflow agreed on every rank
    pipe.clip_grad_norm_(1.0); scaler.step(opt); scaler.update()

against one process running the same with ``scaler.scale(loss).backward()``: losses, the scale
after each update and the parameters equal (fp32, relative 1e-5), including a step whose gradient
overflows on the last rank only: every rank skips it and backs the scale off, as one process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import assert_close, balance_of, build

STEPS, OVERFLOW = 5, 2  # the step whose gradient holds an inf
POISONED = "7.0.weight"  # the last layer's: on the last rank only


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)


def _poison(named: Any, k: int) -> None:
    for name, p in named:
        if k == OVERFLOW and name == POISONED and p.grad is not None:
            p.grad[0, 0] = float("inf")


def _freeze(model: nn.Sequential, layers: int) -> None:
    """The first ``layers`` layers frozen (fine-tuning the rest): a rank may hold no gradient at all."""
    for prm in model[:layers].parameters():
        prm.requires_grad_(False)


def _pipelined(
    schedule: str, v: int, frozen: bool = False
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    p = dist.get_world_size()
    model, _, _, loss_fn = build("mlp")
    balance = balance_of(len(model), p * v)
    if frozen:  # stage 0 whole: its rank's optimizer has parameters and no gradients
        _freeze(model, balance[0])
    plan = Plan(balance=balance, schedule=schedule, n_microbatches=4, n_virtual=v)
    pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=30.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = _scaler()
    losses, scales = [], []
    for k in range(STEPS):
        x, y = _batch(k)
        losses.append(
            pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None, scaler=scaler)
        )
        _poison(pipe.named_parameters(), k)
        pipe.unscale_(scaler, opt)
        pipe.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in pipe.named_parameters()}


def _matrix() -> dict[str, Any]:
    out = {f"{s}/v={v}": _pipelined(s, v) for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))}
    out["1f1b/v=1/frozen"] = _pipelined("1f1b", 1, frozen=True)
    return out


_JOBS = {p: job(p, _matrix, batch="c" if p == 2 else "b") for p in (2, 4)}


def _one_process(frozen: int = 0) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model, _, _, loss_fn = build("mlp")
    _freeze(model, frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler()
    losses, scales = [], []
    for k in range(STEPS):
        x, y = _batch(k)
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        _poison(model.named_parameters(), k)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    return losses, scales, {n: t.detach().clone() for n, t in model.named_parameters()}


@pytest.mark.parametrize("p", [2, 4])
def test_a_scaled_run_equals_one_process(p: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    for key in _JOBS[p].results(tmp_path_factory)[0]:
        # frozen: stage 0's layers (a rank with no gradient must still record its overflow check, or
        # scaler.step fails there, "No inf checks were recorded for this optimizer")
        ref_losses, ref_scales, ref_params = _one_process(balance_of(8, p)[0] if "frozen" in key else 0)
        assert ref_scales[OVERFLOW] == ref_scales[OVERFLOW - 1] / 2  # the overflow backed the scale off
        params: dict[str, torch.Tensor] = {}
        for r, res in enumerate(_JOBS[p].results(tmp_path_factory)):
            losses, scales, mine = res[key]
            assert scales == ref_scales, (key, r)  # every rank skipped the overflow and backed off
            for got, want in zip(losses, ref_losses, strict=True):
                assert abs(got - want) <= 1e-5 * abs(want), (key, r, got, want)
            params.update(mine)
        assert_close(params, ref_params, f"p={p} {key}")


def test_a_scaler_of_another_kind_is_refused() -> None:
    model, x, y, loss_fn = build("mlp")
    pipe = Pipeline(model, [8], loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler or None, got float"):
        pipe.step(x, y, scaler=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler, got NoneType"):
        pipe.unscale_(None, torch.optim.SGD(pipe.parameters(), lr=0.1))  # type: ignore[arg-type]
