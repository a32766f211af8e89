"""Wrappers that put a Hugging Face transformers model behind a tensor-only ``forward``.

    # B: batch, T: tokens, S: source tokens, V: vocabulary

A pipeline hands tensors from stage to stage and traces the model's ``forward``: a transformers
model returns a ``ModelOutput`` and takes keyword arguments, so users wrap it once::

    model = CausalLM(transformers.LlamaForCausalLM(config))    # (B, T) ids [, (B, T) mask] -> logits
    model = Seq2SeqLM(transformers.BartForConditionalGeneration(config))  # (B, S), (B, T) ids -> logits

Nothing here imports transformers: the wrappers take any module with the transformers call.

A model built on the meta device has no values; ``hf_init(model)`` is the ``init_fn`` that gives a
stage's tensors what transformers gives them (``partition``, ``Pipeline``)::

    init_fn=hf_init(model)                    every tensor: random weights, computed buffers (a fresh
                                              model, e.g. to time layers with)
    init_fn=hf_init(model, pretrained=True)   only what no checkpoint holds: the non-persistent
                                              buffers (rotary inv_freq, Gemma's embed_scale, ...);
                                              the weights are pipe.load_pretrained's to give
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["CausalLM", "Seq2SeqLM", "hf_init", "llama_layers"]


class CausalLM(nn.Module):
    """(B, T) ids [, (B, T) attention mask] -> (B, T, V) logits (an LM head, causal or masked)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits  # type: ignore[no-any-return]


class Seq2SeqLM(nn.Module):
    """An encoder-decoder (BART, T5): (B, S) source ids, (B, T) decoder ids -> (B, T, V) logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, source: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=source, decoder_input_ids=decoder_ids).logits  # type: ignore[no-any-return]


class _Embed(nn.Module):
    """(B, T) ids -> (B, T, C)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # type: ignore[no-any-return]


class _Decoder(nn.Module):
    """One decoder layer, causal, with its rotary embedding made from the positions 0..T-1:
    (B, T, C) -> (B, T, C)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T)
        cos_sin = self.rotary(h, positions)
        return self.layer(h, position_embeddings=cos_sin, attention_mask=None)  # type: ignore[no-any-return]


class _Head(nn.Module):
    """(B, T, C) -> (B, T, V): the final norm and the LM head."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]


def llama_layers(model: nn.Module) -> nn.Sequential:
    """A transformers Llama-family ``*ForCausalLM`` as an ``nn.Sequential`` of its own modules: the
    embedding, one layer per decoder layer, the norm and head; (B, T) ids -> (B, T, V) logits, causal,
    without padding masks. Its layers are called as modules, which tensor parallelism needs
    (``pipeline.parallelize_llama``); the parameters are the model's (nothing is copied)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        raise ValueError(
            f"llama_layers takes a transformers Llama-family *ForCausalLM (model.model.layers, "
            f"model.model.rotary_emb, model.lm_head), got {type(model).__name__}; wrap other models with "
            "CausalLM and let partition() trace them"
        )
    attention = getattr(getattr(inner, "config", None), "_attn_implementation", "sdpa")
    if attention != "sdpa":
        raise ValueError(
            f"llama_layers runs causal attention with no mask, which transformers' {attention!r} attention "
            "does not make causal; build the model with attn_implementation='sdpa'"
        )
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ValueError(
            "llama_layers takes a model whose LM head is its own weight, but this one ties it to the "
            "embedding (config.tie_word_embeddings=True); build it with tie_word_embeddings=False"
        )
    blocks: list[nn.Module] = [_Embed(inner.embed_tokens)]
    blocks += [_Decoder(layer, inner.rotary_emb) for layer in layers]
    blocks.append(_Head(inner.norm, model.get_submodule("lm_head")))
    return nn.Sequential(*blocks)


def hf_init(model: nn.Module, *, pretrained: bool = False) -> Callable[[nn.Module], None]:
    """The ``init_fn`` (for ``partition`` and ``Pipeline``) of a meta-device model that holds
    transformers models: each submodule of a stage gets the ``_init_weights`` of the transformers
    model that holds it, children first, as transformers' own ``initialize_weights`` dispatches,
    so computed buffers equal those of the model built on a real device, bit for bit.

    ``pretrained``: write only the tensors no checkpoint holds (non-persistent buffers), as
    ``from_pretrained`` does (it marks the loaded tensors ``_is_hf_initialized``, which transformers'
    init functions skip); parameters and persistent buffers are left to ``load_pretrained`` (a step
    before it is refused while one that no ``reset_parameters`` wrote has no values).

    A stage holds the model's own modules (``Pipeline``); a profiled layer holds copies of them
    (``partition``), which are matched by class."""
    owners: dict[int, tuple[nn.Module, nn.Module]] = {}  # id -> (a submodule, the transformers model
    by_class: dict[type, nn.Module] = {}  # it is in); a class -> the first such model
    _find_owners(model, None, owners, by_class)
    if not by_class:
        raise ValueError(
            f"hf_init takes a model holding transformers models (modules with _init_weights, such as "
            f"LlamaForCausalLM), got {type(model).__name__}, which holds none; pass an init_fn of your own"
        )

    def init(stage: nn.Module) -> None:
        paths = {id(sub): path for path, sub in stage.named_modules(remove_duplicate=False)}
        with torch.no_grad(), _guarded(), _checkpoint_held(stage, pretrained):
            for sub in _children_first(stage):
                held, owner = owners.get(id(sub), (None, None))
                if held is not sub:  # a copy (or a module not of model): by its class
                    owner = by_class.get(type(sub))
                if owner is not None:
                    owner._init_weights(sub)  # type: ignore[operator]
                elif (stand_in := _stand_in(model, paths.get(id(sub)), sub, owners)) is not None:
                    with contextlib.suppress(AttributeError):  # it reads a tensor the holder lacks:
                        stand_in[1]._init_weights(stand_in[0])  # type: ignore[operator]  # named unset

    return init


def _stand_in(
    model: nn.Module, path: str | None, sub: nn.Module, owners: dict[int, tuple[nn.Module, nn.Module]]
) -> tuple[nn.Module, nn.Module] | None:
    """A stage's bare holder of tensors taken alone from a module (a top model's own buffer, such
    as BART's ``final_logits_bias``: ``trace.traced``) is initialised as that module: a shallow copy
    of the model's module at the same path, holding the holder's tensors and no children, goes
    through its owner's ``_init_weights``, which writes the holder's tensors in place (a tensor it
    replaces instead stays unwritten, and materialising names it)."""
    if path is None or type(sub) is not nn.Module or not (sub._parameters or sub._buffers):
        return None
    try:
        original = model.get_submodule(path)
    except AttributeError:
        return None
    _, owner = owners.get(id(original), (None, None))
    if owner is None or type(original) is nn.Module:
        return None
    shim = copy.copy(original)
    shim._parameters = dict(sub._parameters)
    shim._buffers = dict(sub._buffers)
    shim._modules = {}
    return shim, owner


def _is_hf(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config")


def _find_owners(
    module: nn.Module,
    owner: nn.Module | None,
    owners: dict[int, tuple[nn.Module, nn.Module]],
    by_class: dict[type, nn.Module],
) -> None:
    """The nearest transformers model at or above each submodule (transformers' ``smart_apply``)."""
    if _is_hf(module):
        owner = module
    if owner is not None and id(module) not in owners:
        owners[id(module)] = (module, owner)
        by_class.setdefault(type(module), owner)
    for child in module.children():
        _find_owners(child, owner, owners, by_class)


def _children_first(module: nn.Module) -> list[nn.Module]:
    """Every submodule once, each after its children (``nn.Module.apply``'s order)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out


@contextlib.contextmanager
def _guarded() -> Iterator[None]:
    """torch.nn.init's functions honour ``_is_hf_initialized`` as transformers' own do (its guard)."""
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    with guard() if guard is not None else contextlib.nullcontext():
        yield


_FLAG = "_is_hf_initialized"


@contextlib.contextmanager
def _checkpoint_held(stage: nn.Module, pretrained: bool) -> Iterator[None]:
    """With ``pretrained``, the stage's parameters and persistent buffers (what a checkpoint holds:
    its state dict) carry transformers' flag meanwhile, so that its init functions leave them."""
    held = list(stage.state_dict(keep_vars=True).values()) if pretrained else []
    marked = {id(t): t for t in held if not getattr(t, _FLAG, False)}
    for t in marked.values():
        setattr(t, _FLAG, True)
    try:
        yield
    finally:
        for t in marked.values():
            delattr(t, _FLAG)
