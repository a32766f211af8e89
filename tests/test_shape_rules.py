"""``pipeline.runtime.trace.shape_rules``: a stage's output signature from a symbolic trace, checked.

A rule traced once must give, for every (rows, length) it accepts, exactly the signature that a
fake-tensor derivation of that shape gives (``StageRuntime.infer``), and refuse what it does not
cover: a length past an embedding's table, one row (tracing specialises 1), another width or dtype,
a size that depends on the data.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn

from pipeline.reference.models import gpt
from pipeline.runtime.inputs.microbatch import Signature
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace.shape_rules import ShapeRule, apply_chain, trace_rule

CPU = torch.device("cpu")
MAX_LEN, WIDTH = 24, 16


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    model, _ = gpt(vocab_size=16, width=WIDTH, n_layers=2, n_heads=2, max_seq_len=MAX_LEN)
    return [model[:2], model[2:3], model[3:]]  # embedding + block, block, norm + head


def _infer(module: nn.Module, sig: Signature) -> Signature:
    stage = StageRuntime(0, module, n_stages=2, n_microbatches=1, split_backward=False, recompute="never",
                         loss_fn=None, device=CPU)  # fmt: skip
    return stage.infer(sig)


def _sig(rows: int, length: int, *rest: int, dtype: torch.dtype = torch.int64) -> Signature:
    return (((rows, length, *rest), dtype),)


# each stage's trace input: token ids for the embedding, activations after it
HINTS = [_sig(4, 10), _sig(4, 10, WIDTH, dtype=torch.float32), _sig(4, 10, WIDTH, dtype=torch.float32)]


@functools.cache
def _rules() -> dict[int, ShapeRule | None]:
    """Each stage's rule traced on its hint, once for the module: a trace is most of a second of
    CPU, and a rule is plain data that the tests below only apply."""
    return {s: trace_rule(m, HINTS[s], CPU) for s, m in enumerate(_stages())}


def test_a_rule_gives_what_fake_tensors_give_for_every_shape_it_takes() -> None:
    stages = _stages()
    rules = _rules()
    assert all(rule is not None for rule in rules.values())
    rng = random.Random(0)
    for _ in range(12):
        sig = _sig(rng.randint(2, 9), rng.randint(2, MAX_LEN))
        chain = apply_chain(rules, sig, 4)  # type: ignore[arg-type]
        assert chain is not None
        expected = [sig]
        for m in stages:
            expected.append(_infer(m, expected[-1]))
        assert chain == expected, sig


@pytest.mark.parametrize(
    ("sig", "why"),
    [
        (_sig(3, MAX_LEN + 1), "a length past the embedding's table"),
        (_sig(1, 10), "one row: the trace specialised 1"),
        (_sig(3, 1), "a length of 1"),
        (_sig(3, 10, 2), "another rank of tensor"),
        (_sig(3, 10, dtype=torch.int32), "another dtype"),
        ((((3, 10), torch.int64), ((3, 10), torch.int64)), "another number of tensors"),
    ],
)
def test_a_rule_refuses_what_it_does_not_cover(sig: Signature, why: str) -> None:
    rule = _rules()[0]  # traced on _sig(4, 10)
    assert rule is not None
    assert rule.apply(sig) is None, why


def test_a_static_dim_must_match_the_trace() -> None:
    rule = _rules()[1]  # traced on _sig(4, 10, WIDTH, dtype=torch.float32)
    assert rule is not None
    assert rule.apply(_sig(3, 7, WIDTH, dtype=torch.float32)) == _sig(3, 7, WIDTH, dtype=torch.float32)
    assert rule.apply(_sig(3, 7, WIDTH + 1, dtype=torch.float32)) is None


class _Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]  # its length is read off the data


class _Pair(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x
        return torch.cat([a, b], dim=1), a.sum(dim=1)  # (r, L + L'), (r,)


def test_data_dependent_sizes_have_no_rule_and_tuples_do() -> None:
    assert trace_rule(_Nonzero(), _sig(4, 10, dtype=torch.float32), CPU) is None
    sig = (((4, 10), torch.float32), ((4, 6), torch.float32))
    rule = trace_rule(_Pair(), sig, CPU)
    assert rule is not None
    new = (((5, 3), torch.float32), ((5, 8), torch.float32))
    assert rule.apply(new) == _infer(_Pair(), new) == (((5, 11), torch.float32), ((5,), torch.float32))
