"""``partitioner.timing``: the simulator's prediction against closed forms where they are exact.

# p: ranks, v: stages per rank, m: micro-batches, s: stage, r: rank; t_s = f_s + b_s

The closed forms are oracles here, not library code::

    gpipe, 1f1b           T = sum_s t_s + (m - 1) * max_s t_s
    interleaved-1f1b      T = m * max_r sum_{s on r} t_s + (p - 1) * max_s t_s
    zb-h1 (f = b = w)     T = m * (f + b + w) + (p - 1) * (f + b - w)     (b: input-gradient part)
    bubble                1 - m * sum_s t_s / (p * T)

For equal stages of work t the first two give (m + p - 1) t and (m v + p - 1) t.
"""

from __future__ import annotations

import pytest

from partitioner.timing import predict
from pipeline.schedules.schedule import schedule


def _closed_form(
    name: str, forward: list[float], backward: list[float], m: int, v: int = 1
) -> tuple[float, float]:
    work = [f + b for f, b in zip(forward, backward, strict=True)]
    p = len(work) // v
    if name == "interleaved-1f1b":
        step = m * max(sum(work[r::p]) for r in range(p)) + (p - 1) * max(work)
    else:
        step = sum(work) + (m - 1) * max(work)
    return step, 1.0 - m * sum(work) / (p * step)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 3), (1, 5)])
def test_equal_stages(name: str, p: int, m: int) -> None:
    step, bubble = predict(schedule(name, p, m), [1.0] * p, [2.0] * p)
    assert (step, bubble) == pytest.approx(_closed_form(name, [1.0] * p, [2.0] * p, m))
    assert step == pytest.approx((m + p - 1) * 3.0)
    assert bubble == pytest.approx((p - 1) / (m + p - 1))


def test_unequal_stages_gpipe() -> None:
    f, b = [1.0, 3.0, 2.0], [2.0, 6.0, 4.0]
    assert predict(schedule("gpipe", 3, 4), f, b) == pytest.approx(_closed_form("gpipe", f, b, 4))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (3, 2, 6), (2, 3, 2), (4, 2, 8)])
def test_interleaved_equal_chunks(p: int, v: int, m: int) -> None:
    k = p * v
    step, bubble = predict(schedule("interleaved-1f1b", p, m, n_virtual=v), [1.0] * k, [2.0] * k)
    closed = _closed_form("interleaved-1f1b", [1.0] * k, [2.0] * k, m, v)
    assert (step, bubble) == pytest.approx(closed)
    assert step == pytest.approx((m * v + p - 1) * 3.0)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 5)])
def test_weight_is_the_split_part_of_backward(p: int, m: int) -> None:
    f, b, w = 1.0, 1.0, 1.0  # b: input gradient, w: weight gradient; the whole backward is b + w
    zb, _ = predict(schedule("zb-h1", p, m), [f] * p, [b + w] * p, [w] * p)
    assert zb == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
    one, _ = predict(schedule("1f1b", p, m), [f] * p, [b + w] * p, [w] * p)
    assert one == pytest.approx((m + p - 1) * (f + b + w))  # no split: B runs the whole backward
    assert zb < one
    # without the split part known, W costs nothing and zb-h1 predicts what 1F1B does
    unknown, _ = predict(schedule("zb-h1", p, m), [f] * p, [b + w] * p)
    assert unknown == pytest.approx(one)


def test_bad_weight() -> None:
    sched = schedule("zb-h1", 2, 2)
    with pytest.raises(
        ValueError, match=r"weight cost of stage 1 \(3\.0\) must be from 0 to its whole backward"
    ):
        predict(sched, [1.0, 1.0], [2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError, match=r"weight cost of stage 0 \(-1\.0\)"):
        predict(sched, [1.0, 1.0], [2.0, 2.0], [-1.0, 0.0])
    with pytest.raises(ValueError, match="weight has 1 costs but backward has 2"):
        predict(sched, [1.0, 1.0], [2.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="forward has 3 costs but the schedule has 2 stages"):
        predict(sched, [1.0] * 3, [2.0] * 3)
