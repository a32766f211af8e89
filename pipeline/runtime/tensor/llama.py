"""``parallelize_llama``: tensor parallelism for Llama-family blocks (Llama, Mistral, Qwen2, ...).

    # C: width, H: attention heads, K: key/value heads, F: the MLP's width, T: tp

Megatron's split, as torchtitan does it, on the modules of a transformers decoder layer::

    attention   q_proj, k_proj, v_proj   colwise: each tp rank H/T query and K/T key/value heads
                o_proj                   rowwise: partial sums, all-reduced to a replicated (B, T, C)
    MLP         gate_proj, up_proj       colwise: F/T of the hidden units
                down_proj                rowwise: all-reduced

Two all-reduces per block in the forward, two in the backward; norms and embeddings stay
replicated. The heads need no edit: transformers views q/k/v as (B, T, -1, head_dim), so each rank
sees its H/T heads, and the grouped-query ratio H/K is the same on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["parallelize_llama"]

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def parallelize_llama(stage: nn.Module, tp_mesh: Any) -> None:
    """Split every Llama-family attention and MLP of ``stage`` over ``tp_mesh``; ValueError naming the
    module when tp does not divide its heads or widths. A stage without them (the embedding, the
    head) stays whole on every tp rank."""
    tp = int(tp_mesh.size())
    plan: dict[str, Any] = {}
    for name, module in stage.named_modules():
        heads = _heads(module)
        if heads is not None:
            for what, n in heads.items():
                if n % tp:
                    raise ValueError(
                        f"tp={tp} does not divide {name}'s {n} {what}: each tp rank must hold whole heads; "
                        f"make the plan with a tp that divides {n}"
                    )
        for child in _COLWISE + _ROWWISE:
            linear = getattr(module, child, None)
            if isinstance(linear, nn.Linear):
                width = linear.out_features if child in _COLWISE else linear.in_features
                if width % tp:
                    raise ValueError(
                        f"tp={tp} does not divide {name}.{child}'s width {width}; make the plan with a tp "
                        f"that divides {width}"
                    )
                plan[f"{name}.{child}" if name else child] = (
                    ColwiseParallel() if child in _COLWISE else RowwiseParallel()
                )
    if not plan:  # an embedding or a head alone: replicated on the tp ranks, as torchtitan's norms are
        return
    parallelize_module(stage, tp_mesh, plan)


def _heads(module: nn.Module) -> dict[str, int] | None:
    """An attention module's head counts, from its config (None for other modules)."""
    config = getattr(module, "config", None)
    if not hasattr(module, "q_proj") or config is None:
        return None
    heads = int(getattr(config, "num_attention_heads", 0))
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return {"attention heads": heads, "key/value heads": kv}
