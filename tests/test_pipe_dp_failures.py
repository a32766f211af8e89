"""Replicated pipelines that cannot run, or fail: a clear error on every rank, within seconds.

One launch of 4 ranks (dp = 2 x 2 pipeline ranks) runs every scenario, each on a fresh mesh; a killed
replica is its own launch.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipeline.launch import RankError
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks

P = 2


class _Boom(nn.Module):
    """A Linear that raises at its ``at``-th call, ``delay`` seconds late (or kills its process,
    leaving the time in ``note``)."""

    def __init__(self, at: int, note: str = "", delay: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)  # the replicas' state has the same sizes
        self.calls, self.at, self.note, self.delay = 0, at, note, delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            if self.note:
                Path(self.note).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.delay)
            raise RuntimeError("boom in a replica")
        return self.linear(x)


def _model(replica: int, kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(4)]
    if kind == "raise" and replica == 1:
        # replica 1's stage 1 (global rank 3) fails at its third forward, late enough that replica 0 has
        # finished its pipeline and waits for replica 1 in the data-parallel collectives (raising at
        # once, a loaded host sometimes caught replica 0 still inside its own pipeline)
        layers[2] = _Boom(at=3, delay=1.0)
    return nn.Sequential(*layers)


def _build(kind: str) -> Pipeline:
    g = dist.get_rank()
    replica = g // P
    plan = Plan(balance=[2, 2], n_microbatches=4, dp=2)
    mesh = init_device_mesh("cpu", (2, P), mesh_dim_names=("dp", "pp"))  # fresh groups per scenario
    model = _model(replica, kind)
    if kind == "world-indivisible":
        return Pipeline(model[:3], Plan(balance=[1, 1, 1], dp=2), loss_fn=nn.functional.mse_loss)
    if kind == "world-size":
        return Pipeline(model, plan.replace(dp=3), loss_fn=nn.functional.mse_loss)
    if kind == "mesh-names":
        mesh = init_device_mesh("cpu", (2, P), mesh_dim_names=("data", "pipe"))
    if kind == "mesh-size":
        return Pipeline(model, Plan(balance=[1, 1, 1, 1], dp=1), loss_fn=nn.functional.mse_loss, mesh=mesh)
    if kind == "group":
        return Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=mesh.get_group("pp"))
    if kind == "balance" and replica == 1:
        plan = plan.replace(balance=[3, 1])
    if kind == "schedule" and replica == 1:
        plan = plan.replace(schedule="gpipe")
    return Pipeline(model, plan, loss_fn=nn.functional.mse_loss, mesh=mesh, timeout=20.0)


def _scenario(kind: str) -> tuple[str, str, float]:
    replica = dist.get_rank() // P
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    if kind == "short" and replica == 1:
        x = x[:3]  # 3 rows for 4 micro-batches, on replica 1's stage 0 (global rank 2)
    start = time.monotonic()
    try:
        pipe = _build(kind)
        for _ in range(2):
            pipe.step(x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


KINDS = ("world-indivisible", "world-size", "mesh-names", "mesh-size", "group", "balance", "schedule",
         "short", "raise")  # fmt: skip


def _all() -> dict[str, list[tuple[str, str, float]]]:
    out = {}
    for kind in KINDS:
        result = _scenario(kind)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)  # on the world group, which stays healthy
        out[kind] = gathered
    return out


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str, float]]]:
    results: dict[str, Any] = run_ranks(tmp_path_factory.mktemp("dpfail"), _all, 2 * P, timeout=120.0)[0]
    return results


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("world-indivisible", "the world has 4 ranks, not a multiple of the plan's 3 ranks per pipeline"),
        ("world-size", "the plan is for dp=3 replicas of 2 ranks (6 ranks) but the world has 4; make the "
                       "plan with dp=2 (plan.replace(dp=2)) or start 6 ranks"),
        ("mesh-names", "mesh has dims ('data', 'pipe') of sizes (2, 2), but a Pipeline needs exactly two "
                       "named 'dp' (replicas) and 'pp'"),
        ("mesh-size", "mesh has dp=2, pp=2 but the plan is for dp=1 replicas of 4 ranks"),
        ("group", "group= and replicas do not mix"),
    ],
)  # fmt: skip
def test_a_world_or_mesh_that_does_not_fit_fails_at_construction(
    failures: dict[str, Any], kind: str, error: str
) -> None:
    for exc, msg, elapsed in failures[kind]:
        assert exc == "ValueError" and msg.startswith(error) and elapsed < 5.0, (exc, msg)


@pytest.mark.parametrize(("kind", "differs"), [("balance", "balance=[3, 1]"), ("schedule", "0F0 0F1")])
def test_replicas_built_from_different_plans_fail_at_construction(
    failures: dict[str, Any], kind: str, differs: str
) -> None:
    # before any collective could mismatch; a rank still waiting for a peer's configuration may see the
    # first rank's published ValueError instead
    results = failures[kind]
    assert any(exc == "ValueError" for exc, _, _ in results)
    for exc, msg, elapsed in results:
        assert exc in ("ValueError", "PeerFailure") and elapsed < 5.0, (exc, msg)
        assert "replicas disagree about the pipeline: rank " in msg and " (replica 1) has " in msg
        assert differs in msg and "from the same model and Plan (and bucket_mb)" in msg


def test_a_replica_s_bad_batch_is_named_on_every_rank(failures: dict[str, Any]) -> None:
    error = "ValueError: inputs has 3 rows but n_microbatches is 4"
    for g, (exc, msg, elapsed) in enumerate(failures["short"]):
        assert elapsed < 5.0
        if g == 2:
            assert f"{exc}: {msg}".startswith(error)
        else:
            assert exc == "PeerFailure" and msg.startswith(f"rank 2 failed while rank {g} waited for ")
            assert error in msg


def test_a_replica_that_raises_mid_step_is_named_on_every_rank_within_seconds(
    failures: dict[str, Any],
) -> None:
    for g, (exc, msg, elapsed) in enumerate(failures["raise"]):
        assert elapsed < 5.0, (g, elapsed)
        if g == 3:
            assert (exc, msg) == ("RuntimeError", "boom in a replica")
        else:  # replica 0's ranks wait for replica 1 in the gradient all-reduce or the loss's
            assert exc == "PeerFailure" and msg.startswith(f"rank 3 failed while rank {g} waited for ")
            assert msg.endswith("RuntimeError: boom in a replica")
    (_, m0, _), (_, m1, _) = failures["raise"][:2]
    assert "over replicas [0, 2]" in m0 and "over replicas [1, 3]" in m1, (m0, m1)


def _killed(folder: str) -> None:
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    replica = dist.get_rank() // P
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(4)]
    if replica == 1:  # global rank 3 dies in the second step: shape inference, 4 forwards, then 2
        layers[2] = _Boom(at=7, note=str(Path(folder, "killed_at")))
    pipe = Pipeline(nn.Sequential(*layers), Plan(balance=[2, 2], n_microbatches=4, dp=2),
                    loss_fn=nn.functional.mse_loss, timeout=30.0)  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    # the launcher stops the survivors (SIGTERM) once it sees rank 3 gone: each runs on until it has
    # written what it raised (the launcher SIGKILLs it 2 s later at the latest)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        for _ in range(3):
            pipe.step(x, y)
    except Exception as exc:
        Path(folder, f"error{dist.get_rank()}").write_text(f"{type(exc).__name__}: {exc}")
        raise


def test_a_killed_replica_is_named_within_seconds_and_leaves_no_process(tmp_path: Path) -> None:
    with pytest.raises(RankError, match=r"rank 3 exited with code -9") as info:
        run_ranks(tmp_path, _killed, 2 * P, str(tmp_path), timeout=60.0)
    assert info.value.rank == 3
    killed_at = float((tmp_path / "killed_at").read_text())
    assert time.time() - killed_at < 5.0  # the pipeline's timeout: 30 s
    # every survivor names rank 3 by its global rank (in its pipeline group it is rank 1) and says that
    # its process is gone, not a bare lost connection, whichever group it waited in
    gone = f"rank 3's process (pid {int((tmp_path / 'pid3').read_text())}) is gone: it was killed"
    for g in range(2 * P - 1):
        error = tmp_path / f"error{g}"
        assert error.exists(), f"rank {g} raised nothing before the launcher stopped it"
        msg = error.read_text()
        assert msg.startswith(f"PeerFailure: rank 3 failed while rank {g} waited for "), (g, msg)
        assert gone in msg and error.stat().st_mtime - killed_at < 5.0, (g, msg)
    for g in range(2 * P):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid{g}").read_text()), 0)
