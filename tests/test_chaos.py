"""Fast versions of ``scripts/chaos.py``'s scenarios: real ``scripts/train.py`` runs, faults on purpose.

    baseline (module fixture): 2 ranks under pipeline.launch, 8 steps, a checkpoint every 4
    torchrun --max-restarts 1, a worker SIGKILLed after step 5      -> restarted, the baseline's losses
    torchrun --max-restarts 1, a worker SIGKILLed while saving      -> the previous checkpoint loads,
                                                                      the baseline's losses
    the newest checkpoint's shards truncated / bit-flipped          -> both files named, step 4 used,
                                                                      the baseline's losses
    the same folder with another --seed                             -> refused, the folder untouched

Every run is in its own session with a tag in its environment; after each, no
process with that tag or in that session may be left (``chaos.Job.stray``).
"""

from __future__ import annotations

import random
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import chaos

STEPS, EVERY = 8, 4


def _setup(launcher: str) -> chaos.Setup:
    return chaos.Setup(launcher, 2, steps=STEPS, every=EVERY, max_restarts=1, wait_timeout_s=20.0,
                       job_timeout_s=200.0)  # fmt: skip


def _run(setup: chaos.Setup, run_dir: Path, argv: list[str], fault: chaos.Fault | None = None
         ) -> tuple[chaos.Watch, str]:  # fmt: skip
    """One run; asserts that nothing of it is left behind."""
    w, job = chaos.attempt(setup, run_dir, argv, fault, {"STAGEWISE_TIMEOUT": str(setup.wait_timeout_s)})
    try:
        assert chaos.orphans_after(job) == 0, f"processes left: {job.stray()}"
    finally:
        job.stop()
    return w, (run_dir / "out.txt").read_text(errors="replace")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, float]]:
    """(data file, the finished run's folder, its losses)."""
    root = tmp_path_factory.mktemp("chaos")
    data, run_dir = chaos.small_data(root), root / "base"
    run_dir.mkdir()
    w, text = _run(_setup("launch"), run_dir, chaos.train_command(_setup("launch"), run_dir, data))
    assert w.rc == 0, text[-3000:]
    losses = chaos.losses_of(run_dir / "loss.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert chaos.complete_steps(run_dir / "ckpt") == {EVERY, STEPS}
    return data, run_dir, losses


def test_worker_killed_mid_step_under_torchrun_restarts_to_the_uninterrupted_losses(
    base: tuple[Path, Path, dict[int, float]], tmp_path: Path
) -> None:
    data, _, losses = base
    setup = _setup("torchrun")
    fault = chaos.kill_worker_at(signal.SIGKILL, lambda job, d: len(chaos.losses_of(d / "loss.jsonl")) >= 5,
                                 random.Random(0))  # fmt: skip
    w, text = _run(setup, tmp_path, chaos.train_command(setup, tmp_path, data), fault)
    assert w.t_fault is not None and w.rc == 0, text[-3000:]
    assert w.generations == 2  # one restart
    resumed = chaos.resumed_steps(text)  # the restart says where it resumed: the newest checkpoint then
    assert len(resumed) == 1 and resumed[0] >= max(w.before_fault, default=0) >= EVERY, (
        resumed,
        w.before_fault,
    )
    assert chaos.losses_of(tmp_path / "loss.jsonl") == losses  # bit for bit


@pytest.mark.slow
def test_kill_during_save_keeps_the_previous_checkpoint_loadable(
    base: tuple[Path, Path, dict[int, float]], tmp_path: Path
) -> None:
    data, _, losses = base
    setup = _setup("torchrun")
    fault = chaos.kill_worker_at(signal.SIGKILL, lambda job, d: any((d / "ckpt").glob(".tmp-step-*")),
                                 random.Random(1))  # fmt: skip
    w, text = _run(setup, tmp_path, chaos.train_command(setup, tmp_path, data), fault)
    assert w.t_fault is not None and w.rc == 0, text[-3000:]
    # the restart resumed from the newest checkpoint complete at the kill (or the one being written,
    # if its rename came first), never an older one; nothing resumed: the first save was hit
    resumed = chaos.resumed_steps(text)
    assert all(s >= max(w.before_fault, default=0) for s in resumed), (resumed, w.before_fault)
    assert chaos.losses_of(tmp_path / "loss.jsonl") == losses


def test_truncated_and_bit_flipped_shards_are_named_and_skipped(
    base: tuple[Path, Path, dict[int, float]], tmp_path: Path
) -> None:
    data, src, losses = base
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "ckpt" / f"step-{STEPS:08d}"
    shards = sorted(newest.glob("*.distcp"))
    assert len(shards) == 2  # one per rank
    rng = random.Random(2)
    chaos.damage(shards[0], "truncate", rng)
    chaos.damage(shards[1], "flip", rng)
    setup = _setup("launch")
    w, text = _run(setup, tmp_path, chaos.train_command(setup, tmp_path, data))
    assert w.rc == 0, text[-3000:]
    assert shards[0].name in text and shards[1].name in text  # each damaged file named
    assert chaos.resumed_steps(text) == [EVERY]  # fell back to the previous complete checkpoint
    assert chaos.losses_of(tmp_path / "loss.jsonl") == losses


@pytest.mark.slow
def test_a_second_run_with_another_seed_in_the_same_folder_is_refused(
    base: tuple[Path, Path, dict[int, float]], tmp_path: Path
) -> None:
    data, src, _ = base
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    before = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    setup = _setup("launch")
    w, text = _run(setup, tmp_path, chaos.train_command(setup, tmp_path, data, "--seed", "1"))
    assert w.rc == 2, text[-3000:]
    assert "seed: 0 -> 1" in text
    after = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing pruned
