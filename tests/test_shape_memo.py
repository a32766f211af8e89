"""The memo of output signatures: a stage structure derives a signature once per process, and an
entry is never reused for a stage whose result could differ (each thing the key holds, changed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from pipeline.runtime.inputs.microbatch import Signature
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace import shape_memo
from pipeline.runtime.trace.shape_memo import _READ_NUMEL

CPU = torch.device("cpu")
SIG: Signature = (((4, 3), torch.float32),)


class Widen(nn.Module):
    """Its output's width is a plain attribute, its dtype the default dtype's in eval mode."""

    def __init__(self, times: int = 2) -> None:
        super().__init__()
        self.times = times
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x).repeat(1, self.times)
        return y if self.training else y[:, :1] + torch.zeros(1)


class Repeats(nn.Module):
    """Reads an integer buffer on the host, as a size."""

    def __init__(self, times: int = 2) -> None:
        super().__init__()
        self.register_buffer("times", torch.tensor([1, times]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(*self.times.tolist())


class Config:
    """An object the key cannot read (a model's config): the module that holds it is not memoised."""

    times = 2

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture(autouse=True)
def _empty() -> Iterator[None]:
    shape_memo.clear()
    yield
    shape_memo.clear()


def _infer(module: nn.Module, sig: Signature = SIG) -> tuple[Signature, bool]:
    """(module's output signature, whether the fake forward ran for it)."""
    stage = StageRuntime(
        0, module, n_stages=2, n_microbatches=1, split_backward=False, recompute="never", loss_fn=None,
        device=CPU,
    )  # fmt: skip
    ran: list[Signature] = []
    fake = stage._fake_forward
    stage._fake_forward = lambda s: ran.append(s) or fake(s)  # type: ignore[method-assign]
    return stage.infer(sig), bool(ran)


def test_an_equal_stage_of_another_pipeline_takes_the_memoised_signature() -> None:
    torch.manual_seed(0)
    first, ran = _infer(Widen())
    assert (first, ran) == ((((4, 6), torch.float32),), True)
    torch.manual_seed(1)  # other values, the same structure
    assert _infer(Widen()) == (first, False)
    assert _infer(Widen(), (((5, 3), torch.float32),)) == ((((5, 6), torch.float32),), True)


def _times(m: Widen) -> None:
    m.times = 3


def _weight(m: Widen) -> None:
    m.proj.weight = nn.Parameter(torch.zeros(5, 3))  # a Linear(3, 5) in all but its attributes
    m.proj.bias = nn.Parameter(torch.zeros(5))


def _double(m: Widen) -> None:
    m.double()


def _eval(m: Widen) -> None:
    m.eval()


class Doubled(nn.Linear):
    """A Linear in its attributes and parameters, not in what it returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x)] * 2, dim=1)


def _swapped(m: Widen) -> None:
    m.proj = Doubled(3, 3)


CHANGES: dict[str, tuple[Callable[[Widen], None], Signature, Signature]] = {
    # what changes: (the change, the input signature, the output signature it gives)
    "a plain attribute": (_times, SIG, (((4, 9), torch.float32),)),
    "a parameter's shape": (_weight, SIG, (((4, 10), torch.float32),)),
    "the parameters' dtype": (_double, (((4, 3), torch.float64),), (((4, 6), torch.float64),)),
    "the training mode": (_eval, SIG, (((4, 1), torch.float32),)),
    "a submodule's class": (_swapped, SIG, (((4, 12), torch.float32),)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_stage_that_differs_in_what_the_key_holds_derives_again(change: str) -> None:
    apply, sig, expected = CHANGES[change]
    _infer(Widen(), sig)  # the unchanged structure, memoised at the same input signature
    changed = Widen()
    apply(changed)
    assert _infer(changed, sig) == (expected, True)


def test_a_small_integer_buffer_read_as_a_size_is_keyed_by_its_values() -> None:
    assert _infer(Repeats(2)) == ((((4, 6), torch.float32),), True)
    assert _infer(Repeats(3)) == ((((4, 9), torch.float32),), True)
    assert _infer(Repeats(3)) == ((((4, 9), torch.float32),), False)


class Scaled(nn.Module):
    widths = 2  # a class attribute the forward reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.widths)


def test_a_class_attribute_or_method_changed_between_pipelines_derives_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _infer(Scaled()) == ((((4, 6), torch.float32),), True)
    monkeypatch.setattr(Scaled, "widths", 3)
    assert _infer(Scaled()) == ((((4, 9), torch.float32),), True)
    monkeypatch.setattr(Scaled, "forward", lambda self, x: x.half())  # as kernel libraries patch
    assert _infer(Scaled()) == ((((4, 3), torch.float16),), True)


def test_the_autocast_state_and_default_dtype_are_part_of_the_key() -> None:
    _infer(Widen())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _infer(Widen()) == ((((4, 6), torch.bfloat16),), True)
    _infer(Widen().eval())
    same = Widen().eval()  # float32 parameters: made before the default changes
    torch.set_default_dtype(torch.float64)
    try:  # the eval output adds a zeros tensor of the default dtype: float64 now
        assert _infer(same) == ((((4, 1), torch.float64),), True)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_graph_module_is_keyed_by_its_code() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=1)

    def triple(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x, x], dim=1)

    assert _infer(fx.symbolic_trace(double)) == ((((4, 6), torch.float32),), True)
    assert _infer(fx.symbolic_trace(double)) == ((((4, 6), torch.float32),), False)
    assert _infer(fx.symbolic_trace(triple)) == ((((4, 9), torch.float32),), True)


def _forward_hook(m: Widen) -> None:
    m.proj.register_forward_hook(lambda mod, args, out: out[:, :1])


def _pre_hook(m: Widen) -> None:
    m.register_forward_pre_hook(lambda mod, args: (args[0],))


def _config(m: Widen) -> None:
    m.config = Config()  # type: ignore[assignment]


def _bound(m: Widen) -> None:
    m.act = Config().act  # type: ignore[assignment]  # a bound method: its object is state too


def _builtin_bound(m: Widen) -> None:
    m.get = {"times": 2}.get  # type: ignore[assignment]  # a builtin method: its dict is state too


def _large_integer_buffer(m: Widen) -> None:
    m.register_buffer("ids", torch.arange(_READ_NUMEL + 1))


@pytest.mark.parametrize(
    "change", [_forward_hook, _pre_hook, _config, _bound, _builtin_bound, _large_integer_buffer]
)
def test_a_stage_with_state_the_key_cannot_hold_is_never_memoised(change: Callable[[Widen], None]) -> None:
    for _ in range(2):
        m = Widen()
        change(m)
        assert shape_memo.structure_key(m) is None
        assert _infer(m)[1]  # derived every time


def test_a_global_forward_hook_stops_the_memo() -> None:
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: out)
    try:
        assert shape_memo.structure_key(Widen()) is None
    finally:
        handle.remove()
    assert shape_memo.structure_key(Widen()) is not None


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_nothing_is_memoised_under_a_torch_function_mode() -> None:
    for _ in range(2):
        module = Widen()
        with PassThrough():
            assert _infer(module)[1]


def test_a_default_device_is_keyed_not_refused() -> None:
    """``torch.set_default_device`` runs a torch function mode of its own: that one only places
    factories, and the key holds the device it gives."""
    previous = torch.get_default_device()
    torch.set_default_device("cpu")  # a DeviceContext mode, even for the CPU
    try:
        assert _infer(Widen()) == ((((4, 6), torch.float32),), True)
        assert _infer(Widen()) == ((((4, 6), torch.float32),), False)
        module = Widen()
        on_cpu = shape_memo._key(module, SIG, CPU)
        torch.set_default_device("meta")
        assert on_cpu is not None and shape_memo._key(module, SIG, CPU) not in (on_cpu, None)
    finally:
        torch.set_default_device(previous)


def test_common_modules_are_memoised() -> None:
    for module in (
        nn.LSTM(3, 4), nn.TransformerEncoderLayer(16, 2), nn.MultiheadAttention(16, 2), nn.BatchNorm1d(4),
        nn.Embedding(5, 4), nn.Conv2d(3, 4, 3), nn.GELU(), nn.LayerNorm(4), nn.Dropout(0.1),
    ):  # fmt: skip
        assert shape_memo.structure_key(module) is not None, module


def test_a_failed_derivation_is_not_memoised() -> None:
    class Picks(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x[x > 0]  # a data-dependent shape: refused as a stage output

    for _ in range(2):
        with pytest.raises(ValueError, match="depends on the data"):
            _infer(Picks())


def test_the_memo_keeps_at_most_its_size_dropping_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shape_memo, "MEMO_SIZE", 2)
    for rows in (1, 2, 3):
        _infer(Widen(), (((rows, 3), torch.float32),))
    assert _infer(Widen(), (((3, 3), torch.float32),))[1] is False
    assert _infer(Widen(), (((1, 3), torch.float32),))[1] is True  # the oldest, dropped
