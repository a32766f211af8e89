"""Failures across ranks: each scenario in a fresh process group, all in one launch of 3 ranks.

A rank that raises, times out or gets bad input fails, and every other rank fails
fast too, naming the rank that failed and what it was waiting for.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from tests.dist import run_ranks
from tests.pipe_common import M


class _Boom(nn.Module):
    """Raises at its ``at``-th call; sleeps ``sleep`` seconds on every call."""

    def __init__(self, at: int = -1, sleep: float = 0.0, grow_at: int = -1) -> None:
        super().__init__()
        self.calls, self.at, self.sleep, self.grow_at = 0, at, sleep, grow_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom in a stage")
        time.sleep(self.sleep)
        if self.grow_at >= 0 and self.calls >= self.grow_at:
            return torch.cat([x, x[:, :1]], dim=1)  # one more feature than at the first step
        return x


def _scenario(kind: str, group: Any) -> tuple[str, str, float]:
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(2 * p)]
    loss_fn: Any = nn.functional.mse_loss
    m, timeout, batch = 4, 20.0, 8
    if kind == "raise":
        layers[2 * (p // 2)] = _Boom(at=3)  # stage p // 2 fails at its third forward
    elif kind == "timeout":
        layers[2 * (p - 1)], timeout = _Boom(), 1.0  # the last stage turns too slow after a good step
    elif kind == "shape":
        layers[1] = _Boom(grow_at=M + 2)  # grows at the second step (the shape inference is call 1)
        loss_fn = lambda out, y: ((out[:, :4] - y) ** 2).mean()  # noqa: E731
    elif kind == "scalar":
        loss_fn = lambda out, y: (out - y) ** 2  # noqa: E731
    elif kind == "disagree":
        m = 4 if rank == 0 else 8
    elif kind == "few-rows":
        batch = 3  # fewer rows than micro-batches
    elif kind == "rows-differ":
        batch = 10  # inputs of 10 rows, targets of 8
    model = nn.Sequential(*layers)
    if kind == "group-size":  # a plan for 2 ranks in a group of 3
        try:
            Pipeline(model[:4], Plan(balance=[2, 2]), loss_fn=loss_fn, group=group)
        except ValueError as exc:
            return "ValueError", str(exc), 0.0
        return "ok", "", 0.0
    pipe = Pipeline(model, [2] * p, schedule="1f1b", n_microbatches=m, loss_fn=loss_fn, group=group,
                    timeout=timeout)  # fmt: skip
    x, y = torch.randn(batch, 4), torch.randn(8, 4)
    bf16 = kind == "autocast" and rank == 0  # autocast on rank 0 only
    if kind == "timeout":  # set up (shapes, first-use costs) before the clock starts: time the wait
        pipe.step(x if rank == 0 else None, y if rank == p - 1 else None)
        for layer in layers:
            if isinstance(layer, _Boom):
                layer.sleep = 3.0
    start = time.monotonic()
    try:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pipe.step(x if rank == 0 else None, None if kind == "targets" or rank != p - 1 else y)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _failures() -> dict[str, list[tuple[str, str, float]]]:
    out = {}
    kinds = (
        "raise",
        "timeout",
        "shape",
        "scalar",
        "disagree",
        "few-rows",
        "rows-differ",
        "targets",
        "autocast",
        "group-size",
    )
    for kind in kinds:
        group = dist.new_group(backend="gloo")
        result = _scenario(kind, group)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)  # on the world group, which stays healthy
        out[kind] = gathered
    return out


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str, float]]]:
    results: dict[str, list[tuple[str, str, float]]] = run_ranks(
        tmp_path_factory.mktemp("fail"), _failures, 3, timeout=60.0
    )[0]
    return results


def test_a_rank_raising_makes_every_rank_fail_fast(failures: dict[str, Any]) -> None:
    (k0, m0, t0), (k1, m1, _), (k2, m2, t2) = failures["raise"]
    assert (k1, m1) == ("RuntimeError", "boom in a stage")
    for kind, msg, elapsed in ((k0, m0, t0), (k2, m2, t2)):
        assert kind == "PeerFailure" and elapsed < 5.0
        assert msg.startswith("rank 1 failed while rank ") and msg.endswith("RuntimeError: boom in a stage")
    assert " waited for 0RECV_B" in m0 and "from rank 1" in m0
    assert m2.startswith("rank 1 failed while rank 2 waited for 2RECV_F")


def test_timeout_names_rank_and_action(failures: dict[str, Any]) -> None:
    results = failures["timeout"]
    # ranks 0 and 1 both wait on the slow last stage, 1 s each: one or both time out (which, and
    # whether both, is scheduling), each naming its own wait; every other rank fails at once naming
    # the timeout that was published first
    own = {r: f"rank {r} timed out after 1.0 s waiting for {r}RECV_B0 from rank {r + 1}" for r in (0, 1)}
    timed_out = {r for r, (k, _, _) in enumerate(results) if k == "PipelineTimeout"}
    assert timed_out and timed_out <= {0, 1}, results
    for r in timed_out:
        assert results[r][1] == own[r] and results[r][2] < 2.0
    for q, (kind, msg, _) in enumerate(results):
        if q not in timed_out:
            assert kind == "PeerFailure", results
            named = [r for r in own if msg.startswith(f"rank {r} failed while rank {q} ")]
            assert named and msg.endswith(own[named[0]]), results


@pytest.mark.parametrize(
    ("kind", "culprit", "error"),
    [
        ("shape", 0, "ValueError: stage 0 produced [2, 5] float32 for micro-batch 0, but stage 1 was set up "
                     "for [2, 4] float32"),
        ("scalar", 2, "ValueError: loss_fn must return a scalar (0-dim) tensor, got (2, 4)"),
        ("few-rows", 0, "ValueError: inputs has 3 rows but n_microbatches is 4"),
        ("rows-differ", 2, "ValueError: the targets have 8 rows but the inputs (on stage 0's rank) 10"),
        ("targets", 2, "ValueError: rank 2 holds the last stage (2) but step() got no targets"),
    ],
)  # fmt: skip
def test_bad_step_input_fails_on_every_rank(
    failures: dict[str, Any], kind: str, culprit: int, error: str
) -> None:
    for rank, (exc, msg, elapsed) in enumerate(failures[kind]):
        assert elapsed < 5.0
        if rank == culprit:
            assert f"{exc}: {msg}".startswith(error)
        else:
            assert exc == "PeerFailure"
            assert msg.startswith(f"rank {culprit} failed while rank {rank} waited for")
            assert error in msg


def test_autocast_that_differs_from_rank_0s_fails_on_every_rank(failures: dict[str, Any]) -> None:
    # every other rank reads rank 0's header in the store, so each finds the difference itself;
    # one that learns of another's first names that one
    own = ("runs the step with autocast off on cpu but rank 0 with autocast(bfloat16) on cpu; wrap the "
           "step in the same torch.autocast (or none) on every rank")  # fmt: skip
    results = failures["autocast"]
    assert results[0][0] == "PeerFailure"
    for rank, (exc, msg, elapsed) in enumerate(results):
        assert elapsed < 5.0
        if exc == "ValueError":
            assert rank > 0 and msg == f"rank {rank} {own}"
            continue
        assert exc == "PeerFailure"
        culprit = int(msg.split()[1])  # "rank q failed while rank r waited for ..."
        assert culprit > 0 and msg.startswith(f"rank {culprit} failed while rank {rank} waited for")
        assert f"ValueError: rank {culprit} {own}" in msg


def test_ranks_that_disagree_fail_at_the_first_step(failures: dict[str, Any]) -> None:
    # a rank that reads every configuration raises the ValueError itself; one still waiting for
    # a slower rank's configuration may see the first rank's published ValueError instead
    results = failures["disagree"]
    assert any(exc == "ValueError" for exc, _, _ in results)
    for exc, msg, elapsed in results:
        assert exc in ("ValueError", "PeerFailure") and elapsed < 5.0
        assert "ranks disagree about the pipeline: rank " in msg
        assert "m=4" in msg and "m=8" in msg and "same schedule, n_microbatches and balance" in msg


def test_a_plan_for_other_ranks_than_the_group_names_both(failures: dict[str, Any]) -> None:
    for exc, msg, _ in failures["group-size"]:
        assert exc == "ValueError"
        assert msg.startswith("the plan is for 2 ranks (2 stages, n_virtual 1) but the process group has 3; ")
        assert "partition(model, 3, ...)" in msg
