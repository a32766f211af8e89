from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from pipeline import checkpointing
from tests.dist import run_ranks

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
    state = checkpointing.training_state(model.named_parameters(), opt, {"step": 3})
    path = checkpointing.save(tmp_path, 3, state)
    assert path == tmp_path / "step-00000003" and checkpointing.latest(tmp_path) == path
    assert "optim/0.weight/exp_avg" in FileSystemReader(path).read_metadata().state_dict_metadata

    fresh = _model()
    for p in fresh.parameters():
        p.data.zero_()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extras = checkpointing.load(path, fresh.named_parameters(), fresh_opt, ["step"])
    assert extras == {"step": 3}
    _assert_same(_state(fresh, fresh_opt), _state(model, opt))
    _step(model, opt, 3)
    _step(fresh, fresh_opt, 3)
    _assert_same(_state(fresh, fresh_opt), _state(model, opt))


def test_crash_while_saving_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: Any) -> None:
    model, opt = _trained(1)
    before = _state(model, opt)
    first = checkpointing.save(tmp_path, 1, checkpointing.training_state(model.named_parameters(), opt))
    _step(model, opt, 1)

    real_save = checkpointing._dcp_save

    def crash(state: dict[str, Any], storage_writer: Any) -> None:
        real_save(state, storage_writer=storage_writer)  # data written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpointing, "_dcp_save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    monkeypatch.undo()
    assert (tmp_path / ".tmp-step-00000002").is_dir()  # the half-finished save stays aside
    assert checkpointing.latest(tmp_path) == first
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpointing.load(first, fresh.named_parameters(), fresh_opt)
    _assert_same(_state(fresh, fresh_opt), before)

    checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000002"
    assert not (tmp_path / ".tmp-step-00000002").exists()


def test_load_restores_the_rng_state_saved_with_the_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained(1)
    with torch.random.fork_rng():
        torch.manual_seed(123)
        torch.rand(3)
        saved = torch.get_rng_state()
        path = checkpointing.save(tmp_path, 1, checkpointing.training_state(model.named_parameters(), opt))
        expected = torch.rand(8, generator=torch.Generator().set_state(saved))  # the draws after the save
        torch.manual_seed(999)  # the run goes on, or a new process seeds differently
        checkpointing.load(path, model.named_parameters(), opt)
        assert torch.equal(torch.get_rng_state(), saved)
        assert torch.equal(torch.rand(8), expected)


def _fresh_state(path: Path) -> dict[str, torch.Tensor]:
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpointing.load(path, fresh.named_parameters(), fresh_opt)
    return _state(fresh, fresh_opt)


def test_crash_while_writing_the_step_latest_names_keeps_its_old_values(
    tmp_path: Path, monkeypatch: Any
) -> None:
    model, opt = _trained(1)
    step_two = checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
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
        checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    monkeypatch.undo()
    assert checkpointing.latest(tmp_path) == step_two
    _assert_same(_fresh_state(step_two), old)


def test_crash_between_the_renames_of_a_resave_keeps_the_old_step(tmp_path: Path, monkeypatch: Any) -> None:
    model, opt = _trained(1)
    checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    old = _state(model, opt)
    _step(model, opt, 1)
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-"):  # the previous folder is aside, the new one not yet in place
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(checkpointing.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    monkeypatch.undo()
    found = checkpointing.latest(tmp_path)
    assert found is not None and found.name == ".old-step-00000002"
    _assert_same(_fresh_state(found), old)

    checkpointing.save(tmp_path, 2, checkpointing.training_state(model.named_parameters(), opt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    _assert_same(_fresh_state(tmp_path / "step-00000002"), _state(model, opt))


def test_latest_pointer_and_pruning(tmp_path: Path) -> None:
    assert checkpointing.latest(tmp_path) is None
    model, opt = _trained(1)
    for step in (1, 2, 3, 3):  # saving a step again replaces it
        checkpointing.save(tmp_path, step, checkpointing.training_state(model.named_parameters(), opt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text() == "step-00000003\n"
    (tmp_path / "latest").write_text("step-00000099\n")  # names nothing complete: newest complete wins
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"
    (tmp_path / "latest").unlink()
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"


def test_wrong_model_and_bad_extras_are_clear_errors(tmp_path: Path) -> None:
    model, opt = _trained(1)
    path = checkpointing.save(tmp_path, 1, checkpointing.training_state(model.named_parameters(), opt))
    other = nn.Sequential(nn.Linear(6, 7))
    with pytest.raises(ValueError, match=r"does not fit this model \(0.weight: saved \(6, 6\), now \(7, 6\)"):
        checkpointing.load(path, other.named_parameters(), torch.optim.AdamW(other.parameters()))
    extra = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)])
    with pytest.raises(ValueError, match=r"lacks \['model/4.weight', 'model/4.bias'\]"):
        checkpointing.load(path, extra.named_parameters(), torch.optim.AdamW(extra.parameters()))
    with pytest.raises(ValueError, match=r"lacks \['step'\]"):
        checkpointing.load(path, model.named_parameters(), opt, ["step"])
    with pytest.raises(TypeError, match=r"json\.dumps"):
        checkpointing.training_state(model.named_parameters(), opt, {"config": {"a": 1}})


# ---- across processes: every rank holds some layers, as pipeline stages do (4 -> 2 stages: test_train)


def _owned(rank: int, world: int) -> list[int]:
    return [j for j in range(4) if j * world // 4 == rank]  # contiguous layers per rank


def _save_sharded(folder: str) -> dict[str, torch.Tensor]:
    model, opt = _trained(2)
    mine = {str(j) for j in _owned(dist.get_rank(), dist.get_world_size())}
    named = [(n, p) for n, p in model.named_parameters() if n.split(".")[0] in mine]
    checkpointing.save(folder, 2, checkpointing.training_state(named, opt, {"step": 2}))
    return _state(model, opt)


def test_checkpoint_sharded_over_ranks_loads_into_one_process(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    reference = run_ranks(tmp_path, _save_sharded, 2, str(folder))[0]
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-00000002"]
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])  # different init, all layers
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert checkpointing.load(
        checkpointing.latest(folder) or "", model.named_parameters(), opt, ["step"]
    ) == {"step": 2}
    _assert_same(_state(model, opt), reference)


def _rng_round_trip(folder: str) -> tuple[bool, torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    model, opt = _trained(1)
    mine = [(n, p) for n, p in model.named_parameters() if int(n.split(".")[0]) in _owned(rank, 2)]
    torch.manual_seed(100 + rank)  # every rank its own stream, as dropout masks differ by stage
    saved = torch.get_rng_state()
    checkpointing.save(folder, 1, checkpointing.training_state(mine, opt))
    expected = torch.rand(4, generator=torch.Generator().set_state(saved))
    torch.manual_seed(7)  # the same on every rank: a restore from the wrong rank would show
    checkpointing.load(checkpointing.latest(folder) or "", mine, opt)
    return torch.equal(torch.get_rng_state(), saved), torch.rand(4), expected


def test_load_restores_every_ranks_own_rng_state(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _rng_round_trip, 2, str(tmp_path / "ckpt"))
    for restored, drawn, expected in results:
        assert restored and torch.equal(drawn, expected)
    assert not torch.equal(results[0][1], results[1][1])
