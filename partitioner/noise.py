"""Timing noise: each layer's times from repeated samples, how far to trust them, and a FLOP prior.

    # l: layer, n: its timed samples (after warm-up), q: one of its times (forward, backward,
    # input gradient, weight gradient), t: a time in seconds

On a shared machine another job only ever ADDS time to a sample: sample = t + delay, delay >= 0,
hitting one sample, most of them or all. The figures follow from that::

    estimate      the samples' minimum: right when ONE sample ran undisturbed (the median needs
                  more than half, the mean none, to be; one sample in five 100x slower moves the
                  mean 20x and, about one run in twenty with five samples, the median 100x)
    spread        (upper - lower quartile) / median: how disturbed the samples were (reported)
    error         floor gap, (median - minimum) / minimum: when most samples sit near the minimum
                  it is the time; when they do not, every sample may be disturbed and the minimum
                  overstates t by an unknown amount of about this size
    stable        the minimum of the first half of the samples is the minimum of all, within
                  SETTLE_SHARE of the layer's time (timing more is not finding a lower floor),
                  and the floor gap is at most NOISE_LIMIT (the floor is found)

Repeats adapt (``settled``): at least ``repeat`` samples, then more until stable, at most
``MAX_REPEAT_FACTOR * repeat`` and within a time budget (as long again as the first ``repeat``
took, at least ``BUDGET_FLOOR_S``), so a small model still profiles in well under a second.
``profile``'s ``repeat`` defaults to 10: with one sample in five disturbed, all ten are one time
in ten million (0.2 ** 10), where five would be one in three thousand.

A layer is ``noisy`` when the floor gap of its ``forward + backward`` (the cost a balance splits)
is above ``NOISE_LIMIT``; ``profile`` warns, naming those layers, and flags the profile.

The FLOP prior (``with_prior``) makes a balance insensitive to what noise is left. Time per flop
varies between kinds of layers, but far less than a disturbed sample varies, and hardly at all
between layers of one kind (a stack of identical blocks)::

    per q, group G: c = median over G's stable layers (error_q <= NOISE_LIMIT) of log(t_q / flops_q)
                    s = 1.4826 * median |log(t_q / flops_q) - c|     (robust sd; at least PRIOR_FLOOR)
        G: the layers of l's kind (``LayerProfile.kind``) when MIN_SAME_KIND of them are stable,
           else all layers when MIN_STABLE are (else no prior: the measurement is used)
    per l, q: predicted = exp(c) * flops_q
              log value = (log measured / error^2 + log predicted / s^2) / (1 / error^2 + 1 / s^2)

a precision-weighted mean in log space (a Gaussian prior and measurement on the log time). A
sharp floor (error near 0) keeps the measurement as it is; a layer disturbed in every sample
(error large) moves toward what its flops predict, by as much as its group says flops predict
time (s). ``Profile.seconds_per_flop`` is the all-layers exp(c) per time. The loss, when
profiled, is blended with the all-layers prior and can be noisy like a layer (index -1).

A layer slowed by the same factor in every sample has no floor gap and cannot be told from a
slow layer: the warning's advice (a quieter machine) is the only cure for that.

Layers profiled once for several (``LayerProfile.same_as``, ``partitioner._reuse``) count once in
the prior: a copy adds no evidence. When the noisy layers hold more than ``FALLBACK_SHARE`` of
the measured time, the blend has too little to lean on and the profile falls back as a whole::

    untrusted:  sum over noisy l of t_l  >  FALLBACK_SHARE * sum over l of t_l      t: forward + backward
    then, per l, q with flops_q > 0:  value = rate * flops_q

(what ``cost="flops"`` balances, in seconds), and so are the layers the time budget left
untimed (``timing`` None). ``flop_rate``: one rate for every time of every layer, so that the
balance is the flops' whatever the rate::

    rate = sum over timed l of (measured forward + backward) / sum over them of (F + B)

the big layers' rate, which disturbed samples may overstate: the best there is (the prior, fitted
on the stable layers, here the few small ones, may have no rate for some times, and a rate per
time would let the noise set the forward against the backward). A time whose flops are 0 keeps
its measurement (0 when untimed). ``warn_noisy`` says all of it in one short line.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from collections.abc import Sequence

from partitioner.figures import LayerProfile, LayerTiming, TimeEstimate

__all__ = [
    "BUDGET_FLOOR_S",
    "FALLBACK_SHARE",
    "MAX_REPEAT_FACTOR",
    "MIN_SAME_KIND",
    "MIN_STABLE",
    "NOISE_LIMIT",
    "PRIOR_FLOOR",
    "QUANTITIES",
    "SETTLE_SHARE",
    "NoisyProfileWarning",
    "estimate",
    "floor_gap",
    "flop_rate",
    "noisy_share",
    "priced_by_flops",
    "settled",
    "spread",
    "warn_noisy",
    "with_prior",
]

NOISE_LIMIT = 0.10  # floor gap above which a layer's time is not trusted
SETTLE_SHARE = 0.02  # the floor may still drop this share of the layer's time when sampling stops
MAX_REPEAT_FACTOR = 10
BUDGET_FLOOR_S = 0.02
PRIOR_FLOOR = 0.05  # the prior is never trusted more than to 5 % (log sd)
MIN_STABLE = 3
MIN_SAME_KIND = 2
FALLBACK_SHARE = 0.5  # noisy layers holding more of the measured time: every time from the flops
QUANTITIES = ("forward", "backward", "input", "weight")
_FLOPS = {"forward": "flops", "backward": "backward_flops", "input": "input_flops", "weight": "weight_flops"}


class NoisyProfileWarning(UserWarning):
    """Some layers' times were too noisy to trust (see ``Profile.noisy_layers``)."""


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def spread(values: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than 3 samples or a median of 0)."""
    q1, median, q3 = _quartiles(values)
    return (q3 - q1) / median if len(values) >= 3 and median > 0 else 0.0


def floor_gap(values: Sequence[float]) -> float:
    """(median - minimum) / minimum: how far the minimum may overstate the time; 0 for fewer
    than 3 samples (nothing to judge by)."""
    low = min(values)
    return (statistics.median(values) - low) / low if len(values) >= 3 and low > 0 else 0.0


def estimate(values: Sequence[float]) -> TimeEstimate:
    """One time's estimate from its samples, before any prior (``value`` = ``measured``)."""
    low = min(values)
    return TimeEstimate(measured=low, spread=spread(values), error=floor_gap(values), value=low)


def settled(totals: Sequence[float], repeat: int, spent: float, first: float) -> bool:
    """Stop sampling? ``totals``: per-sample forward + backward so far; ``spent``: seconds so far,
    ``first``: seconds the first ``repeat`` samples took (see the module docstring)."""
    n = len(totals)
    if n < repeat:
        return False
    if n >= MAX_REPEAT_FACTOR * repeat or spent >= first + max(first, BUDGET_FLOOR_S):
        return True
    if n < 3:
        return True  # nothing to compare: the caller asked for this few
    low = min(totals)
    return min(totals[: (n + 1) // 2]) - low <= SETTLE_SHARE * low and floor_gap(totals) <= NOISE_LIMIT


def _prior(entries: list[tuple[float, int, float]], least: int) -> tuple[float, float] | None:
    """(centre, sd) of log(t / flops) over the stable (t, flops, error) entries; None if too few."""
    logs = [math.log(t / f) for t, f, err in entries if t > 0 and f > 0 and err <= NOISE_LIMIT]
    if len(logs) < least:
        return None
    centre = statistics.median(logs)
    return centre, max(PRIOR_FLOOR, 1.4826 * statistics.median(abs(x - centre) for x in logs))


def _blend(est: TimeEstimate, flops: int, prior: tuple[float, float] | None) -> TimeEstimate:
    if prior is None or flops <= 0 or est.measured <= 0:
        return est
    predicted = math.exp(prior[0]) * flops
    if est.error <= 0:
        return dataclasses.replace(est, predicted=predicted, value=est.measured)
    w_measured, w_prior = 1.0 / est.error**2, 1.0 / prior[1] ** 2
    log_value = (w_measured * math.log(est.measured) + w_prior * math.log(predicted)) / (w_measured + w_prior)
    return dataclasses.replace(est, predicted=predicted, value=math.exp(log_value))


def _with_times(lp: LayerProfile, parts: dict[str, TimeEstimate]) -> LayerProfile:
    """``lp`` with these estimates, and their values as its times."""
    return dataclasses.replace(
        lp,
        timing=LayerTiming(**parts),
        forward_time=parts["forward"].value,
        backward_time=parts["backward"].value,
        input_time=parts["input"].value,
        weight_time=parts["weight"].value,
    )


def with_prior(
    layers: Sequence[LayerProfile], extra: Sequence[LayerProfile] = ()
) -> tuple[list[LayerProfile], list[LayerProfile], dict[str, float]]:
    """``layers`` and ``extra`` (the loss) with every time blended toward the FLOP prior fitted on
    ``layers``, and the prior's seconds per flop per time (see the module docstring)."""
    timed = [lp for lp in layers if lp.timing is not None and lp.same_as is None]  # a copy: no evidence
    kinds = {lp.kind for lp in timed}

    def entries(q: str, kind: str | None) -> list[tuple[float, int, float]]:
        return [
            (getattr(lp.timing, q).measured, getattr(lp, _FLOPS[q]), getattr(lp.timing, q).error)
            for lp in timed
            if kind is None or lp.kind == kind
        ]

    priors = {q: _prior(entries(q, None), MIN_STABLE) for q in QUANTITIES}
    by_kind = {(q, kind): _prior(entries(q, kind), MIN_SAME_KIND) for q in QUANTITIES for kind in kinds}

    def blended(lp: LayerProfile) -> LayerProfile:
        if lp.timing is None:
            return lp
        parts = {
            q: _blend(getattr(lp.timing, q), getattr(lp, _FLOPS[q]), by_kind.get((q, lp.kind)) or priors[q])
            for q in QUANTITIES
        }
        return _with_times(lp, parts)

    rates = {q: math.exp(p[0]) for q, p in priors.items() if p is not None}
    return [blended(lp) for lp in layers], [blended(lp) for lp in extra], rates


def noisy_share(layers: Sequence[LayerProfile]) -> float:
    """The share of the layers' measured forward + backward time that the noisy ones hold (a
    copy counts: it is a layer's time too); 0 when nothing was timed."""

    def measured(lp: LayerProfile) -> float:
        return 0.0 if lp.timing is None else lp.timing.forward.measured + lp.timing.backward.measured

    total = math.fsum(measured(lp) for lp in layers)
    return math.fsum(measured(lp) for lp in layers if lp.noisy) / total if total > 0 else 0.0


def flop_rate(layers: Sequence[LayerProfile]) -> float | None:
    """Seconds per flop for times taken from flops (see the module docstring): the timed layers'
    measured forward + backward seconds over their flops; None when none was timed with flops."""
    timed = [lp for lp in layers if lp.timing is not None and lp.flops + lp.backward_flops > 0]
    seconds = math.fsum(lp.timing.forward.measured + lp.timing.backward.measured for lp in timed if lp.timing)
    flops = sum(lp.flops + lp.backward_flops for lp in timed)
    return seconds / flops if seconds > 0 else None


def priced_by_flops(lp: LayerProfile, rate: float | None) -> LayerProfile:
    """``lp`` with each time that has flops what they predict, ``rate * flops_q``; the others as they
    were (0 when untimed)."""
    base = lp.timing or LayerTiming()
    parts = {}
    for q in QUANTITIES:
        est, flops = getattr(base, q), getattr(lp, _FLOPS[q])
        if flops > 0 and rate is not None:
            est = dataclasses.replace(est, predicted=rate * flops, value=rate * flops)
        parts[q] = est
    return _with_times(lp, parts)


def warn_noisy(
    layers: Sequence[LayerProfile],
    repeat: int,
    *,
    fallback: bool = False,
    untimed: Sequence[LayerProfile] = (),
    budget: float | None = None,
) -> list[int]:
    """Warn (``NoisyProfileWarning``, one short line) naming the noisy layers and what to do, and
    saying which times are what their flops predict: every one (``fallback``) or the ``untimed``
    layers', past the time ``budget``. The noisy layers' indices."""
    noisy = [lp for lp in layers if lp.noisy]
    said = []
    if noisy:  # the first three measured ones named, the rest counted (Profile.noisy_layers has all)
        shown = [lp for lp in noisy if lp.same_as is None][:3]
        named = ", ".join(
            f"{'the loss' if lp.index < 0 else f'layer {lp.index} ({lp.name}: {lp.kind})'} "
            f"(floor gap {lp.error:.0%})"
            for lp in shown
        )
        more = f" and {len(noisy) - len(shown)} more" if len(noisy) > len(shown) else ""
        said.append(f"{len(noisy)} of {len(layers)} layers are too noisy to trust: {named}{more}; ")
        if fallback:
            said[-1] += (
                f"they hold {noisy_share(layers):.0%} of the time, so every time is what its flops predict "
                f"(as cost='flops'). On a quieter machine, or with profile(..., repeat=N) (now {repeat}), "
                "they are measured"
            )
        else:
            said[-1] += (
                f"their times lean on their flops. On a quieter machine, or with profile(..., repeat=N) "
                f"(now {repeat}), or partition(..., cost='flops'), the balance does not depend on them"
            )
    if untimed:
        start = untimed[0]
        said.append(
            f"the time budget ({budget or 0:g} s) ran out at layer {start.index} ({start.name}): "
            f"{len(untimed)} layers' times are what their flops predict; profile(..., budget=None) times all"
        )
    if said:
        warnings.warn(
            "profile: " + "; ".join(said) + ".",
            NoisyProfileWarning,
            stacklevel=4,  # profile()'s caller
        )
    return [lp.index for lp in noisy]
