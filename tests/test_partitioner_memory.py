"""``partitioner.memory``: in-flight micro-batches per stage, from the schedule and closed forms."""

from __future__ import annotations

import pytest

from partitioner import memory
from partitioner.memory import in_flight, layer_memory


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (4, 8), (4, 2), (3, 7)])
def test_schedule_walk_matches_closed_forms(p: int, m: int) -> None:
    assert in_flight("gpipe", p, m) == [m] * p
    assert in_flight("1f1b", p, m) == [min(m, p - s) for s in range(p)]
    assert in_flight("1f1b", p, m) == memory._closed_form("1f1b", p, m, 1)


def test_zb_h1_holds_activations_until_w() -> None:
    assert in_flight("zb-h1", 4, 8) == [4, 4, 4, 4]  # the closed form's [4, 3, 2, 1] is too low here


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (2, 3, 4), (3, 2, 6), (4, 3, 8)])
def test_interleaved_closed_form_is_an_upper_bound(p: int, v: int, m: int) -> None:
    exact = in_flight("interleaved-1f1b", p * v, m, n_virtual=v)
    bound = memory._closed_form("interleaved-1f1b", p * v, m, v)
    assert all(b >= e for b, e in zip(bound, exact, strict=True))
    assert exact[0] == min(m, bound[0])


def test_layer_memory_rows() -> None:
    rows = layer_memory([10, 0], [3, 5], [2, 1], optimizer_state_factor=2.0)
    assert rows == [[40.0 + 6.0, 10.0], [40.0 + 3.0, 5.0]]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'x'"):
        in_flight("x", 2, 2)
    with pytest.raises(ValueError, match="n_virtual"):
        in_flight("interleaved-1f1b", 4, 4)
    with pytest.raises(ValueError, match=r"n_microbatches \(0\)"):
        in_flight("1f1b", 2, 0)
    with pytest.raises(ValueError, match="optimizer_state_factor"):
        layer_memory([1], [1], [1], optimizer_state_factor=-1.0)
