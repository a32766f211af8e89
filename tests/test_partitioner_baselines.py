import pytest

from partitioner import equal_balance, solve, stage_costs, torchgpipe_balance


def test_equal_balance_spreads_the_remainder_first() -> None:
    assert equal_balance(7, 3) == [3, 2, 2]
    assert equal_balance(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"n_stages \(5\) must be from 1 to the number of layers \(4\)"):
        equal_balance(4, 5)


def test_torchgpipe_heuristic_can_miss_the_optimum() -> None:
    costs = [3.0, 2.0, 5.0, 2.0, 8.0, 8.0, 8.0, 7.0]
    theirs = torchgpipe_balance(costs, 3)
    assert theirs == [5, 1, 2] and max(stage_costs(costs, theirs)) == 20.0
    assert solve(costs, 3) == [4, 2, 2] and max(stage_costs(costs, [4, 2, 2])) == 16.0


def test_torchgpipe_heuristic_can_leave_a_stage_empty() -> None:
    # blockpartition.solve on these costs returns an empty third partition; solve never does.
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 2.0, 2.0]
    assert torchgpipe_balance(costs, 4) == [2, 6, 0, 2]
    assert min(solve(costs, 4)) >= 1 and max(stage_costs(costs, solve(costs, 4))) == 9.0
