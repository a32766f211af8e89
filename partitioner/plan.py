"""``Plan``: a stage balance with its predictions, a readable table, JSON, and the model split.

# j: stage, i: layer

stage  layers  names        fwd ms  bwd ms   cost  memory MB  sent MB
    0  0-2     0,1,2          1.20    2.40   3.60      12.50     0.52
    1  3-6     3,4,5,6        1.10    2.60   3.70      11.00     0.00
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

__all__ = ["Plan", "StagePlan"]


@dataclass(frozen=True)
class StagePlan:
    """One stage: layers [start, stop), predicted times (s), memory and bytes it sends forward."""

    start: int
    stop: int
    names: list[str]
    forward_time: float
    backward_time: float
    cost: float  # what the balance minimised the max of, in the plan's cost unit
    memory_bytes: float
    sent_bytes: int


@dataclass(frozen=True)
class Plan:
    balance: list[int]
    stages: list[StagePlan]
    bottleneck: float
    step_time: float  # predicted seconds for one step of n_microbatches
    bubble: float
    schedule: str
    n_microbatches: int
    cost: str
    prediction: str = "closed form"  # or "simulator"
    extra: dict[str, Any] = field(default_factory=dict)
    n_virtual: int = 1  # stages per rank: len(balance) // n_virtual ranks

    def split(self, model: nn.Sequential) -> list[nn.Sequential]:
        """The model's own layers in one ``nn.Sequential`` per stage, keyed by their index in the
        model, so stage parameter names are ``"{layer index}.{name}"`` as in the model."""
        n = sum(self.balance)
        if not isinstance(model, nn.Sequential) or len(model) != n:
            got = len(model) if isinstance(model, nn.Sequential) else type(model).__name__
            raise ValueError(
                f"this plan splits an nn.Sequential of {n} layers, got {got}; plan it again for this model"
            )
        keys = list(model._modules)
        return [
            nn.Sequential(OrderedDict((keys[i], model[i]) for i in range(st.start, st.stop)))
            for st in self.stages
        ]

    def predicted_busy(self) -> list[float]:
        """Per rank, the predicted compute seconds of one step: m x (forward + backward) of its stages.

        Stage j runs on rank j % p, with p = len(balance) // n_virtual ranks.
        """
        p = len(self.stages) // self.n_virtual
        per_stage = [self.n_microbatches * (st.forward_time + st.backward_time) for st in self.stages]
        return [sum(per_stage[r::p]) for r in range(p)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["stages"] = [StagePlan(**s) for s in data["stages"]]
        return cls(**data)

    def table(self, title: str = "", reference: float | None = None) -> str:
        """The stage table; with ``reference`` (another plan's bottleneck) adds the ratio to it."""
        unit = {"time": "cost ms", "flops": "GFLOP", "params": "params MB", "uniform": "layers"}[self.cost]
        scale = {"time": 1e3, "flops": 1e-9, "params": 1e-6, "uniform": 1.0}[self.cost]
        cols = ("fwd ms", "bwd ms", unit, "memory MB", "sent MB")
        widths = (8, 8, 10, 10, 8)
        cells = (f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
        head = f"{'stage':>5}  {'layers':<9} " + " ".join(cells)
        lines = [title] if title else []
        lines.append(head)
        for j, st in enumerate(self.stages):
            rng = f"{st.start}-{st.stop - 1}" if st.stop - st.start > 1 else f"{st.start}"
            lines.append(
                f"{j:>5}  {rng:<9} {st.forward_time * 1e3:>8.2f} {st.backward_time * 1e3:>8.2f} "
                f"{st.cost * scale:>10.3f} {st.memory_bytes / 1e6:>10.2f} {st.sent_bytes / 1e6:>8.2f}"
            )
        rel = "" if reference is None or reference == 0 else f" ({self.bottleneck / reference:.3f}x ours)"
        lines.append(
            f"balance {self.balance}  bottleneck {self.bottleneck * scale:.3f}{rel}  "
            f"step {self.step_time * 1e3:.2f} ms  bubble {self.bubble:.3f}  "
            f"[{self.schedule}, m={self.n_microbatches}, {self.prediction}]"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
