"""The checkpoint folder: atomic saves (a crash at any moment leaves a loadable checkpoint), ``latest``,
pruning, clear errors. In one process, a whole model as ``pipe``; across ranks: test_checkpoint_resume."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from pipeline import checkpointing

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process dcp


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])


def _trained(steps: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for k in range(steps):
        _step(model, opt, k)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    model(torch.randn(5, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _save(folder: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> Path:
    return checkpointing.save(folder, step, pipe=model, optimizer=opt, **kw)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        flat.update({f"optim/{n}/{k}": v.clone() for k, v in opt.state[p].items()})
    return flat


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_into_a_fresh_optimizer_then_training_continues_identically(tmp_path: Path) -> None:
    model, opt = _trained(3)
    path = _save(tmp_path, 3, model, opt, extra={"step": 3})
    assert path == tmp_path / "step-00000003" and checkpointing.latest(tmp_path) == path
    assert "optim/0.weight/exp_avg" in FileSystemReader(path).read_metadata().state_dict_metadata

    fresh = _model()
    for p in fresh.parameters():
        p.data.zero_()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert checkpointing.load(path, pipe=fresh, optimizer=fresh_opt) == {"step": 3}
    _assert_same(_state(fresh, fresh_opt), _state(model, opt))
    _step(model, opt, 3)
    _step(fresh, fresh_opt, 3)
    _assert_same(_state(fresh, fresh_opt), _state(model, opt))


def test_crash_while_saving_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: Any) -> None:
    model, opt = _trained(1)
    before = _state(model, opt)
    first = _save(tmp_path, 1, model, opt)
    _step(model, opt, 1)

    real_save = checkpointing._dcp_save

    def crash(state: dict[str, Any], storage_writer: Any) -> None:
        real_save(state, storage_writer=storage_writer)  # data written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointing, "_dcp_save", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert (tmp_path / ".tmp-step-00000002").is_dir()  # the half-finished save stays aside
    assert checkpointing.latest(tmp_path) == first
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpointing.load(first, pipe=fresh, optimizer=fresh_opt)
    _assert_same(_state(fresh, fresh_opt), before)

    _save(tmp_path, 2, model, opt)
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000002"
    assert not (tmp_path / ".tmp-step-00000002").exists()


def test_load_restores_the_rng_state_saved_with_the_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained(1)
    with torch.random.fork_rng():
        torch.manual_seed(123)
        torch.rand(3)
        saved = torch.get_rng_state()
        path = _save(tmp_path, 1, model, opt)
        expected = torch.rand(8, generator=torch.Generator().set_state(saved))  # the draws after the save
        torch.manual_seed(999)  # the run goes on, or a new process seeds differently
        checkpointing.load(path, pipe=model, optimizer=opt)
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(8), expected)


def _fresh_state(path: Path) -> dict[str, torch.Tensor]:
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpointing.load(path, pipe=fresh, optimizer=fresh_opt)
    return _state(fresh, fresh_opt)


def test_crash_while_writing_the_step_latest_names_keeps_its_old_values(
    tmp_path: Path, monkeypatch: Any
) -> None:
    model, opt = _trained(1)
    step_two = _save(tmp_path, 2, model, opt)
    old = _state(model, opt)
    _step(model, opt, 1)
    assert not torch.equal(_state(model, opt)["model/0.weight"], old["model/0.weight"])

    real_save = checkpointing._dcp_save

    def partial(state: dict[str, Any], storage_writer: Any) -> None:
        scratch = tmp_path.parent / f"{tmp_path.name}-scratch"
        real_save(state, storage_writer=FileSystemWriter(scratch))
        target = Path(storage_writer.path)
        target.mkdir(parents=True, exist_ok=True)
        for f in scratch.glob("*.distcp"):  # the data lands, then the process dies before the metadata
            shutil.copy(f, target / f.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointing, "_dcp_save", partial)
    with pytest.raises(KeyboardInterrupt):  # saving step 2 again, e.g. after resuming from it
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert checkpointing.latest(tmp_path) == step_two
    _assert_same(_fresh_state(step_two), old)


def test_crash_between_the_renames_of_a_resave_keeps_the_old_step(tmp_path: Path, monkeypatch: Any) -> None:
    model, opt = _trained(1)
    _save(tmp_path, 2, model, opt)
    old = _state(model, opt)
    _step(model, opt, 1)
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-"):  # the previous folder is aside, the new one not yet in place
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(checkpointing.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    found = checkpointing.latest(tmp_path)
    assert found is not None and found.name == ".old-step-00000002"
    _assert_same(_fresh_state(found), old)

    _save(tmp_path, 2, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    _assert_same(_fresh_state(tmp_path / "step-00000002"), _state(model, opt))


def test_latest_pointer_and_pruning(tmp_path: Path) -> None:
    assert checkpointing.latest(tmp_path) is None
    model, opt = _trained(1)
    for step in (1, 2, 3, 3):  # saving a step again replaces it
        _save(tmp_path, step, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text() == "step-00000003\n"
    (tmp_path / "latest").write_text("step-00000099\n")  # names nothing complete: newest complete wins
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"
    (tmp_path / "latest").unlink()
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"


def test_wrong_model_is_a_clear_error(tmp_path: Path) -> None:
    model, opt = _trained(1)
    path = _save(tmp_path, 1, model, opt)
    other = nn.Sequential(nn.Linear(6, 7))
    with pytest.raises(ValueError, match=r"does not fit this model \(0.weight: saved \(6, 6\), now \(7, 6\)"):
        checkpointing.load(path, pipe=other, optimizer=torch.optim.AdamW(other.parameters()))
    bigger = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)])
    with pytest.raises(ValueError, match=r"lacks \['4.weight', '4.bias'\]"):
        checkpointing.load(path, pipe=bigger, optimizer=torch.optim.AdamW(bigger.parameters()))
    smaller = nn.Sequential(*[nn.Linear(6, 6) for _ in range(3)])
    with pytest.raises(ValueError, match=r"holds \['3.bias', '3.weight'\] \(of 2\) that no rank's model has"):
        checkpointing.load(path, pipe=smaller, optimizer=torch.optim.AdamW(smaller.parameters()))


def test_recorded_config_reads_the_newest_checkpoints_config_before_anything_is_built(tmp_path: Path) -> None:
    assert checkpointing.recorded_config(tmp_path / "not-yet") is None  # a first start: no folder yet
    model, opt = _trained(1)
    _save(tmp_path, 1, model, opt)  # saved without config=
    assert checkpointing.recorded_config(tmp_path) is None
    plan = {"schedule": "1f1b", "balance": [2, 2]}
    _save(tmp_path, 2, model, opt, config={"seed": 0, "plan": plan})
    newest = _save(tmp_path, 3, model, opt, config={"seed": 1, "plan": plan})
    assert checkpointing.recorded_config(tmp_path) == (newest, {"seed": 1, "plan": plan})
    (newest / "manifest.json").write_text("{damaged")  # passed over: the one before is the newest readable
    assert checkpointing.recorded_config(tmp_path) == (tmp_path / "step-00000002", {"seed": 0, "plan": plan})


def test_recorded_config_refuses_what_is_not_a_folder_of_checkpoints(tmp_path: Path) -> None:
    model, opt = _trained(1)
    one = _save(tmp_path, 1, model, opt, config={"seed": 0})
    with pytest.raises(ValueError, match=r"got one checkpoint .*step-00000001'; pass '.*'"):
        checkpointing.recorded_config(one)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"got the file .*notes.txt'; pass the folder that save\(\) wrote"):
        checkpointing.recorded_config(tmp_path / "notes.txt")
    with pytest.raises(TypeError, match="takes a folder path \\(str or Path\\), got int"):
        checkpointing.recorded_config(3)  # type: ignore[arg-type]
