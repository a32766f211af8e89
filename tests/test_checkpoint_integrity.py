"""Nothing half-written or damaged is loaded, and a checkpoint belongs to one run.

Damaged files (truncated, overwritten with garbage, missing, a damaged or lost manifest) are named and the
previous checkpoint is loaded with a warning; a process SIGKILLed at three moments of a save, and a full disk
(patched, and a real tmpfs when the tests run as root), leave the previous checkpoint loadable; a run with
another configuration is refused, listing each difference; pruning keeps the checkpoint just written and
never touches another run's; two ranks choose the same checkpoint when one rank sees a file damaged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipeline import checkpointing
from pipeline.checkpoint import folder as folder_module
from pipeline.checkpoint import manifest
from pipeline.checkpointing import CheckpointFallbackWarning, ConfigMismatch, CorruptCheckpoint
from tests.dist import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process dcp

CONFIG = {"seed": 0, "lr": 0.1, "steps": 10, "plan": {"balance": [2, 2], "dp": 1}, "data": "train.txt"}


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _two_saves(root: Path, **kw: Any) -> dict[str, torch.Tensor]:
    """Steps 1 and 2 of a run in ``root``; the parameters at step 1."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    checkpointing.save(root, 1, pipe=model, optimizer=opt, extra={"step": 1}, config=CONFIG, **kw)
    at_one = _params(model)
    _step(model, opt)
    checkpointing.save(root, 2, pipe=model, optimizer=opt, extra={"step": 2}, config=CONFIG, **kw)
    return at_one


def _shard(step_folder: Path) -> Path:
    return max(step_folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garbage(path: Path) -> None:
    with path.open("r+b") as f:  # 4 KB in the middle: same size, other bytes
        f.seek(path.stat().st_size // 2 - 2048)
        f.write(os.urandom(4096))


def _edit_manifest(path: Path) -> None:
    text = path.read_text()
    path.write_text(text.replace('"step": 2', '"step": 3'))  # valid JSON, wrong digest


_TRUNCATED = r"truncated \(\d+ bytes, the manifest records \d+\)"
DAMAGE: dict[str, tuple[Callable[[Path], None], Callable[[Path], Path], str]] = {
    "truncated .metadata": (_truncate, lambda s: s / ".metadata", rf"\.metadata: {_TRUNCATED}"),
    "truncated shard": (_truncate, _shard, rf"__0_0\.distcp: {_TRUNCATED}"),
    "garbage in a shard": (
        _garbage,
        _shard,
        r"__0_0\.distcp: corrupt \(crc32 0x[0-9a-f]{8}, the manifest records 0x",
    ),
    "missing shard": (Path.unlink, _shard, r"__0_0\.distcp: missing"),
    "damaged manifest": (
        _edit_manifest,
        lambda s: s / manifest.NAME,
        r"json' is damaged \(ValueError: its digest",
    ),
    "lost manifest": (
        Path.unlink,
        lambda s: s / manifest.NAME,
        r"manifest\.json: missing \(.* written with one\)",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_named_and_the_previous_checkpoint_loads(tmp_path: Path, damage: str) -> None:
    at_one = _two_saves(tmp_path)
    spoil, target, reason = DAMAGE[damage]
    step_two = tmp_path / "step-00000002"
    spoil(target(step_two))

    fresh = _model(seed=5)
    step_one = tmp_path / "step-00000001"
    fell_back = rf"'{step_one}' \(step 1\), the newest complete checkpoint before it"
    with pytest.warns(
        CheckpointFallbackWarning, match=rf"checkpoint rejected: '{step_two}' \(.*{reason}.*{fell_back}"
    ):
        assert checkpointing.load(tmp_path, pipe=fresh) == {"step": 1}
    for name, t in _params(fresh).items():
        assert torch.equal(t, at_one[name]), name
    with pytest.raises(CorruptCheckpoint, match=rf"checkpoint '{step_two}' cannot be loaded:\n  .*{reason}"):
        checkpointing.load(step_two, pipe=fresh)  # one step's folder: refused, never replaced

    opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with pytest.warns(CheckpointFallbackWarning):
        resumed = checkpointing.resume(tmp_path, pipe=fresh, optimizer=opt, config=CONFIG)
    assert resumed is not None and (resumed.step, resumed.extra) == (1, {"step": 1})
    assert [p for p, _ in resumed.rejected] == [step_two] and "rejected" in str(resumed)

    _garbage(_shard(tmp_path / "step-00000001"))  # nothing sound left: every checkpoint named
    both = rf"\n  '{step_two}': .*\n  '{step_one}': __0_0\.distcp: corrupt"
    with pytest.raises(CorruptCheckpoint, match=rf"no checkpoint in '{tmp_path}' can be loaded:{both}"):
        checkpointing.load(tmp_path, pipe=fresh)


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(tmp_path: Path) -> None:
    model, fresh = _model(), _model(seed=1)
    state = {f"model/{n}": p.detach() for n, p in model.named_parameters()} | {"step": 3}
    writer = filesystem.FileSystemWriter(
        tmp_path / "step-00000003"
    )  # dcp alone: no manifest, no integrity entry
    dcp_save(state, storage_writer=writer)
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"
    opt = torch.optim.AdamW(fresh.parameters())
    with (
        pytest.warns(UserWarning, match=r"has no manifest.json .* cannot be verified"),
        pytest.warns(FutureWarning),
    ):
        assert checkpointing.load(tmp_path, fresh.named_parameters(), opt, ["step"]) == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


# ---- a process killed during a save


def _save_then_hang(root: Path, phase: str) -> None:
    """In a forked child: save step 1, then step 2 until ``phase``, where it waits to be SIGKILLed."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    checkpointing.save(root, 1, pipe=model, optimizer=opt, extra={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def hang(*args: Any, **kwargs: Any) -> None:
        (root.parent / f"{phase}.ready").write_text(phase)
        time.sleep(300)

    def then_hang(real: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            hang()
            return out

        return patched

    if phase == "data":  # one tensor written, the others and dcp's .metadata not
        filesystem._write_item = then_hang(filesystem._write_item)
    elif phase == "manifest":  # the manifest complete in the temporary folder, not yet renamed
        manifest.write = then_hang(manifest.write)  # type: ignore[assignment]
    else:  # the new folder in place, ``latest`` not yet pointing at it
        folder_module._point_latest = hang  # type: ignore[assignment]
    checkpointing.save(root, 2, pipe=model, optimizer=opt, extra={"step": 2})


def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    phases = ("data", "manifest", "pointer")
    children: dict[str, int] = {}
    try:
        for ph in phases:
            pid = os.fork()  # torch is imported already: the children start at once
            if pid == 0:
                try:
                    _save_then_hang(tmp_path / ph, ph)
                finally:
                    os._exit(1)  # never back into pytest
            children[ph] = pid
        deadline = time.monotonic() + 120
        for ph, pid in children.items():
            while not (tmp_path / f"{ph}.ready").exists():
                assert os.waitpid(pid, os.WNOHANG) == (0, 0), (
                    f"{ph}: the child exited before the moment to kill"
                )
                assert time.monotonic() < deadline, f"{ph}: the child never reached the moment to kill"
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
    finally:
        for pid in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert (tmp_path / "data" / ".tmp-step-00000002").is_dir()
    assert (tmp_path / "manifest" / ".tmp-step-00000002" / manifest.NAME).is_file()
    assert (tmp_path / "pointer" / "step-00000002" / manifest.NAME).is_file()
    at_one = _params(_model())
    for ph in phases:
        root = tmp_path / ph
        assert checkpointing.latest(root) == root / "step-00000001", ph
        fresh = _model(seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointFallbackWarning)  # nothing damaged was even tried
            assert checkpointing.load(root, pipe=fresh) == {"step": 1}, ph
        for name, t in _params(fresh).items():
            assert torch.equal(t, at_one[name]), (ph, name)
        opt = torch.optim.AdamW(fresh.parameters())
        checkpointing.save(root, 2, pipe=fresh, optimizer=opt, extra={"step": 2}, keep=None)  # the save again
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"], ph
        assert checkpointing.load(root, pipe=fresh) == {"step": 2}


# ---- a full disk


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous(
    tmp_path: Path, monkeypatch: Any, where: str
) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt, extra={"step": 1})

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "data":  # inside dcp's write of the tensors
        monkeypatch.setattr(filesystem, "_write_item", full)
    else:
        monkeypatch.setattr(manifest, "write", full)
    message = (
        rf"checkpoint step 2 was not saved: No space left on device \(ENOSPC\) writing '{tmp_path}/.tmp-step-"
        rf"00000002' on rank 0; the previous checkpoint '{tmp_path}/step-00000001' is intact; free space"
    )
    with pytest.raises(OSError, match=message) as caught:
        checkpointing.save(tmp_path, 2, pipe=model, optimizer=opt, extra={"step": 2})
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # the partial one: gone
    assert checkpointing.load(tmp_path, pipe=_model(seed=1)) == {"step": 1}


def test_a_real_full_disk_on_a_small_tmpfs(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    probe = checkpointing.save(tmp_path / "probe", 1, pipe=model, optimizer=opt)
    size = sum(p.stat().st_size for p in probe.iterdir())
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr.decode().strip()}")
    try:
        checkpointing.save(disk, 1, pipe=model, optimizer=opt, extra={"step": 1})  # fits once, not twice
        full = r"checkpoint step 2 was not saved: No space left on device \(ENOSPC\) .*"
        with pytest.raises(
            OSError, match=rf"{full}the previous checkpoint '{disk}/step-00000001' is intact"
        ) as caught:
            checkpointing.save(disk, 2, pipe=model, optimizer=opt, extra={"step": 2})
        assert caught.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["latest", "step-00000001"]
        assert checkpointing.load(disk, pipe=_model(seed=1)) == {"step": 1}
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ---- a checkpoint belongs to one run


def test_a_run_with_another_configuration_is_refused_listing_every_difference(tmp_path: Path) -> None:
    _two_saves(tmp_path)
    model = _model(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert checkpointing.resume(tmp_path / "empty", pipe=model, optimizer=opt, config=CONFIG) is None
    other = {**CONFIG, "seed": 1, "steps": 20, "plan": {"balance": [4], "dp": 1}, "warmup": 5}
    del other["data"]
    lines = [
        'data: "train.txt" -> (absent)',
        "plan.balance: [2, 2] -> [4]",
        "seed: 0 -> 1",
        "steps: 10 -> 20",
        "warmup: (absent) -> 5",
    ]
    with pytest.raises(
        ConfigMismatch, match=r"belongs to a run with another configuration; 5 difference"
    ) as caught:
        checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=other)
    assert "\n  ".join(lines) in str(caught.value)
    with pytest.raises(ConfigMismatch, match=r"2 difference\(s\) .*:\n  seed: 0 -> 1\n  steps: 10 -> 20\n"):
        checkpointing.resume(
            tmp_path, pipe=model, optimizer=opt, config=other, allow_changes={"plan", "data", "warmup"}
        )
    allow = {"plan", "data", "warmup", "seed", "steps"}
    resumed = checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=other, allow_changes=allow)
    assert resumed is not None and resumed.step == 2 and resumed.changes == lines
    with pytest.raises(ValueError, match=r"allow_changes names \['seeds'\], which neither the saved nor"):
        checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=other, allow_changes={"seeds"})
    with pytest.raises(TypeError, match=r"allow_changes must be a set of config keys"):
        checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=other, allow_changes="seed")
    with pytest.raises(ConfigMismatch, match=r"seed: 0 -> 1"):  # load compares too, when given config=
        checkpointing.load(
            tmp_path, pipe=model, config=other, allow_changes={"plan", "data", "warmup", "steps"}
        )
    same = checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=CONFIG)
    assert same is not None and same.changes == [] and same.run_id == resumed.run_id
    assert str(same) == f"resumed run {same.run_id} from '{tmp_path}/step-00000002' at step 2"


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))


def test_pruning_keeps_the_checkpoint_just_written_and_never_another_runs(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in (10, 20, 30):  # an older run, further on
        checkpointing.save(tmp_path, step, pipe=model, optimizer=opt, keep=None, run_id="older")
    for step in (1, 2, 3):
        checkpointing.save(tmp_path, step, pipe=model, optimizer=opt, keep=2, run_id="newer")
        assert step in _steps(tmp_path)
    assert _steps(tmp_path) == [2, 3, 10, 20, 30]
    assert checkpointing.latest(tmp_path) == tmp_path / "step-00000003"
    refused = r"step-00000010' is a checkpoint of another run \(older\); this save belongs to run newer: "
    with pytest.raises(ValueError, match=rf"{refused}save into another folder, or resume that run"):
        checkpointing.save(tmp_path, 10, pipe=model, optimizer=opt, keep=2, run_id="newer")
    assert _steps(tmp_path) == [2, 3, 10, 20, 30]
    # the order is the order of writing: the newer run, resumed from step 2, writes step 3 again, then 4
    checkpointing.load(tmp_path / "step-00000002", pipe=model, optimizer=opt)
    checkpointing.save(tmp_path, 3, pipe=model, optimizer=opt, keep=2)  # run_id: the run loaded
    checkpointing.save(tmp_path, 4, pipe=model, optimizer=opt, keep=1)
    assert _steps(tmp_path) == [4, 10, 20, 30]
    checkpointing.save(tmp_path, 31, pipe=model, optimizer=opt, keep=1, run_id="older")
    assert _steps(tmp_path) == [4, 31]


# ---- every rank chooses the same checkpoint


def _one_rank_sees_damage(root: str) -> dict[str, Any]:
    folder = Path(root) / "ckpt"
    at_one = _two_saves(folder)
    if dist.get_rank() == 1:  # this rank's view of step 2 is damaged (a stale cache, a failing mount)
        real = manifest.digest_file

        def damaged(path: Path) -> tuple[int, int]:
            size, crc = real(path)
            return (size, crc ^ 1) if "step-00000002" in str(path) else (size, crc)

        manifest.digest_file = damaged  # type: ignore[assignment]
    fresh = _model(seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = checkpointing.load(folder, pipe=fresh)
    same = all(torch.equal(t, at_one[k]) for k, t in _params(fresh).items())
    return {
        "extra": extra,
        "same": same,
        "warned": [str(w.message) for w in caught if w.category is CheckpointFallbackWarning],
    }


def test_every_rank_loads_the_same_checkpoint_when_one_rank_sees_a_file_damaged(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _one_rank_sees_damage, 2, str(tmp_path), timeout=90.0)
    assert [r["extra"] for r in results] == [{"step": 1}, {"step": 1}]
    assert all(r["same"] for r in results)
    (warned,) = results[0]["warned"]  # rank 0 says it, for all
    assert "step-00000002' (" in warned and ": corrupt (crc32 0x" in warned and "(step 1)" in warned
    assert results[1]["warned"] == []


def test_bad_config_run_id_and_resume_arguments_are_clear_errors(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"config must be a dict with str keys .* got str"):
        checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt, config="lr=0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"would load as \{'balance': \[2, 2\]\}; use lists"):
        checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt, config={"balance": (2, 2)})
    with pytest.raises(ValueError, match=r"run_id \('a b'\) must be a non-empty str of letters, digits"):
        checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt, run_id="a b")
    assert not tmp_path.joinpath("latest").exists()  # refused before anything is written
    path = checkpointing.save(tmp_path, 1, pipe=model, optimizer=opt)
    with pytest.raises(TypeError, match=r"resume\(\) needs config="):
        checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=None)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=rf"resume\(\) takes the folder of checkpoints, .* pass '{tmp_path}'"
    ):
        checkpointing.resume(path, pipe=model, optimizer=opt, config=CONFIG)
    with pytest.raises(ConfigMismatch, match=r"it records no config: it was saved without config="):
        checkpointing.resume(tmp_path, pipe=model, optimizer=opt, config=CONFIG)


# ---- every rank's digests are in the manifest


def _rank_one_damages_step_two(root: str) -> dict[str, Any]:
    folder = Path(root) / "ckpt"
    at_one = _two_saves(folder)
    step_two = folder / "step-00000002"
    # the files rank 1 digested at the save (the sorted listing's every other file from index 1: here
    # __0_0.distcp) and the shard rank 1 wrote: both are damaged, by rank 1, before any rank loads
    damaged = sorted({*manifest.share(manifest.listing(step_two), 1, 2), "__1_0.distcp"})
    recorded = sorted(manifest.read(step_two).files)
    dist.barrier()
    if dist.get_rank() == 1:
        for name in damaged:
            _truncate(step_two / name)
    dist.barrier()
    fresh = _model(seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = checkpointing.load(folder, pipe=fresh)
    return {
        "extra": extra,
        "same": all(torch.equal(t, at_one[k]) for k, t in _params(fresh).items()),
        "warned": [str(w.message) for w in caught if w.category is CheckpointFallbackWarning],
        "damaged": damaged,
        "recorded": recorded,
        "listed": manifest.listing(step_two),
    }


def test_a_damaged_file_in_rank_ones_share_is_named_and_the_previous_checkpoint_loads(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _rank_one_damages_step_two, 2, str(tmp_path), timeout=90.0)
    damaged = results[0]["damaged"]
    assert damaged == ["__0_0.distcp", "__1_0.distcp"]  # the one rank 1 digested is not the one it wrote
    assert [r["extra"] for r in results] == [{"step": 1}, {"step": 1}]
    assert all(r["same"] for r in results)
    (warned,) = results[0]["warned"]
    for name in damaged:  # each damaged file named, whichever rank digested it at the save
        assert re.search(rf"{re.escape(name)}: {_TRUNCATED}", warned), (name, warned)
    assert "step-00000002' (" in warned and "(step 1)" in warned
    assert results[0]["recorded"] == results[0]["listed"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


# ---- the order of writing, not the step, after a run resumed from an older step


def _resumed_from_an_older_step(root: Path, keep: int | None) -> dict[str, torch.Tensor]:
    """Steps 10 and 20; the run resumed from step 10 then saves 12 and 15 (``keep`` at 15); the
    parameters at step 12. Save order (serial): 10, 20, 12, 15."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in (10, 20):
        _step(model, opt)
        checkpointing.save(root, step, pipe=model, optimizer=opt, extra={"step": step}, keep=None)
    assert checkpointing.load(root / "step-00000010", pipe=model, optimizer=opt) == {"step": 10}
    _step(model, opt)
    checkpointing.save(root, 12, pipe=model, optimizer=opt, extra={"step": 12}, keep=None)
    at_twelve = _params(model)
    _step(model, opt)
    checkpointing.save(root, 15, pipe=model, optimizer=opt, extra={"step": 15}, keep=keep)
    return at_twelve


def test_a_damaged_newest_falls_back_and_keep_prunes_in_the_order_of_writing(tmp_path: Path) -> None:
    root = tmp_path / "all"
    at_twelve = _resumed_from_an_older_step(root, keep=None)
    names = [p.name for p in folder_module.candidates(root)]
    assert names == ["step-00000015", "step-00000012", "step-00000020", "step-00000010"]
    step_15 = root / "step-00000015"
    _garbage(_shard(step_15))
    # the rule (folder.py): ``latest`` first, then by serial: step 12, written just before 15, not step 20,
    # the higher step that the resumed run went back from
    fresh = _model(seed=5)
    fell_back = rf"loading '{root}/step-00000012' \(step 12\), the newest complete checkpoint before it"
    with pytest.warns(CheckpointFallbackWarning, match=rf"rejected: '{step_15}' \(.*corrupt.*{fell_back}"):
        assert checkpointing.load(root, pipe=fresh) == {"step": 12}
    for name, t in _params(fresh).items():
        assert torch.equal(t, at_twelve[name]), name

    pruned = tmp_path / "keep2"
    _resumed_from_an_older_step(pruned, keep=2)  # 15 and the one written just before it
    assert _steps(pruned) == [12, 15]
