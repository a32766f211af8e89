"""Shape rules: a stage's output signature as a function of its input's rows and length, traced once.

    # s: stage, r: rows (dim 0), L: length (dim 1)

A variable-length run (varlen.py) meets a new micro-batch shape (r, L) nearly every step. Deriving
each stage's signatures for it with fake tensors costs about 40 ms per stage and one store round
trip per stage boundary; per step that is most of a small model's step. Instead each stage is traced
once with symbolic sizes (torch's ``ShapeEnv``: dims 0 and 1 of every input tensor are symbols),
which gives its outputs' shapes as expressions of those symbols and the guards under which they
hold (a ``Linear`` keeps them, an ``Embedding``'s table bounds L)::

    stage 1 traced at (4, 100, 64) float32  ->  output (s0, s1, 64) float32  if  s1 <= 512 and ...
    a new input (3, 57, 64)                 ->  guards hold, dims 2.. equal 64 -> (3, 57, 64)

Every rank publishes its stages' rules through the store once and reads the others', so each
rank can run the whole chain for a new shape on its own: the same rules and the same inputs give
every rank the same answer, including "no rule applies" (a guard fails: a length past a table,
rows of 1, which tracing specialises), where all of them fall back to the fake-tensor derivation
together. A wrong rule could never pass silently: each send is checked against its signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime.inputs.microbatch import Signature, as_tuple, from_tuple

__all__ = ["ShapeRule", "apply_chain", "trace_rule"]

_DYNAMIC_DIMS = 2  # rows and length: what changes between a variable-length run's micro-batches


@dataclass(frozen=True)
class ShapeRule:
    """A stage's output signature for any input that matches ``inputs`` and passes ``guards``."""

    # per input tensor: its dtype and its dims, None where the dim is a symbol
    inputs: tuple[tuple[torch.dtype, tuple[int | None, ...]], ...]
    symbols: tuple[tuple[str, int, int], ...]  # (name, input tensor, dim) of each symbol
    guards: str | None  # a Python expression over the inputs (torch's produce_guards_expression)
    outputs: tuple[tuple[torch.dtype, tuple[str, ...]], ...]  # per output: dtype, dims as expressions

    def apply(self, sig: Signature) -> Signature | None:
        """The output signature for input ``sig``; None where the rule does not cover it."""
        if len(sig) != len(self.inputs):
            return None
        for (shape, dtype), (want_dtype, dims) in zip(sig, self.inputs, strict=True):
            if dtype != want_dtype or len(shape) != len(dims):
                return None
            if any(d is not None and d != n for d, n in zip(dims, shape, strict=True)):
                return None
        if self.guards is not None:
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in sig]
            if not ShapeEnv().evaluate_guards_expression(self.guards, metas):
                return None
        values = {name: sig[t][0][d] for name, t, d in self.symbols}
        return tuple((tuple(_evaluate(e, values) for e in dims), dtype) for dtype, dims in self.outputs)


def _evaluate(expr: str, values: dict[str, int]) -> int:
    if expr.lstrip("-").isdigit():
        return int(expr)
    if expr in values:
        return values[expr]
    import sympy

    return int(sympy.sympify(expr).xreplace({sympy.Symbol(k): v for k, v in values.items()}))


def trace_rule(module: torch.nn.Module, sig: Signature, device: torch.device) -> ShapeRule | None:
    """Trace ``module`` once on input ``sig`` with symbolic rows and lengths (see the module
    docstring), under the caller's autocast; None when nothing is symbolic (a dim of 0 or 1,
    which tracing specialises) or the trace fails. Buffers are restored (a fake forward still bumps
    counters such as BatchNorm's), and autocast's cast cache is off, as ``StageRuntime.infer``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv(duck_shape=False)  # rows and length stay two symbols even when equal
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        real = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in sig]
        with mode, torch.no_grad():
            fake = []
            for t in real:
                dynamic = [
                    DimDynamic.DYNAMIC if d < _DYNAMIC_DIMS else DimDynamic.STATIC for d in range(t.dim())
                ]
                context: Any = StatelessSymbolicContext(dynamic_sizes=dynamic)  # type: ignore[arg-type]
                fake.append(mode.from_tensor(t, symbolic_context=context))
            out = module(from_tuple(fake, len(fake) > 1))
        guards = env.produce_guards_expression(fake)
    except Exception:  # a stage that cannot be traced symbolically is derived per shape, as before
        return None
    finally:
        torch.set_autocast_cache_enabled(cache)
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
    symbols: list[tuple[str, int, int]] = []
    inputs: list[tuple[torch.dtype, tuple[int | None, ...]]] = []
    for t_index, t in enumerate(fake):
        dims: list[int | None] = []
        for d, n in enumerate(t.shape):
            if isinstance(n, torch.SymInt) and _is_symbol(n):
                symbols.append((str(n.node.expr), t_index, d))
                dims.append(None)
            else:
                dims.append(int(n))
        inputs.append((t.dtype, tuple(dims)))
    if not symbols:
        return None
    outputs = []
    known = {name for name, _, _ in symbols}
    for t in as_tuple(out):
        if not isinstance(t, torch.Tensor):
            return None
        exprs = []
        for n in t.shape:
            if isinstance(n, torch.SymInt):
                if {str(x) for x in n.node.expr.free_symbols} - known:  # a size read off the data
                    return None
                exprs.append(str(n.node.expr))
            else:
                exprs.append(str(int(n)))
        outputs.append((t.dtype, tuple(exprs)))
    return ShapeRule(tuple(inputs), tuple(symbols), guards, tuple(outputs))


def _is_symbol(n: torch.SymInt) -> bool:
    import sympy

    return isinstance(n.node.expr, sympy.Symbol)


def apply_chain(rules: dict[int, ShapeRule], sig: Signature, n_stages: int) -> list[Signature] | None:
    """Every stage's input signature for a micro-batch of signature ``sig`` (stage 0's input), by the
    rules of stages 0 .. n_stages - 2 in order; None where any of them does not apply."""
    chain = [sig]
    for s in range(n_stages - 1):
        rule = rules.get(s)
        out = rule.apply(chain[-1]) if rule is not None else None
        if out is None:
            return None
        chain.append(out)
    return chain
