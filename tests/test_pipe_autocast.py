"""bf16 autocast around ``step()``, and the lifetime of each Pipeline's communication thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import BATCH, MODELS, M, assert_close, balance_of, build, grads_of, reference


def _autocast_reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process under bf16 autocast, micro-batch by micro-batch like the pipeline: the bf16
    matmuls of the weight gradients round each micro-batch's sum, so a whole-batch run differs
    by bf16 round-off (about 5e-3), while the same micro-batches give the same numbers."""
    model, x, y, loss_fn = build(name)
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for a, b in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = loss_fn(model(a), b)
            (loss * (1.0 / M)).backward()
            losses.append(loss.detach().float())
    return float(torch.stack(losses).mean()), grads_of(model.named_parameters())


def _watchdogs() -> int:
    return sum(t.name == "stagewise-p2p-watchdog" for t in threading.enumerate())


def _settled(expected: int) -> int:
    """The number of watchdog threads once it reaches ``expected`` (threads stop asynchronously)."""
    deadline = time.monotonic() + 5.0
    while _watchdogs() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _watchdogs()


def _autocast_and_threads() -> dict[str, Any]:
    """On 2 ranks: a bf16 autocast step per model, then a plain one; then close / collect the pipes."""
    out: dict[str, Any] = {}
    before = _watchdogs()
    pipes = []
    for name in MODELS:
        model, x, y, loss_fn = build(name)
        pipe = Pipeline(model, balance_of(len(model), 2), schedule="1f1b", n_microbatches=M, loss_fn=loss_fn,
                        timeout=10.0)  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(x, y)
        ex = pipe.runner.describer  # what the step was described as
        micro = ex.micro[0]  # the micro-batches' one signature
        assert len(set(ex.micro)) == 1 and micro[0][0][0] == BATCH // M
        between = ex.out_sig[0][micro] if pipe.rank == 0 else ex.in_sig[1][micro]  # as sent, and as received
        out[f"bf16/{name}"] = (loss, grads_of(pipe.named_parameters()), between)
        for t in pipe.parameters():
            t.grad = None
        out[f"fp32/{name}"] = (pipe.step(x, y), grads_of(pipe.named_parameters()))  # dtypes derived anew
        pipes.append(pipe)
    out["threads"] = [before, _watchdogs()]
    pipes[0].close()
    out["threads"].append(_settled(before + 1))
    try:
        pipes[0].step(*build(MODELS[0])[1:3])
    except RuntimeError as exc:
        out["closed"] = str(exc)
    del pipe, pipes, ex  # the last references: no collection needed (no part of a Pipeline is in a cycle)
    out["threads"].append(_settled(before))
    return out


_AUTOCAST_AND_THREADS = job(2, _autocast_and_threads, timeout=60.0)


@pytest.fixture(scope="module")
def autocast_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _AUTOCAST_AND_THREADS.results(tmp_path_factory)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_step_matches_one_process(autocast_run: list[dict[str, Any]], name: str) -> None:
    loss_ref, grads_ref = _autocast_reference(name)
    loss_fp32, grads_fp32 = reference(name)
    losses = [r[f"bf16/{name}"][0] for r in autocast_run]
    assert all(abs(v - loss_ref) <= 1e-6 * abs(loss_ref) for v in losses), (losses, loss_ref)
    assert abs(losses[0] - loss_fp32) <= 1e-2 * abs(loss_fp32), (losses[0], loss_fp32)  # bf16 round-off
    merged = {k: g for r in autocast_run for k, g in r[f"bf16/{name}"][1].items()}
    assert all(type(g) is torch.Tensor and g.isfinite().all() for g in merged.values())
    assert_close(merged, grads_ref, f"bf16 {name}")
    # the MLP's stages end in a Linear: bf16 between stages; the GPT's in a residual add: fp32
    b = BATCH // M
    shape, dtype = ((b, 8), torch.bfloat16) if name == "mlp" else ((b, 8, 16), torch.float32)
    assert [r[f"bf16/{name}"][2] for r in autocast_run] == [((shape, dtype),)] * 2
    # the next step without autocast re-derives the dtypes between stages: the fp32 result
    assert all(abs(r[f"fp32/{name}"][0] - loss_fp32) <= 1e-6 * abs(loss_fp32) for r in autocast_run)
    assert_close({k: g for r in autocast_run for k, g in r[f"fp32/{name}"][1].items()}, grads_fp32, name)


def test_waiter_thread_stops_at_close_and_collection(autocast_run: list[dict[str, Any]]) -> None:
    for r in autocast_run:
        before = r["threads"][0]
        assert r["threads"] == [before, before + 2, before + 1, before]  # one per Pipeline, then none
        assert "communication was closed (Pipeline.close()); build a new Pipeline" in r["closed"]


def test_bf16_autocast_with_two_stages_on_one_rank() -> None:
    # the stages' shape inference ran in fake mode under the caller's autocast: its cached bf16
    # weight casts were fake, and the real forwards after it gave a 0.0 loss and fake gradients
    loss_ref, grads_ref = _autocast_reference("gpt")
    model, x, y, loss_fn = build("gpt")
    pipe = Pipeline(model, balance_of(len(model), 2), schedule="interleaved-1f1b", n_virtual=2,
                    n_microbatches=M, loss_fn=loss_fn)  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, y)
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    grads = grads_of(pipe.named_parameters())
    assert all(type(g) is torch.Tensor for g in grads.values())
    assert_close(grads, grads_ref, "bf16 on one rank")
