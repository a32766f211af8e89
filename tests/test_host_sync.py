"""The step's one host synchronisation is where the library says (``pipeline.runtime.step.steps.HOST_SYNC``).

scripts/gpu_check.py runs a step on a GPU under ``torch.cuda.set_sync_debug_mode`` and allows one
sync, at the site ``HOST_SYNC`` names (``host_sync_site()``: its function and line). Here, on CPU:
the named line is in the named function and reads the loss; a step's host reads, recorded
(tests/host_reads.py) and classified by gpu_check's own ``sync_site``, are exactly one, at that site;
a site named wrong, or a read added elsewhere, is caught.
"""

from __future__ import annotations

import ast
import inspect
import linecache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step import steps
from pipeline.runtime.step.steps import HOST_SYNC, StepRunner, host_sync_site
from scripts import gpu_check
from tests.host_reads import host_reads


def _pipe(schedule: str, v: int, model: nn.Sequential | None = None) -> tuple[Pipeline, Any, Any]:
    torch.manual_seed(0)
    built, x = gpt(vocab_size=16, width=16, n_layers=2, n_heads=2, max_seq_len=8, batch_size=8)
    model = model if model is not None else built
    balance = [len(model) - len(model) // 2, len(model) // 2] if v == 2 else [len(model)]
    plan = Plan(balance=balance, schedule=schedule, n_microbatches=4, n_virtual=v)
    return Pipeline(model, plan, loss_fn=gpt_loss), x, torch.randint(0, 16, x.shape)


def _classified(fn: Any) -> list[tuple[bool, str]]:
    """Every host read of ``fn()``, as gpu_check classifies a sync: (at the allowed site, where)."""
    return [gpu_check.sync_site(stack, host_sync_site()) for stack in host_reads(fn)]


def test_the_named_line_is_in_the_named_function_and_reads_the_loss() -> None:
    file, line = host_sync_site()
    lines, first = inspect.getsourcelines(StepRunner.finish)
    assert Path(file).resolve() == Path(inspect.getsourcefile(StepRunner)).resolve()  # type: ignore[arg-type]
    assert first <= line < first + len(lines), "HOST_SYNC's line lies outside its function"
    code = linecache.getline(file, line).strip()
    assert code.split("#")[0].strip() == HOST_SYNC[1]
    node = ast.parse(code).body[0]  # a read: the loss, a tensor, made a Python float
    assert isinstance(node, ast.Return) and isinstance(node.value, ast.Call)
    assert isinstance(node.value.func, ast.Name) and node.value.func.id == "float"


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_a_step_reads_the_device_once_at_the_named_site(schedule: str, v: int) -> None:
    pipe, x, y = _pipe(schedule, v)
    pipe.step(x, y)  # the first step sets up (shapes, buffers) once
    assert [ok for ok, _ in _classified(lambda: pipe.step(x, y))] == [True]
    assert [ok for ok, _ in _classified(lambda: pipe.evaluate(x, y))] == [True]  # finish ends it too


def test_a_site_named_wrong_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, x, y = _pipe("1f1b", 1)
    pipe.step(x, y)
    # another line of the same function: found there, but not where the step reads
    monkeypatch.setattr(steps, "HOST_SYNC", ("StepRunner.finish", "loss = pair[0] if mean is None else mean"))
    assert [ok for ok, _ in _classified(lambda: pipe.step(x, y))] == [False]
    monkeypatch.setattr(steps, "HOST_SYNC", ("StepRunner.finish", "return float(pair[0])"))  # no such line
    with pytest.raises(RuntimeError, match=r"HOST_SYNC names the line 'return float\(pair\[0\]\)' in "
                       r"StepRunner\.finish, which has it 0 times"):  # fmt: skip
        host_sync_site()


class _Reads(nn.Module):
    """A layer that reads its input on the host, as a stray ``.item()`` in the runtime would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.abs().max() > -1)


def test_a_read_elsewhere_in_the_step_is_named() -> None:
    torch.manual_seed(0)
    model, x = gpt(vocab_size=16, width=16, n_layers=2, n_heads=2, max_seq_len=8, batch_size=8)
    model = nn.Sequential(*model[:2], _Reads(), *model[2:])
    pipe, _, y = _pipe("1f1b", 1, model)
    pipe.step(x, y)
    found = _classified(lambda: pipe.step(x, y))
    assert sorted(ok for ok, _ in found) == [False] * 4 + [True]  # one per micro-batch, and the loss's
    assert {where for ok, where in found if not ok} == {next(w for ok, w in found if not ok)}
    assert next(w for ok, w in found if not ok).startswith("stage.py:")  # where the runtime calls the layer


def test_a_sync_off_the_library_s_frames_is_not_allowed() -> None:
    import traceback

    stack = traceback.StackSummary.from_list([("/elsewhere/x.py", 3, "f", "float(t)")])
    assert gpu_check.sync_site(stack, host_sync_site()) == (False, "outside the library's frames")
