"""scripts/gpu_check.py runs without a GPU: the CUDA rows say skipped, the NCCL rows run emulated and pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the script runs its CUDA checks")
def test_the_check_runs_on_cpu_with_its_cuda_rows_skipped() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=200, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    skipped = [line for line in lines if "skipped  no CUDA device" in line]
    assert len(skipped) == 8, proc.stdout  # every row that needs CUDA
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b v=2 m=2", "interleaved-1f1b v=2 m=4"):
        for dtype in ("fp32", "bf16"):
            assert any(
                f"nccl-emulated {name}" in line and dtype in line and " ok " in line for line in lines
            ), name
    assert any(line.startswith("killed rank (nccl-emulated, 2 ranks)") and " ok " in line for line in lines)
    assert any("emulation overhead" in line for line in lines)
    assert not [line for line in lines if " FAIL " in line]
