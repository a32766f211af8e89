"""What a step pays beyond its compute, and that paying less changed nothing it computes.

A run of fixed shapes sends its step header as one 16-byte store value (metadata.py); a new shape
mid-run still reaches every rank before it posts a receive (gradients equal one process's); a step
that does not measure memory lists nothing for the meter; hooks bound into the program run around
their action at every step. scripts/bench_overhead.py measures the times.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.memory import ActivationMeter
from pipeline.schedules.actions import Action, Kind
from tests.dist import job

_OPS = ("set", "get", "add", "delete_key")


class _CountingStore:
    """A store that logs each call on a step header key as (op, key, bytes); the rest passes through."""

    def __init__(self, store: Any) -> None:
        self.store, self.log = store, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name not in _OPS:
            return attr

        def logged(key: str, *args: Any) -> Any:
            out = attr(key, *args)
            if "/header" in key:
                size = len(args[0]) if name == "set" else len(out) if name == "get" else 0
                self.log.append((name, key, size))
            return out

        return logged


# (rows, call): steps of 8 rows, an evaluation, a new shape (6 rows), back to 8, and 8 again
_CALLS = ((8, "step"), (8, "step"), (8, "evaluate"), (6, "step"), (8, "step"), (8, "step"))


def _traffic() -> dict[str, Any]:
    """Each call's header traffic on this rank, and the largest relative gradient error of its local
    parameters against one process, per call."""
    p = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(p)])
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, [1] * p, schedule="1f1b", n_microbatches=2, loss_fn=nn.functional.mse_loss,
                    timeout=60.0)  # fmt: skip
    assert pipe.comm is not None
    store = pipe.comm.store = _CountingStore(pipe.comm.store)
    ref_params = dict(ref.named_parameters())
    out: dict[str, Any] = {"traffic": [], "errors": [], "losses": []}
    for k, (rows, call) in enumerate(_CALLS):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)
        store.log.clear()
        for t in (*pipe.parameters(), *ref.parameters()):
            t.grad = None
        expected = nn.functional.mse_loss(ref(x), y)
        if call == "step":
            loss = pipe.step(x, y)
            expected.backward()
            errors = [
                float((t.grad - ref_params[name].grad).abs().max() / ref_params[name].grad.abs().max())
                for name, t in pipe.named_parameters()
            ]
            out["errors"].append(max(errors))
        else:
            loss = pipe.evaluate(x, y)
        out["losses"].append((loss, float(expected)))
        out["traffic"].append(list(store.log))
    dist.barrier()
    keys = [
        f"{pipe.comm.key_prefix}/header{n}{end}" for n in range(1, len(_CALLS) + 1) for end in ("", "/read")
    ]
    out["left"] = [key for key in keys if store.store.check([key])]
    pipe.close()
    return out


_TWO = job(2, _traffic, timeout=60.0)
_THREE = job(3, _traffic, timeout=60.0)


@pytest.mark.parametrize("job_", [_TWO, _THREE], ids=["p2", "p3"])
def test_a_fixed_shape_pays_one_small_header_and_a_new_shape_reaches_every_rank(
    job_: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = job_.results(tmp_path_factory)
    p = len(results)
    repeats = [k for k in range(1, len(_CALLS)) if _CALLS[k][0] == _CALLS[k - 1][0]]
    assert repeats == [1, 2, 5]  # the calls whose shape is the last one's (the evaluation's too)
    for r, res in enumerate(results):
        assert res["left"] == [], r  # the store does not grow with the steps
        assert max(res["errors"]) < 1e-5, (r, res["errors"])  # the new shape's step too
        for loss, expected in res["losses"]:
            assert abs(loss - expected) <= 1e-5 * abs(expected), (r, loss, expected)
        for k, log in enumerate(res["traffic"]):
            key = f"header{k + 1}"
            sizes = [n for op, name, n in log if op == ("set" if r == 0 else "get") and name.endswith(key)]
            if r > 0:  # the reader's bookkeeping: one delete with 2 ranks, a counter with more
                adds = [op for op, _, _ in log if op == "add"]
                assert adds == ([] if p == 2 else ["add"]), (r, k, log)
            if k in repeats:
                assert sizes == [16], (r, k, log)  # one message of two words
            else:
                assert len(sizes) == 1 and sizes[0] > 16, (r, k, log)  # the full header, once
    deletes = [op for res in results for log in res["traffic"][1:2] for op, _, _ in log if op == "delete_key"]
    assert len(deletes) == (1 if p == 2 else 2)  # the key (and with more readers, its counter), once


# ---- in one process


def _pipe() -> tuple[Pipeline, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    pipe = Pipeline(model, [2, 2], schedule="interleaved-1f1b", n_virtual=2, n_microbatches=2,
                    loss_fn=nn.functional.mse_loss)  # fmt: skip
    return pipe, torch.randn(8, 4), torch.randn(8, 4)


def test_a_step_that_does_not_measure_memory_lists_nothing_for_the_meter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed: list[int] = []
    owned = ActivationMeter.owned

    def counting(modules: Any, batches: Any) -> list[torch.Tensor]:
        out = owned(modules, batches)
        listed.append(len(out))
        return out

    monkeypatch.setattr(ActivationMeter, "owned", staticmethod(counting))
    pipe, x, y = _pipe()
    pipe.step(x, y)
    assert listed == [] and pipe.memory_stats()["activations"] is None
    assert all(m.held is None for m in pipe.executor.msgs.values())
    pipe.step(x, y, measure_memory=True)
    # every parameter and bias of the 4 layers, every input and target micro-batch: listed once
    assert listed == [8 + 2 * 2]
    assert pipe.memory_stats()["activations"] > 0
    pipe.step(x, y)
    assert len(listed) == 1


def test_hooks_added_after_construction_run_around_their_action_at_every_step() -> None:
    pipe, x, y = _pipe()
    seen: list[str] = []
    for st in pipe.stages.values():
        for name in ("forward", "backward"):
            original = getattr(st, name)

            def wrapped(
                i: int, *args: Any, _f: Any = original, _n: str = f"{st.index}{name[0].upper()}"
            ) -> Any:
                seen.append(f"{_n}{i}")
                return _f(i, *args)

            setattr(st, name, wrapped)
    a = Action(1, Kind.B, 1)
    pipe.executor.hook(a, lambda: seen.append("before"), lambda: seen.append("after"))
    for _ in range(2):
        seen.clear()
        pipe.step(x, y)
        at = seen.index("1B1")
        assert seen[at - 1 : at + 2] == ["before", "1B1", "after"], seen
        assert seen.count("before") == seen.count("after") == 1
