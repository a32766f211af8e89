"""``partitioner.timing``: closed forms agree with the simulator where both are exact."""

from __future__ import annotations

import pytest

from partitioner import timing
from partitioner.timing import predict


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 3)])
def test_equal_stages(name: str, p: int, m: int) -> None:
    step, bubble, source = predict(name, [1.0] * p, [2.0] * p, m)
    assert source == "simulator"
    assert step == pytest.approx((m + p - 1) * 3.0)
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert timing._closed_form(name, [1.0] * p, [2.0] * p, m, 1) == pytest.approx((step, bubble))


def test_unequal_stages_gpipe_closed_form_matches_simulator() -> None:
    f, b = [1.0, 3.0, 2.0], [2.0, 6.0, 4.0]
    step, bubble, _ = predict("gpipe", f, b, 4)
    assert (step, bubble) == pytest.approx(timing._closed_form("gpipe", f, b, 4, 1))


def test_interleaved_equal_chunks() -> None:
    p, v, m = 2, 2, 4
    step, _, _ = predict("interleaved-1f1b", [1.0] * (p * v), [2.0] * (p * v), m, n_virtual=v)
    closed, _ = timing._closed_form("interleaved-1f1b", [1.0] * (p * v), [2.0] * (p * v), m, v)
    assert closed == (m * v + p - 1) * 3.0
    assert step >= m * v * 3.0
