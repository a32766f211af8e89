"""``scripts/train.py --model gpt-tied``: the traced GPT with a tied head, trained, saved and resumed.

One run on 2 ranks x 2 stages each (interleaved-1f1b: each rank holds two stages of the traced
graph, the token embedding on the first rank and the tied head on the second) with activation
recomputation, a loss log and text sampled from the gathered model; then a run resumed from its
middle checkpoint must give the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the ranks find `train` through the sys.path they inherit

import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_ranks")  # ranks forked, not spawned: conftest.py

TINY = ["--model", "gpt-tied", "--layers", "2", "--width", "16", "--seq-len", "16", "--batch-size", "8",
        "--microbatches", "4", "--schedule", "interleaved-1f1b", "--recompute", "always", "--steps", "8",
        "--lr", "1e-2", "--eval-every", "4", "--quiet"]  # fmt: skip


def test_gpt_tied_trains_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    log = tmp_path / "losses.jsonl"
    ckpt = ["--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "4"]
    straight = train.main([*TINY, *ckpt, "--loss-log", str(log), "--sample-chars", "20"])
    losses = straight[0]["losses"]
    assert len(losses) == 8 and all(r["losses"] == losses for r in straight)  # every rank has the loss
    assert sum(losses[-3:]) < sum(losses[:3])  # it trains
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"step": k + 1, "loss": loss} for k, loss in enumerate(losses)
    ]
    assert straight[0]["sample"].startswith("def ") and len(straight[0]["sample"]) == 24  # the whole model

    # a run stopped after step 4: a folder holding only that checkpoint
    name = "step-00000004"
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / name).rename(tmp_path / "b" / name)
    (tmp_path / "b" / "latest").write_text(name + "\n")
    resumed = train.main([*TINY, "--checkpoint-dir", str(tmp_path / "b"), "--resume", "--sample-chars", "0"])
    assert resumed[0]["start"] == 4
    assert resumed[0]["balance"] == straight[0]["balance"]  # the recorded plan, not a new profile's
    assert resumed[0]["losses"] == losses[4:]  # exactly, not approximately
    assert resumed[0]["evals"][-1][2] == straight[0]["evals"][-1][2]  # the same final validation loss
