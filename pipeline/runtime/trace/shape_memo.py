"""Output signatures remembered across Pipelines: each derived once per process for a stage's structure.

    # sig: a stage input's (shape, dtype)s

Deriving a stage's output signature runs its forward on fake tensors (``StageRuntime.infer``): some
40 ms for a small stage, 100 times its real forward, all in torch's Python dispatch. A process
that builds many Pipelines of the same stages (a sweep over schedules, a plan's measurement runs,
a restart in process) would derive the same signatures again each time. The memo keeps them under
a key that holds what the fake forward's result can depend on:

    key = (structure of the stage,  sig,  device,  default device and dtype,  autocast on the device)

    structure:  per submodule (in order): its path, its class and the classes' own attributes (a
                patched method is another function), its instance attributes' values (numbers,
                strings, dtypes, devices, enums, tensors' metadata, containers of them; functions
                and types by identity; ``training`` among them), a GraphModule's generated code
                and the functions it calls; per parameter and buffer: its path, shape, dtype,
                device, layout and requires_grad, and the values of a small integer one on the CPU
                (a forward may read them on the host, as a size).

A module whose result could depend on something else the key does not hold is not memoised (its
key is None), and every call derives again:

    - an attribute of any other type (a config object, a bound method, an open file);
    - a forward hook or pre-hook, on the module or global (it may replace the output);
    - an integer parameter or buffer of more than ``_READ_NUMEL`` values, or off the CPU;
    - a torch function or dispatch mode active around the derivation (but a default device's,
      ``torch.set_default_device``: the key holds the default device).

What the key cannot see: a module-level global or a function's closure that a forward reads and
that changes between two Pipelines, a float tensor's values read on the host. A stale entry is
never a silently wrong transfer: every stage output and input gradient is checked against the
signatures before it is sent (metadata.send_tensors), and the error names ``clear()``. The memo
holds at most ``MEMO_SIZE`` entries, the oldest dropped first.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from pipeline.runtime.inputs.microbatch import Signature

__all__ = ["MEMO_SIZE", "clear", "memoised", "structure_key"]

MEMO_SIZE = 4096
_memo: OrderedDict[Hashable, Signature] = OrderedDict()
_READ_NUMEL = 64  # an integer tensor of at most this many values on the CPU: its values are keyed

# nn.Module's own bookkeeping in a module's __dict__: parameters, buffers and submodules are keyed
# by their metadata below, forward hooks make a module unmemoisable, the rest cannot change a result
_MODULE_STATE = frozenset(vars(nn.Module()))
# a GraphModule's result is its code, the functions the code calls, its submodules and tensors
_GRAPH_STATE = frozenset(vars(fx.GraphModule(nn.Module(), fx.Graph())))
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_SCALARS = (bool, int, float, complex, str, bytes, torch.dtype, torch.layout, enum.Enum)
_CODE = (  # keyed by identity: what they run is fixed (a patched method is another object)
    types.FunctionType, type, property, staticmethod, classmethod, functools.cached_property,
    torch._ops.OpOverload, torch._ops.OpOverloadPacket,
)  # fmt: skip
_CLASS_SKIP = frozenset(
    {"__doc__", "__module__", "__dict__", "__weakref__", "__annotations__", "__qualname__"}
)


def _unbound(f: types.BuiltinFunctionType) -> bool:
    """A function (``torch.relu``, ``F.gelu``), not a method bound to some object's state (``cfg.get``)."""
    return f.__self__ is None or isinstance(f.__self__, types.ModuleType)


class _Unknown(Exception):
    """A value the key cannot hold: the module is not memoised."""


def memoised(
    module: nn.Module, sig: Signature, device: torch.device, derive: Callable[[], Signature]
) -> Signature:
    """``derive()``'s result for ``module`` at ``sig`` on ``device``, from the memo when it holds it."""
    key = _key(module, sig, device)
    if key is None:
        return derive()
    found = _memo.get(key)
    if found is None:
        found = derive()  # a derivation that raises leaves nothing behind
        _memo[key] = found
        if len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    return found


def clear() -> None:
    """Forget every memoised signature."""
    _memo.clear()


def _key(module: nn.Module, sig: Signature, device: torch.device) -> Hashable | None:
    modes = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    if any(not isinstance(m, DeviceContext) for m in modes) or torch._C._len_torch_dispatch_stack() > 0:
        return None  # a mode may change any result; a default device only places factories: keyed
    structure = structure_key(module)
    if structure is None:
        return None
    autocast = torch.is_autocast_enabled(device.type)
    amp = torch.get_autocast_dtype(device.type) if autocast else None
    defaults = str(torch.get_default_device()), torch.get_default_dtype()
    return structure, sig, str(device), defaults, amp


def structure_key(module: nn.Module) -> Hashable | None:
    """What of ``module`` a fake forward's output signature can depend on (see the module
    docstring), or None when that is more than the key can hold."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return None
    try:
        parts: list[Hashable] = []
        for path, m in module.named_modules(remove_duplicate=False):
            if any(getattr(m, name, None) for name in _FORWARD_HOOKS):
                return None
            parts.append((path, _module_key(m)))
        tensors = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        parts += [(path, _tensor_key(t)) for path, t in tensors]
        return tuple(parts)
    except _Unknown:
        return None


def _module_key(m: nn.Module) -> Hashable:
    if isinstance(m, fx.GraphModule):
        # each GraphModule has a class of its own, made for it: its bases are what it runs
        targets = tuple(_plain(n.target) for n in m.graph.nodes if n.op == "call_function")
        attrs = tuple((k, _plain(v)) for k, v in vars(m).items() if k not in _GRAPH_STATE)
        return type(m).__mro__[1:], m.training, m.code, targets, attrs
    attrs = tuple((k, _plain(v)) for k, v in vars(m).items() if k not in _MODULE_STATE)
    return type(m), _class_key(type(m)), m.training, attrs


def _class_key(cls: type) -> Hashable:
    """The attributes of ``cls`` and its bases below nn.Module: a method patched on the class, or a
    class attribute changed, makes another key."""
    return tuple(
        (k, _plain(v))
        for c in cls.__mro__
        if c not in (nn.Module, object)
        for k, v in vars(c).items()
        if k not in _CLASS_SKIP
    )


def _tensor_key(t: torch.Tensor) -> Hashable:
    meta = type(t), tuple(t.shape), t.dtype, str(t.device), t.layout, t.requires_grad
    if t.is_floating_point() or t.is_complex():
        return meta
    if t.device.type != "cpu" or t.numel() > _READ_NUMEL:
        raise _Unknown("an integer tensor whose values the key cannot read cheaply")
    return meta, tuple(t.reshape(-1).tolist())  # a forward may read it as a size


def _plain(v: Any) -> Hashable:
    """``v`` as a hashable value that two equal attributes share, or _Unknown."""
    if v is None or isinstance(v, _SCALARS):
        return type(v), v
    if isinstance(v, torch.device):
        return torch.device, str(v)
    if isinstance(v, torch.Tensor):
        return torch.Tensor, _tensor_key(v)
    if isinstance(v, (tuple, list)):  # torch.Size too
        return type(v), tuple(_plain(x) for x in v)
    if isinstance(v, (set, frozenset)):
        return type(v), frozenset(_plain(x) for x in v)
    if isinstance(v, dict):
        return type(v), tuple((_plain(k), _plain(x)) for k, x in v.items())
    if isinstance(v, functools.partial):
        return functools.partial, _plain(v.func), _plain(v.args), _plain(v.keywords)
    if isinstance(v, weakref.ref):  # an RNN's references to its own weights
        return weakref.ref, _plain(v())
    if isinstance(v, types.BuiltinFunctionType) and _unbound(v):
        return v  # a builtin function, by identity
    if isinstance(v, _CODE):
        return v
    raise _Unknown(type(v).__name__)
