"""Recomputation per stage: a plan whose stages recompute differently trains exactly as one process.

Two ranks, one stage recomputing and the other not (both ways round), under 1f1b, zb-h1 (the split
backward replays a recomputed micro-batch's chain) and interleaved-1f1b (four stages, two per rank);
every rank also reports which micro-batches each of its stages recomputed, so a plan whose modes
were dropped (every stage run with one mode) fails here even though its gradients would match.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.recompute import recomputes
from tests.dist import run_ranks
from tests.pipe_common import M, assert_close, balance_of, build, grads_of, reference

# (schedule, v, per-stage modes)
CASES = [
    ("1f1b", 1, ("always", "never")),
    ("1f1b", 1, ("never", "except_last")),
    ("zb-h1", 1, ("always", "never")),
    ("interleaved-1f1b", 2, ("never", "always", "except_last", "never")),
]


def _run(name: str) -> dict[str, Any]:
    """On every rank: per case the loss, local grads and, per local stage, which micro-batches recomputed."""
    p, out = dist.get_world_size(), {}
    for sched, v, modes in CASES:
        model, x, y, loss_fn = build(name)
        plan = Plan(balance=balance_of(len(model), p * v), schedule=sched, n_microbatches=M, recompute=modes)
        pipe = Pipeline(model, plan, loss_fn=loss_fn, timeout=30.0)
        loss = pipe.step(x, y)
        ran = {s: list(st.recomputes) for s, st in pipe.stages.items()}
        out[f"{sched}/{modes}"] = (loss, grads_of(pipe.named_parameters()), ran)
        pipe.close()
    return out


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_per_stage_recompute_matches_one_process(tmp_path: Path, name: str) -> None:
    results = run_ranks(tmp_path, _run, 2, name)
    loss_ref, grads_ref = reference(name)
    for sched, _, modes in CASES:
        key = f"{sched}/{modes}"
        losses = [r[key][0] for r in results]
        assert all(abs(loss - loss_ref) <= 1e-5 * abs(loss_ref) for loss in losses if loss is not None), key
        assert_close({k: g for r in results for k, g in r[key][1].items()}, grads_ref, key)
        ran = {s: flags for r in results for s, flags in r[key][2].items()}
        assert ran == {s: [recomputes(mode, i, M) for i in range(M)] for s, mode in enumerate(modes)}, key


def test_one_rank_plan_with_modes_per_stage() -> None:
    """No process group: two stages on one rank (interleaved), the first recomputing."""
    model, x, y, loss_fn = build("mlp")
    plan = Plan(balance=balance_of(len(model), 2), schedule="interleaved-1f1b", n_microbatches=M,
                recompute=("always", "never"))  # fmt: skip
    pipe = Pipeline(model, plan, loss_fn=loss_fn)
    loss = pipe.step(x, y)
    loss_ref, grads_ref = reference("mlp")
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert_close(grads_of(pipe.named_parameters()), grads_ref, "one rank")
    assert [pipe.stages[s].recomputes for s in (0, 1)] == [[True] * M, [False] * M]


def test_keywords_give_modes_per_stage_and_contradictions_are_refused() -> None:
    model, _, _, loss_fn = build("mlp")
    pipe = Pipeline(model, [4, 4], schedule="interleaved-1f1b", n_microbatches=1, n_virtual=2,
                    recompute=["never", "always"], loss_fn=loss_fn)  # fmt: skip
    assert [pipe.stages[s].recompute for s in (0, 1)] == ["never", "always"]
    plan = Plan(balance=[4, 4], schedule="interleaved-1f1b", n_microbatches=1, recompute=("never", "always"))
    Pipeline(model, plan, recompute=["never", "always"], loss_fn=loss_fn)  # repeats the plan: fine
    with pytest.raises(ValueError, match=r"recompute \('always'\) contradicts the plan's"):
        Pipeline(model, plan, recompute="always", loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"recompute has 3 modes for 2 stages"):
        Pipeline(model, [4, 4], schedule="interleaved-1f1b", n_microbatches=1, n_virtual=2,
                 recompute=["never"] * 3, loss_fn=loss_fn)  # fmt: skip
    assert torch.is_grad_enabled()
