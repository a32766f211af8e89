"""examples/llama_3d.py as a user runs it: one command, 8 local ranks (pp=2, shard=2, tp=2), two steps.

The script spawns its ranks itself (pipeline.launch, from a fork server that imported torch and
transformers once). Checked from what it prints: the layout, finite losses, and the memory table,
where every rank holds fewer parameter, gradient and AdamW bytes than its stages do whole.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "llama_3d.py"


@pytest.mark.slow  # an end-to-end script run; tests/test_composition.py covers the library
def test_the_llama_3d_example_trains_on_pp_shard_tp_and_divides_each_ranks_memory(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("STAGEWISE_EMULATE_NCCL", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--pp", "2", "--shard", "2", "--tp", "2", "--steps", "2"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "layout: 8 ranks = dp_replicate 1 x dp_shard 2 x pp 2 x tp 2" in lines
    losses = [float(line.split("|")[1].split()[1]) for line in lines if line.startswith("step")]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    # "rank  (d,h,r,t)  params whole | grads whole | AdamW whole | params / whole", in KiB
    table = [line.split() for line in lines if re.match(r"\s*\d+\s+\(\d+,\d+,\d+,\d+\)", line)]
    assert [int(row[0]) for row in table] == list(range(8))  # one row per global rank
    for row in table:
        params, whole, grads, whole_grads, adam, whole_adam, _ = (float(x) for x in row[2:] if x != "|")
        # tp halves the blocks' Linears, FSDP halves everything: under half of the whole, each kind
        assert 0 < params < whole / 2 and 0 < grads < whole_grads / 2 and 0 < adam < whole_adam / 2, row
    assert "final loss" in lines[-1]
