"""scripts/gpu_check.py on CPU: what its rows run and how they judge.

Its CUDA rows need a GPU. Here: the schedule rows cover every registered schedule, each with a
valid (v, m); the feature rows (dp = 2 with a mesh, a weight tied across ranks, variable-length
steps, fp16 with GradScaler, predict(dst=), load_pretrained, a drain mid-step) run their rank code
on 2 ranks under the NCCL emulation and pass against one process; each judge fails results unlike
one process's, and what each row exists to see (the drain's sync, the outputs' rank, the scales, the
tied copies, the replicas); a row that fails on one rank is that row's FAIL and the rest are
skipped. The host-sync row's detection is tests/test_host_sync.py's. The slow tests run the whole
script, with and without torchrun: its CUDA rows say skipped, the NCCL rows run emulated and pass.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline.schedules.registry import REGISTRY
from scripts import gpu_check
from tests.dist import job

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
CPU = torch.device("cpu")


# ---- the schedule rows: the registry, every entry


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_schedule_rows_cover_every_registered_schedule_with_a_valid_v_and_m(p: int) -> None:
    configs = gpu_check._configs(p)
    assert sorted({name for name, _, _ in configs}) == sorted(REGISTRY)
    n_layers = 2 * p + 3  # _model(2p): embedding, 2p blocks, norm, head
    for name, v, m in configs:
        entry = REGISTRY[name]
        assert v == entry.default_virtual, name
        assert m % p == 0 if entry.m_multiple_of_p else m == 2 * p, (name, m)
        gpu_check._plan(n_layers, p, name, v, m).build_schedule()  # checked, built and validated
    assert {name for name, _, m in configs if m == 2 * p} == set(REGISTRY)  # dualpipe-v: m >= 2p


# ---- the feature rows, on 2 ranks under the NCCL emulation


def _boom(dev: torch.device) -> gpu_check.Result:
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    return gpu_check._result([], {})


def _never(*args: Any) -> Any:
    raise AssertionError("a failed or skipped row is neither referenced nor judged")


_BROKEN = tuple(gpu_check.Feature(name, _boom, _never, _never) for name in ("boom", "after"))


def _features() -> dict[str, Any]:
    control = gpu_check.control_group()
    before = os.environ.get(gpu_check.DRAIN_ENV)
    features = gpu_check.run_features(control)
    after = os.environ.get(gpu_check.DRAIN_ENV)
    return {"features": features, "env": (before, after), "broken": gpu_check.run_features(control, _BROKEN)}


_FEATURES = job(2, _features, backend="nccl-emulated", timeout=120.0, batch="gpucheck")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _FEATURES.results(tmp_path_factory)


@pytest.fixture(scope="module")
def references() -> dict[str, gpu_check.Result]:
    """Each feature's one-process run for 2 ranks, once for every judgement below."""
    return {f.name: f.reference(2, CPU) for f in gpu_check.FEATURES}


def _judged(
    ranks: list[dict[str, Any]],
    references: dict[str, gpu_check.Result],
    name: str,
    change: Callable[[list[gpu_check.Result]], object] = lambda results: None,
) -> str:
    """The status the feature ``name``'s judge gives its ranks' results, ``change``d first."""
    assert all(r["features"][name][0] == "ok" for r in ranks), [r["features"][name] for r in ranks]
    results = copy.deepcopy([r["features"][name][1] for r in ranks])
    change(results)
    feature = next(f for f in gpu_check.FEATURES if f.name == name)
    return feature.judge(results, references[name])[0]


def test_every_feature_row_passes_against_one_process(ranks: list[dict[str, Any]]) -> None:
    rows = gpu_check.feature_rows([r["features"] for r in ranks], CPU, "nccl-emulated")
    assert [row[0] for row in rows] == [f"nccl-emulated {f.name}, 2 ranks" for f in gpu_check.FEATURES]
    assert [row for row in rows if row[1] != "ok"] == []
    envs = [r["env"] for r in ranks]  # the drain's variable before and after the rows: set for its row only
    assert all(before == after for before, after in envs), envs


def _scale_tensors(results: list[gpu_check.Result]) -> None:
    for t in next(r for r in reversed(results) if r["tensors"])["tensors"].values():  # the last rank's
        t.mul_(1.05)  # beyond every row's tolerance (fp16's: 2e-2)


def _shift_losses(results: list[gpu_check.Result]) -> None:
    results[0]["losses"][-1] *= 1.05


@pytest.mark.parametrize("change", [_scale_tensors, _shift_losses])
def test_each_judge_fails_results_unlike_one_process(
    ranks: list[dict[str, Any]],
    references: dict[str, gpu_check.Result],
    change: Callable[[list[gpu_check.Result]], None],
) -> None:
    for f in gpu_check.FEATURES:
        if change is _shift_losses and not references[f.name]["losses"]:
            continue  # predict has outputs only
        assert _judged(ranks, references, f.name, change) == "FAIL", f.name


def test_each_row_fails_when_what_it_exists_to_see_is_missing(
    ranks: list[dict[str, Any]], references: dict[str, gpu_check.Result]
) -> None:
    def extra(rank: int, key: str, value: Any) -> Callable[[list[gpu_check.Result]], None]:
        return lambda results: results[rank]["extra"].update({key: value})

    def judged(name: str, change: Callable[[list[gpu_check.Result]], object]) -> str:
        return _judged(ranks, references, name, change)

    hooked = references["drain mid-step"]["extra"]["rank"]
    assert judged("drain mid-step", extra(hooked, "synced_at", None)) == "FAIL"  # no sync mid-step
    assert judged("drain mid-step", extra(hooked, "drain", None)) == "FAIL"  # the variable unset
    assert judged("drain mid-step", extra(1 - hooked, "synced_at", 2)) == "FAIL"  # the wrong rank synced
    assert judged("drain mid-step", extra(0, "wall", gpu_check._TIMEOUT_S)) == "FAIL"  # past the timeout
    assert judged("predict(dst=)", extra(1, "got", True)) == "FAIL"  # outputs beyond dst
    assert judged("fp16 with GradScaler", extra(1, "scales", [1024.0] * 3)) == "FAIL"  # not backed off alike
    assert judged("tied weight across ranks", lambda res: res[1]["tensors"].pop(gpu_check._TIED)) == "FAIL"
    assert judged("dp=2 with a mesh", lambda res: res[1].update(group=0)) == "FAIL"  # one replica twice


def test_a_row_failed_on_one_rank_is_its_fail_and_the_rest_are_skipped(ranks: list[dict[str, Any]]) -> None:
    broken = [r["broken"] for r in ranks]
    assert broken[0]["boom"][0] == "ok" and broken[1]["boom"] == ("failed", "RuntimeError: boom on rank 1")
    assert all(b["after"] == ("skipped", "after the failed row 'boom'") for b in broken)
    assert gpu_check.feature_rows(broken, CPU, "gloo", features=_BROKEN) == [
        ("gloo boom, 2 ranks", "FAIL", "rank 1: RuntimeError: boom on rank 1"),
        ("gloo after, 2 ranks", "skipped", "after the failed row 'boom'"),
    ]


def test_a_deadline_ends_a_wait_that_nothing_else_can_end() -> None:
    """The drain row's guard: a synchronize stuck behind a peer cannot be interrupted, so past the
    deadline the rank writes its stacks and exits (its launch, or torchrun, then names it)."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from scripts.gpu_check import deadline\n"
        "with deadline(0.3):\n    pass\n"
        "time.sleep(0.6); print('cancelled', flush=True)\n"  # a deadline left in time fires nothing
        "with deadline(0.3):\n    time.sleep(60)\n"
    )
    root = str(SCRIPT.parent.parent)
    proc = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "cancelled\n", proc.stdout + proc.stderr
    assert "Timeout (0:00:00.300000)!" in proc.stderr and 'File "<string>", line 6' in proc.stderr


# ---- the whole script


def _run(command: list[str], env: dict[str, str] | None = None) -> list[str]:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, check=False,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _check_table(lines: list[str], backend: str) -> None:
    skipped = [line for line in lines if "skipped  no CUDA device" in line]
    assert len(skipped) == 8, "\n".join(lines)  # every row that needs CUDA
    ok = [line for line in lines if " ok " in line]
    for name, v, m in gpu_check._configs(2):  # every registered schedule
        for dtype in ("fp32", "bf16"):
            assert any(f"{backend} {name} v={v} m={m} {dtype}:" in line for line in ok), (name, m, dtype)
    for f in gpu_check.FEATURES:
        assert any(line.startswith(f"{backend} {f.name}, 2 ranks") for line in ok), f.name
    assert any("emulation overhead" in line for line in lines)
    assert not [line for line in lines if " FAIL " in line]


@pytest.mark.slow
@pytest.mark.timeout(480)  # 22 schedule configurations and 7 features: 1 to 3 minutes on 2 busy cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the script runs its CUDA checks")
def test_the_check_runs_on_cpu_with_its_cuda_rows_skipped() -> None:
    lines = _run([sys.executable, str(SCRIPT)])
    _check_table(lines, "nccl-emulated")
    assert any(line.startswith("killed rank (nccl-emulated, 2 ranks)") and " ok " in line for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(480)  # 22 schedule configurations and 7 features: 1 to 3 minutes on 2 busy cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the script runs its CUDA checks")
def test_under_torchrun_rank_0_prints_the_table_after_the_world_is_gone() -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)]
    lines = _run(torchrun, {"STAGEWISE_EMULATE_NCCL": "1"})
    assert lines[0].endswith("2 ranks under torchrun, no CUDA device")
    _check_table(lines, "nccl-emulated")
