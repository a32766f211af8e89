"""checkpointing.save / load in one process (a whole model as ``pipe``): keep, extra, param groups by
parameter, a save before the first step, what must be passed, bad arguments, the deprecated API."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import checkpointing

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process dcp


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _groups(model: nn.Module, biases_first: bool = False) -> torch.optim.AdamW:
    weights = {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1}
    rest = {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0, "lr": 0.02}
    return torch.optim.AdamW([rest, weights] if biases_first else [weights, rest], lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer, t: int, sched: Any = None) -> None:
    g = torch.Generator().manual_seed(t)
    model(torch.randn(8, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in folder.glob("step-*"))


def test_keep_prunes_older_checkpoints_never_the_one_just_written(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for keep, kept in ((1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (None, [1, 2, 3, 4, 5])):
        for step in range(1, 6):
            checkpointing.save(tmp_path / str(keep), step, pipe=model, optimizer=opt, keep=keep)
        assert _steps(tmp_path / str(keep)) == kept, keep
    # a folder holding higher steps of this run (steps after the one resumed from): kept by order of writing
    mixed = tmp_path / "mixed"
    for step in (10, 20, 30):
        checkpointing.save(mixed, step, pipe=model, optimizer=opt, keep=None)
    checkpointing.save(mixed, 5, pipe=model, optimizer=opt, extra="five", keep=2)
    assert _steps(mixed) == [5, 30] and checkpointing.latest(mixed) == mixed / "step-00000005"
    assert checkpointing.load(mixed, pipe=model, optimizer=opt) == "five"  # the folder: its latest
    checkpointing.save(mixed, 6, pipe=model, optimizer=opt, keep=1)
    assert _steps(mixed) == [6]
    big = tmp_path / "big"
    for step in (99_999_999, 100_000_000):  # past 8 digits, names no longer sort as numbers
        checkpointing.save(big, step, pipe=model, optimizer=opt, keep=None)
    (big / "latest").unlink()
    assert checkpointing.latest(big) == big / "step-100000000"
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"keep \({bad!r}\) must be an int >= 1 .* or None \(all\)"):
            checkpointing.save(tmp_path / "bad", 1, pipe=model, optimizer=opt, keep=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "bad").exists()


def test_extra_round_trips_any_json_value_and_refuses_others(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    nested = {"epoch": 3, "data": {"position": [1, 2, 3], "source": "train.txt"}, "lr": 0.5, "ok": True}
    for i, extra in enumerate([nested, [1, "a", None], "text", 7, None]):
        path = checkpointing.save(tmp_path, i, pipe=model, optimizer=opt, extra=extra)
        assert checkpointing.load(path, pipe=model, optimizer=opt) == extra
    bad: list[tuple[Any, str]] = [
        ({"pair": (1, 2)}, r"would load as \{'pair': \[1, 2\]\}; use lists for tuples and str dict keys"),
        ({1: "a"}, r"would load as \{'1': 'a'\}"),
        ({"t": torch.ones(2)}, r"extra must be JSON-able .*Tensor is not JSON serializable"),
        ({"loss": math.nan}, r"extra must be JSON-able .*Out of range float values"),
        ({1, 2}, r"extra must be JSON-able .*set is not JSON serializable"),
    ]
    for extra, match in bad:
        with pytest.raises(TypeError, match=match):
            checkpointing.save(tmp_path / "bad", 1, pipe=model, optimizer=opt, extra=extra)
    assert not (tmp_path / "bad").exists()  # refused before anything is written


def test_a_save_before_the_first_step_changes_nothing_and_resumes_exactly(tmp_path: Path) -> None:
    model, ref = _model(), _model()
    opt, ref_opt = _groups(model), _groups(ref)
    path = checkpointing.save(tmp_path, 0, pipe=model, optimizer=opt)
    assert not opt.state  # no optimizer state created (Adam's step count stays 0)
    fresh = _model(seed=1)
    fresh_opt = _groups(fresh)
    checkpointing.load(path, pipe=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state
    for t in range(3):
        for m, o in ((model, opt), (ref, ref_opt), (fresh, fresh_opt)):
            _step(m, o, t)
    for name, a in ref.state_dict().items():
        assert torch.equal(a, model.state_dict()[name]) and torch.equal(a, fresh.state_dict()[name]), name


def _hyper(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    keys = ("lr", "initial_lr", "weight_decay", "betas")
    return {names[id(p)]: {k: g[k] for k in keys} for g in opt.param_groups for p in g["params"]}


def test_param_groups_come_back_by_parameter_whatever_the_group_order(tmp_path: Path) -> None:
    model = _model()
    opt = _groups(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4))
    for t in range(2):
        _step(model, opt, t, sched)
    path = checkpointing.save(tmp_path, 2, pipe=model, optimizer=opt, lr_scheduler=sched)
    fresh = _model(seed=1)
    fresh_opt = _groups(fresh, biases_first=True)  # the groups in the other order
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda t: min(1.0, (t + 1) / 4))
    checkpointing.load(path, pipe=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    assert _hyper(fresh, fresh_opt) == _hyper(model, opt)
    assert fresh_opt.param_groups[0]["lr"] == 0.02 * 0.75  # biases: their own lr, at step 2 of warm-up
    for t in range(2, 4):
        _step(model, opt, t, sched)
        _step(fresh, fresh_opt, t, fresh_sched)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    one_group = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\] holds '0.weight' and '0.bias', saved with initial_lr=0.01 and "
        r"initial_lr=0.02: the checkpoint's param groups were formed differently",
    ):
        checkpointing.load(path, pipe=fresh, optimizer=one_group, lr_scheduler=fresh_sched)
    stranger = torch.optim.AdamW([*fresh.parameters(), nn.Parameter(torch.ones(2))])
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[6\] \(shape \(2,\)\) is not a parameter of"
    ):
        checkpointing.load(path, pipe=fresh, optimizer=stranger)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[6\] \(shape \(2,\)\) is not a parameter of"
    ):
        checkpointing.save(tmp_path / "x", 1, pipe=fresh, optimizer=stranger)


def test_what_was_saved_must_be_passed_to_load_and_nothing_else(tmp_path: Path) -> None:
    model = _model()
    opt = _groups(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    _step(model, opt, 0, sched)
    full = checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt, lr_scheduler=sched, grad_scaler=scaler)
    bare = checkpointing.save(tmp_path / "bare", 1, pipe=model, optimizer=opt)
    fresh = _model(seed=1)
    fresh_opt = _groups(fresh)
    with pytest.raises(ValueError, match=r"holds lr_scheduler state; pass lr_scheduler= to load\(\)"):
        checkpointing.load(full, pipe=fresh, optimizer=fresh_opt, grad_scaler=scaler)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda t: 1.0)
    with pytest.raises(ValueError, match=r"holds grad_scaler state; pass grad_scaler= to load\(\)"):
        checkpointing.load(full, pipe=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    with pytest.raises(ValueError, match=r"was saved without lr_scheduler=; pass lr_scheduler=None"):
        checkpointing.load(bare, pipe=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched)
    checkpointing.load(full, pipe=fresh)  # optimizer=None: the model alone, buffers too
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not fresh_opt.state
    fresh_scaler = torch.amp.GradScaler("cpu")
    checkpointing.load(
        full, pipe=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched, grad_scaler=fresh_scaler
    )
    assert fresh_scaler.state_dict() == scaler.state_dict() and fresh_sched.state_dict() == sched.state_dict()


def test_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in (-1, True, "3", 1.0):
        with pytest.raises(ValueError, match=rf"step \({step!r}\) must be an int >= 0"):
            checkpointing.save(tmp_path, step, pipe=model, optimizer=opt)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"save\(\) needs pipe= .* and optimizer= .* got pipe=Sequential, optimizer=NoneType"
    ):
        checkpointing.save(tmp_path, 1, pipe=model)
    with pytest.raises(TypeError, match=r"pipe must be a Pipeline \(or an nn.Module\), got str"):
        checkpointing.save(tmp_path, 1, pipe="model", optimizer=opt)  # type: ignore[arg-type]
    with pytest.raises(
        FileNotFoundError, match=r"no complete checkpoint in '.*empty'; pass a folder that save"
    ):
        checkpointing.load(tmp_path / "empty", pipe=model)
    with pytest.raises(TypeError, match=r"load\(\) needs pipe="):
        checkpointing.load(tmp_path)
    assert not list(tmp_path.iterdir())


def test_deprecated_api_works_with_a_warning_and_its_checkpoints_are_named(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, 0)
    with pytest.warns(
        FutureWarning, match=r"training_state is deprecated .* call checkpointing\.save\(folder, step, pipe="
    ):
        state = checkpointing.training_state(model.named_parameters(), opt, {"step": 1})
    with pytest.warns(
        FutureWarning, match=r"call checkpointing\.save\(folder, step, pipe=pipe, optimizer=optimizer"
    ):
        path = checkpointing.save(tmp_path, 1, state)
    fresh = _model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.warns(
        FutureWarning, match=r"call checkpointing\.load\(folder, pipe=pipe, optimizer=optimizer"
    ):
        assert checkpointing.load(
            path, fresh.named_parameters(), optimizer=fresh_opt, extra_keys=["step"]
        ) == {"step": 1}
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    with pytest.raises(ValueError, match=r"written by the deprecated training_state API; load it with"):
        checkpointing.load(path, pipe=fresh, optimizer=fresh_opt)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"lacks \['epoch'\] \(of 1 missing\)"):
        checkpointing.load(path, fresh.named_parameters(), fresh_opt, ["step", "epoch"])
