"""examples/own_loop.py as a user runs it: train, stop, resume (under torchrun), and compare bit for bit.

    run A   pipeline.launch, 2 epochs, uninterrupted                     -> history A, plan.json
    run B   torchrun, the same options and plan, stopped after epoch 1    -> history B, a checkpoint
    run C   pipeline.launch on B's folder: resumes from its checkpoint    -> history C
    A == B + C, every training loss, gradient norm, learning rate, validation loss and accuracy

The plan is A's, copied into B's folder (the script reuses a folder's plan): the same stages on
the same ranks, so the same dropout streams. Sizes are small: 42 training rows in batches of 16
(3 steps an epoch, the last of 10 rows: uneven micro-batches), 30 validation rows (the last batch
14). One bf16 run checks the autocast flag end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"
SMALL = [
    "--epochs", "2", "--train-size", "42", "--val-size", "30", "--batch-size", "16",
    "--microbatches", "4", "--width", "4", "--image-size", "8", "--warmup", "3",
]  # fmt: skip


def _run(folder: Path, *extra: str, torchrun: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("STAGEWISE_EMULATE_NCCL", None)
    launcher = [sys.executable]
    if torchrun:  # --standalone: a free port on localhost, no fixed one
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = [*SMALL, "--checkpoints", str(folder), "--history", str(folder / "history.jsonl"), *extra]
    done = subprocess.run(
        [*launcher, str(SCRIPT), *args],
        env=env,
        cwd=folder.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _history(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_own_loop_example_resumes_bit_for_bit_under_torchrun(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    printed = _run(a)
    full = _history(a)
    steps = [r for r in full if r["kind"] == "step"]
    epochs = [r for r in full if r["kind"] == "epoch"]
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["epoch"] for r in epochs] == [1, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["val_loss"] > 0 for r in epochs)
    assert "accuracy" in printed  # the report a user reads
    assert steps[0]["lr"] < steps[2]["lr"] > steps[-1]["lr"]  # warm-up, then decay

    b.mkdir()
    shutil.copy(a / "plan.json", b / "plan.json")
    _run(b, "--stop-after", "1", torchrun=True)
    stopped = _history(b)
    assert stopped == full[: len(stopped)] and stopped[-1] == epochs[0]  # epoch 1, as in A
    assert sorted(p.name for p in b.iterdir() if p.name.startswith("step-")) == ["step-00000003"]

    _run(b)  # resumes from B's checkpoint (launch this time)
    assert _history(b) == full  # B + C: every float equal, bit for bit


@pytest.mark.slow
def test_the_own_loop_example_runs_in_bf16(tmp_path: Path) -> None:
    folder = tmp_path / "bf16"
    _run(folder, "--bf16", "--epochs", "1")
    history = _history(folder)
    assert [r["kind"] for r in history] == ["step"] * 3 + ["epoch"]
    assert all(r["loss"] > 0 for r in history[:-1]) and 0.0 <= history[-1]["accuracy"] <= 1.0
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["n_microbatches"] == 4 and len(plan["balance"]) == 2


@pytest.mark.slow
def test_the_transformers_llama_example_loads_per_stage_trains_and_checkpoints(tmp_path: Path) -> None:
    """examples/hf_llama.py: a sharded stand-in folder, per-stage loading, AdamW steps, a DCP save."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    script = SCRIPT.parent / "hf_llama.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "run"), "--steps", "12"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(line.split("loss")[1]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0]  # steps 0 and 10: it learns
    assert "cuts before model.model.layers." in done.stdout and "final loss" in done.stdout
    assert (tmp_path / "run" / "pretrained" / "model.safetensors.index.json").is_file()  # sharded
    assert (tmp_path / "run" / "checkpoints" / "step-00000012").is_dir()
