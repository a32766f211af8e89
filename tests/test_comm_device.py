"""One communication device: factories, the guard before the backend, dtypes, clamped timeouts.

Plain gloo must pass the same device rules as the NCCL emulation: a whole step
and evaluation run with the default device set to meta (so any runtime
allocation without an explicit device would be refused), and equal one process.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.executor import Executor
from pipeline.schedules.schedule import schedule
from tests.dist import job


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _build() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x = mlp(width=8, depth=4, batch_size=8)
    return model, x, torch.randn(8, 8)


def _gloo_checks() -> dict[str, Any]:
    rank, out = dist.get_rank(), {}
    comm = Comm(None, "t", timeout=10.0)
    out["device"] = (comm.device, comm.nccl, comm.backend, comm.empty((2,), torch.int64).device)
    peer = 1 - rank
    meta = torch.empty(3, device="meta")
    out["meta"] = _error(lambda: comm.post([([meta], peer)], [], "0SEND_F1 to rank 1"))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))
    out["fake"] = _error(lambda: comm.post([], [([fake], peer)], "0RECV_B1 from rank 1"))
    out["stages"] = _error(
        lambda: Executor(schedule("1f1b", 2, 2), rank, {}, comm, torch.device("meta"), "x")
    )
    # a whole step and evaluation with the default device set to meta: nothing relies on it
    model, x, y = _build()
    pipe = Pipeline(model, Plan(balance=[2, 2], n_microbatches=4), loss_fn=nn.functional.mse_loss)
    with torch.device("meta"):
        loss = pipe.step(x, y)
        ev = pipe.evaluate(x, y)
    out["meta step"] = (loss, ev, {k: t.grad.clone() for k, t in pipe.named_parameters()})
    # a pipeline timeout at or above the process group's is clamped below it, and says so
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    short = Comm(group, "short", timeout=300.0)
    out["clamped"] = short.timeout
    if rank == 0:
        (works,) = short.post([], [([short.empty((1,), torch.float32)], 1)], "0RECV_F9 from rank 1")
        out["clamp"] = _error(lambda: short.order(works, None, "0RECV_F9 from rank 1"))
    dist.barrier()  # rank 1 stays until rank 0 has timed out
    return out


_GLOO_CHECKS = job(2, _gloo_checks, timeout=60.0, batch="b")


def test_gloo_refuses_foreign_tensors_and_runs_a_step_under_a_meta_default(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _GLOO_CHECKS.results(tmp_path_factory)
    r0 = results[0]
    cpu = torch.device("cpu")
    assert r0["device"] == (cpu, False, "gloo", cpu)
    assert r0["meta"] == (
        "ValueError: rank 0: 0SEND_F1 to rank 1 was handed a tensor on meta ([3] float32), but this "
        "pipeline's gloo communication runs on cpu; it was made without an explicit device while the "
        "default device was meta (the NCCL emulation runs each step so, to catch such tensors as NCCL "
        "catches CPU ones): pass device= to the factory"
    )
    assert r0["fake"].startswith("ValueError: rank 0: 0RECV_B1 from rank 1 was handed a fake tensor ([2] ")
    assert r0["stages"].startswith(
        "ValueError: rank 0's stages are on meta but its gloo communication runs on cpu"
    )
    model, x, y = _build()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    loss_ref = float(loss.detach())
    with torch.no_grad():
        ev_ref = float(torch.stack([nn.functional.mse_loss(model(a), b) for a, b in
                                    zip(x.chunk(4), y.chunk(4), strict=True)]).mean())  # fmt: skip
    grads = {k: g for r in results for k, g in r["meta step"][2].items()}
    for k, p in model.named_parameters():
        assert p.grad is not None
        assert float((grads[k] - p.grad).abs().max() / p.grad.abs().max()) < 1e-5, k
    for r in results:
        step_loss, ev, _ = r["meta step"]
        assert abs(step_loss - loss_ref) < 1e-5 * loss_ref and abs(ev - ev_ref) < 1e-5 * ev_ref
        assert abs(r["clamped"] - 1.8) < 1e-9
    assert r0["clamp"] == (
        "PipelineTimeout: rank 0 timed out after 1.8 s (the pipeline's timeout of 300 s, clamped to 90% of "
        "the process group's 2 s so that it fires first) waiting for 0RECV_F9 from rank 1"
    )


class _Ids(nn.Module):
    """Passes an int16 tensor to the next stage, which NCCL cannot send."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.zeros(x.shape[0], dtype=torch.int16, device=x.device)


class _Drop(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0]


def _int16_under_emulation() -> str:
    model = nn.Sequential(nn.Linear(4, 4), _Ids(), _Drop(), nn.Linear(4, 4))
    pipe = Pipeline(model, Plan(balance=[2, 2], n_microbatches=2), loss_fn=nn.functional.mse_loss)
    return _error(lambda: pipe.step(torch.randn(4, 4), torch.randn(4, 4)))


# last in its launch: the refused step fails the world group's pipeline (and its channels)
_INT16 = job(2, _int16_under_emulation, timeout=60.0, backend="nccl-emulated", batch="b", last=True)


def test_a_dtype_nccl_cannot_send_is_refused_at_the_first_step(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    r0, r1 = _INT16.results(tmp_path_factory)
    assert r0 == (
        "ValueError: stage 0's outputs for stage 1 include a int16 tensor, which NCCL cannot send; "
        "convert it in the model (e.g. .to(torch.int32)) to one of ['bfloat16', 'bool', 'float16', "
        "'float32', 'float64', 'int32', 'int64', 'int8', 'uint8']"
    )
    assert r1 == r0  # the receiving rank refuses it too, before posting a buffer
