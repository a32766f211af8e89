"""What both profilers share: option checks, the loss's profile, the model left as it was, RNG kept,
the times blended toward the FLOP prior and the warning when they are too noisy (``trust``).

    # l: layer

``profile`` (an ``nn.Sequential``, layer by layer) and ``graph_profile`` (a traced model, layer
group by layer group) measure the same figures the same way (``_measure``); this module holds
their common checks and guards, so that neither imports the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from partitioner._measure import Rejected, Run, WithTarget, measure
from partitioner._placement import changed_parameters, normalize
from partitioner._trees import describe, nbytes, tensors, tree_map
from partitioner.figures import LayerProfile
from partitioner.noise import FALLBACK_SHARE, flop_rate, noisy_share, priced_by_flops, warn_noisy, with_prior
from pipeline.launch import CPU_THREADS

__all__ = [
    "AUTOCAST_DTYPES",
    "DEFAULT_BUDGET_S",
    "LossFn",
    "canonical_names",
    "check_autocast",
    "check_options",
    "check_untouched",
    "device_of",
    "generators_kept",
    "held_names",
    "loss_figures",
    "profile_loss",
    "rank_threads",
    "refuse_ambient_autocast",
    "trust",
    "uses_cuda",
]

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_BUDGET_S = 30.0  # seconds of timing: past them, a layer of a new structure is priced by its flops
LossFn = Callable[[Any, Any], torch.Tensor]


def check_options(
    autocast: torch.dtype | None,
    warmup: int,
    repeat: int,
    loss_fn: LossFn | None,
    budget: float | None = None,
    threads: int | None = None,
) -> None:
    check_autocast(autocast)
    for label, count, least in (("warmup", warmup, 0), ("repeat", repeat, 1)):
        if isinstance(count, bool) or not isinstance(count, int) or count < least:
            raise ValueError(f"{label} ({count!r}) must be an integer >= {least}")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0
    ):
        raise ValueError(
            f"budget ({budget!r}) must be a number of seconds > 0 (how long the profile times layers), "
            "or None for no limit"
        )
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(
            f"threads ({threads!r}) must be an integer >= 1 (intra-op threads while timing on CPU), or None "
            f"for a launched rank's ({CPU_THREADS})"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")


def canonical_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name in ``model`` (a tied one has one name), by identity."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def held_names(module: nn.Module, names: dict[int, str]) -> tuple[str, ...]:
    """The canonical names of the parameters ``module`` holds."""
    return tuple(sorted({names[id(p)] for p in module.parameters() if id(p) in names}))


def check_autocast(autocast: object) -> None:
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast ({autocast!r}) must be torch.bfloat16, torch.float16 or None (fp32): "
            "the dtype the run's torch.autocast uses"
        )


def profile_loss(loss_fn: LossFn, target: Any, out: Any, run: Run) -> LayerProfile:
    """The loss's figures on the last layer's output ``out`` (``loss_figures``); a ValueError
    naming both inputs when the loss rejects them."""
    try:
        return loss_figures(loss_fn, target, out, run)
    except Rejected as err:
        raise ValueError(
            f"loss_fn rejected the last layer's output {describe(out)} with target {describe(target)}: "
            f"{err}; pass target= (one micro-batch of targets) that loss_fn accepts"
        ) from err.__cause__


def loss_figures(loss_fn: LossFn, target: Any, out: Any, run: Run, timed: bool = True) -> LayerProfile:
    """``measure`` of the loss on (``out``, ``target``), its saved input split into the output's part
    (what the last layer may save too) and the target's; ``Rejected`` when it raises."""
    target = tree_map(target, lambda t: t.to(run.device))

    def loss(pair: tuple[Any, Any]) -> torch.Tensor:
        value = loss_fn(*pair)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"loss_fn must return a scalar (0-dim) tensor, got {shape}; reduce it, e.g. with .mean()"
            )
        return value

    module = loss_fn if isinstance(loss_fn, nn.Module) else None
    kind = type(loss_fn).__name__
    figures, _ = measure(
        -1, "loss", kind, loss, module, WithTarget(out, target), run, first=False, timed=timed
    )
    # its input is (output, target): the output's part is what the last layer may save too
    of_output = min(figures.saved_input_bytes, nbytes(out))
    return dataclasses.replace(
        figures, saved_input_bytes=of_output, saved_target_bytes=figures.saved_input_bytes - of_output
    )


def check_untouched(label: str, layer: nn.Module, before: list[int]) -> None:
    changed = changed_parameters(layer, before)
    if changed:
        raise ValueError(
            f"{label} wrote into its own parameters ({', '.join(changed)}) while it was profiled, so "
            "the model is not as it was; a forward must not modify parameters in place"
        )


def refuse_ambient_autocast() -> None:
    for kind in ("cpu", "cuda"):
        if torch.is_autocast_enabled(kind):
            raise ValueError(
                f"profile() was called inside torch.autocast on {kind}: it sets the run's precision "
                "itself; call it outside the autocast region and pass autocast=<the region's dtype>"
            )


def device_of(x: Any) -> torch.device:
    found = tensors(x)
    return normalize(found[0].device) if found else torch.device("cpu")


def uses_cuda(model: nn.Module, sample: Any, dev: torch.device | None) -> bool:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return True
    held = itertools.chain(model.parameters(), model.buffers(), tensors(sample))
    return (dev is not None and dev.type == "cuda") or any(t.is_cuda for t in held)


@contextlib.contextmanager
def rank_threads(threads: int | None, cuda: bool) -> Iterator[None]:
    """On CPU, intra-op threads as a launched rank runs (``threads``, None: ``launch``'s default) while
    the layers are timed, put back on the way out: a balance is made of the times ranks will see, and
    with fewer threads than cores other work on the host cannot stall a kernel's threads at a barrier
    in every sample (two threads on a busy 2-core host: 10-100x slower, no floor to find). On CUDA the
    host's threads are left as they are."""
    before = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(threads or CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def generators_kept(cuda: bool) -> Iterator[None]:
    """The CPU generator's state, and every CUDA device's, are put back on the way out."""
    cpu = torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)


def trust(
    layers: list[LayerProfile], loss: LayerProfile | None, repeat: int, budget: float | None = None
) -> tuple[list[LayerProfile], LayerProfile | None, list[int], dict[str, float], list[int]]:
    """The layers and loss with their times blended toward the FLOP prior fitted on the layers,
    the noisy ones' indices (-1: the loss), the prior, and the layers whose times are what their
    flops predict: all of them when the noisy layers hold most of the time, else those the time
    ``budget`` left untimed; warned about in one line (``partitioner.noise``)."""
    layers, extra, rates = with_prior(layers, [] if loss is None else [loss])
    fallback = noisy_share([*layers, *extra]) > FALLBACK_SHARE
    untimed = [lp for lp in layers if lp.timing is None]  # past the budget (and their copies)
    if fallback or untimed:
        rate = flop_rate(layers)
        layers = [priced_by_flops(lp, rate) if fallback or lp.timing is None else lp for lp in layers]
        extra = [priced_by_flops(lp, rate) for lp in extra] if fallback else extra
    from_flops = [lp.index for lp in [*layers, *extra]] if fallback else [lp.index for lp in untimed]
    noisy = warn_noisy([*layers, *extra], repeat, fallback=fallback, untimed=untimed, budget=budget)
    return layers, (extra[0] if extra else None), noisy, rates, from_flops
