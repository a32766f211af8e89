from __future__ import annotations

import pytest
import torch

from pipeline.runtime.step.recompute import RNGState, check_mode, recomputes


def test_modes() -> None:
    m = 4
    assert [recomputes("never", i, m) for i in range(m)] == [False] * 4
    assert [recomputes("except_last", i, m) for i in range(m)] == [True, True, True, False]
    assert [recomputes("always", i, m) for i in range(m)] == [True] * 4


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown recompute mode 'sometimes'; use one of never, except_"):
        check_mode("sometimes")


def test_rng_replay_draws_the_same_numbers() -> None:
    state = RNGState.capture(torch.device("cpu"))
    first = torch.nn.functional.dropout(torch.ones(100), 0.5)
    state.restore()
    again = torch.nn.functional.dropout(torch.ones(100), 0.5)
    assert torch.equal(first, again)
