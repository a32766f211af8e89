"""The error when a module cannot be traced: where each tracer stopped, and the two ways out.

    cannot trace Net into a graph to split: torch.export stopped at net.py:12 in forward:
    `if y.sum() > 0:` (GuardOnDataDependentSymNode: ...), and torch.fx.symbolic_trace stopped at
    net.py:12 in forward: `if y.sum() > 0:` (TraceError: ...). Two ways out: ...

A module that is a transformers model (its forward returns a ModelOutput holding a Cache), or whose
output export finds a non-tensor in, gets another error: a pipeline passes tensors between stages,
so wrap it (``pipeline.reference.hf.CausalLM(hf_model)``, whose forward returns the logits).

The place is the user's frame: the last frame of the error's traceback outside torch and this
package, or, when export reports it only in its message ("File ..., line N, in fn"), that.
"""

from __future__ import annotations

import os
import re
import traceback

import torch
from torch import nn

__all__ = ["untraceable"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_PIPELINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def untraceable(module: nn.Module, export_error: BaseException | None, fx_error: BaseException) -> str:
    assert export_error is not None
    kind = type(module).__name__
    unwrapped = _not_tensors(module, export_error, fx_error)
    if unwrapped is not None:
        return (
            f"cannot trace {kind} into a graph to split: {unwrapped}. A pipeline passes tensors between "
            "stages, and the last stage's output (what the loss reads) must be a tensor or a tuple of "
            "them: wrap the model so that its forward takes and returns tensors, e.g. for a transformers "
            "causal LM `from pipeline.reference.hf import CausalLM; model = CausalLM(hf_model)` (its "
            "forward(ids, mask=None) returns the model's .logits), and partition that"
        )
    return (
        f"cannot trace {kind} into a graph to split: torch.export stopped {_where(export_error)}, and "
        f"torch.fx.symbolic_trace stopped {_where(fx_error)}. Two ways out: pass an nn.Sequential of the "
        "model's layers (in the order they run), or change that code so torch.export can trace it (a "
        "branch on tensor data becomes torch.where or torch.cond; shapes must not depend on the data)"
    )


def _not_tensors(module: nn.Module, export_error: BaseException, fx_error: BaseException) -> str | None:
    """Why ``module`` is not a model of tensors in and out, where it is a transformers model (whose
    forward returns a ModelOutput, with a Cache in it) or export found a non-tensor in its output."""
    found = _OUTPUT_TYPE.search(f"{export_error}\n{fx_error}")
    output = found.group(1).rsplit(".", 1)[-1] if found else None
    mro = type(module).__mro__
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in mro):
        held = f", holding a {output}" if output else ""
        return (
            f"it is a transformers model, whose forward returns a ModelOutput (a dict of outputs{held}), "
            "not tensors"
        )
    if output is not None:
        return f"its forward returns a {output}, which is not a tensor (torch.export found it in the output)"
    return None


_OUTPUT_TYPE = re.compile(r"Found <class '([\w.]+)'> in output")


def _where(error: BaseException) -> str:
    """``at file:line in fn: `code` (ErrorType: first line)`` for the user's frame that raised."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_PIPELINE_DIR)
    ]
    head = str(error).strip().splitlines()[0] if str(error).strip() else ""
    summary = f"({type(error).__name__}: {head[:200]})"
    if not frames:
        found = _frame_in_message(str(error))
        return f"{found} {summary}" if found else summary
    f = frames[-1]
    return f"at {os.path.basename(f.filename)}:{f.lineno} in {f.name}: `{(f.line or '').strip()}` {summary}"


def _frame_in_message(text: str) -> str:
    """export names the user's line in its message ("File ..., line N, in fn" and the code)."""
    lines = text.splitlines()
    for j in range(len(lines) - 1, -1, -1):
        line = lines[j].strip()
        if line.startswith('File "') and ", line " in line:
            path = line.split('"')[1]
            rest = line.split(", line ", 1)[1]
            lineno, _, fn = rest.partition(", in ")
            code = lines[j + 1].strip() if j + 1 < len(lines) else ""
            if not path.startswith(_TORCH_DIR):
                return f"at {os.path.basename(path)}:{lineno} in {fn}: `{code}`"
    return ""
