"""Training and evaluation in a traced stage: the calls that behave differently read the stage's flag.

Tracing runs the model in training mode and writes that mode into the calls that depend on it
(``aten.dropout(x, p, True)``, ``aten.batch_norm(..., training=True, ...)``) and into batch
norm's step counter (``num_batches_tracked.add_(1)``). ``follow_mode`` makes each read the
stage's own ``training`` attribute instead (a ``get_attr`` of it), and the counter move only in
training, so ``stage.eval()`` evaluates as the model would. Other code that reads
``self.training`` in a ``forward`` is traced as in training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["count_batch", "follow_mode"]

_aten = torch.ops.aten
# calls whose behaviour differs between training and evaluation: the position of their flag
_MODE_ARG = {
    _aten.dropout.default: 2,
    _aten.feature_dropout.default: 2,
    _aten.alpha_dropout.default: 2,
    _aten.feature_alpha_dropout.default: 2,
    _aten.batch_norm.default: 5,
}


def follow_mode(g: fx.Graph) -> None:
    """Dropout and batch norm read the stage's ``training`` flag (tracing wrote True into them), and
    batch norm's step counter moves only in training, so ``stage.eval()`` evaluates as the model would."""
    flag: fx.Node | None = None
    for node in list(g.nodes):
        at = _MODE_ARG.get(node.target)  # type: ignore[call-overload]
        counter = (
            node.target is _aten.add_.Tensor
            and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "get_attr"
            and str(node.args[0].target).endswith("num_batches_tracked")
        )
        if at is None and not counter:
            continue
        if flag is None:
            with g.inserting_after(next(iter(g.nodes))):  # right after the placeholder
                flag = g.get_attr("training")
        if at is not None and len(node.args) > at:
            node.args = (*node.args[:at], flag, *node.args[at + 1 :])
        elif counter:
            node.target = count_batch
            node.args = (node.args[0], node.args[1], flag)


def count_batch(counter: torch.Tensor, step: Any, training: bool) -> torch.Tensor:
    """Batch norm's ``num_batches_tracked += 1``, in training only (as ``nn.BatchNorm`` does)."""
    return counter.add_(step) if training else counter
