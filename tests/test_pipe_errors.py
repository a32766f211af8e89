"""Building a Pipeline wrong, in one process: each mistake is refused at once, saying what to change."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules.schedule import schedule


class _HasBalance:  # what Pipeline once accepted for a plan: anything with .balance
    def __init__(self) -> None:
        self.balance = [2, 2]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(balance=[3]), r"balance \[3\] sums to 3 layers but the model has 4"),
        (dict(balance=[2, 2], n_virtual=2, schedule="1f1b"), r"n_virtual \(2\) must be 1 for '1f1b'"),
        (dict(balance=[4], recompute="sometimes"), r"unknown recompute mode 'sometimes'; use one of never, "),
        (dict(balance=[4], loss_fn=None), r"loss_fn is required"),
        (dict(balance=[4], schedule="1f1b2"), r"unknown schedule '1f1b2'; valid schedules are"),
        (dict(balance=[4], n_microbatches=0), r"n_microbatches \(0\) must be an integer >= 1, or omitted"),
        (dict(balance=[4], n_virtual=True), r"n_virtual \(True\) must be an integer >= 1, or omitted"),
        (dict(balance=[1, 1, 1, 1], schedule="interleaved-1f1b", n_microbatches=3),
         r"n_microbatches \(3\) must be a multiple of the number of ranks \(2\) for interleaved-1f1b"),
        (dict(balance=[3, 1, 0]), r"balance \[3, 1, 0\] must hold at least one stage, each of >= 1 layers"),
        (dict(balance=[4], schedule=schedule("gpipe", 1, 2), n_microbatches=4),
         r"n_microbatches \(4\) does not match the schedule's \(2\); omit n_microbatches or pass 2"),
        (dict(balance=[2, 2], schedule=schedule("1f1b", 1, 2), n_virtual=2),
         r"schedule '1f1b' has 1 stages but balance has 2"),
        (dict(balance=[2, 2], schedule=schedule("interleaved-1f1b", 2, 4, n_virtual=2)),
         r"schedule 'interleaved-1f1b' has 4 stages but balance has 2"),
    ],
)  # fmt: skip
def test_bad_construction(kwargs: dict[str, Any], error: str) -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    args: dict[str, Any] = dict(loss_fn=nn.functional.mse_loss)
    args.update(kwargs)
    balance = args.pop("balance")
    with pytest.raises(ValueError, match=error):
        Pipeline(model, balance, **args)


@pytest.mark.parametrize(
    ("keyword", "value", "planned"),
    [("schedule", "gpipe", "'1f1b'"), ("n_microbatches", 8, "4"), ("n_virtual", 2, "1"),
     ("recompute", "always", "'never'"), ("checkpoint", "always", "'never'")],
)  # fmt: skip
def test_a_keyword_that_contradicts_the_plan_is_refused(keyword: str, value: Any, planned: str) -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    plan = Plan(balance=[2, 2], schedule="1f1b", n_microbatches=4)  # for 2 ranks: refused before that
    name = "recompute" if keyword == "checkpoint" else keyword
    shown = repr(value)
    error = (
        rf"{name} \({shown}\) contradicts the plan's \({planned}\); omit {name} or make the plan with "
        rf"{name}={shown}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=error):
            Pipeline(model, plan, loss_fn=nn.functional.mse_loss, **{keyword: value})
    # repeating what the plan says is fine: the one-rank plan builds
    one = Plan(balance=[4], schedule="1f1b", n_microbatches=4)
    same = dict(schedule="1f1b", n_microbatches=4, n_virtual=1, recompute="never")
    pipe = Pipeline(model, one, loss_fn=nn.functional.mse_loss, **same)  # type: ignore[arg-type]
    assert pipe.plan is one and pipe.schedule == one.build_schedule()


def test_a_schedule_object_must_be_the_plans() -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    plan = Plan(balance=[4], schedule="gpipe", n_microbatches=4)
    error = (
        r"schedule 'gpipe' has 1 stages on 1 ranks and 2 micro-batches, but the plan 1 stages on 1 ranks "
        r"and 4 micro-batches; omit schedule= to run the plan's"
    )
    with pytest.raises(ValueError, match=error):
        Pipeline(model, plan, loss_fn=nn.functional.mse_loss, schedule=schedule("gpipe", 1, 2))
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, schedule=schedule("gpipe", 1, 4))
    assert pipe.plan is plan and pipe.n_microbatches == 4


def test_defaults_are_partitions() -> None:
    # m = p and v = 2 for interleaved-1f1b, as partition makes plans; recompute never
    model, _ = mlp(width=4, depth=4, batch_size=4)
    pipe = Pipeline(model, [2, 2], schedule="interleaved-1f1b", loss_fn=nn.functional.mse_loss)
    assert pipe.plan == Plan(balance=[2, 2], schedule="interleaved-1f1b", n_microbatches=1, n_virtual=2)
    assert (pipe.n_microbatches, pipe.schedule.n_virtual, pipe.recompute) == (1, 2, "never")
    pipe = Pipeline(model, [4], loss_fn=nn.functional.mse_loss, schedule=schedule("gpipe", 1, 3))
    assert pipe.plan is None and pipe.n_microbatches == 3  # a Schedule object runs as given


def test_a_multi_rank_plan_outside_launch_says_how_to_start_ranks() -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    for plan in ([2, 2], Plan(balance=[1, 1, 1, 1], schedule="interleaved-1f1b")):
        with pytest.raises(RuntimeError) as info:
            Pipeline(model, plan, loss_fn=nn.functional.mse_loss)
        assert str(info.value) == (
            "this pipeline runs on 2 ranks but torch.distributed is not initialised in this process; "
            "start 2 ranks with pipeline.launch(fn, 2, ...) (fn builds the Pipeline on each rank) or "
            "torchrun --nproc-per-node 2 (then call pipeline.init_distributed() before Pipeline), or make "
            "a plan for 1 rank"
        )


def test_a_model_that_is_not_sequential_is_refused_with_the_fix() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    error = (
        r"Pipeline cuts an nn.Sequential into stages of consecutive layers, got Net; wrap the model's "
        r"layers, in the order they run, in one: nn.Sequential\("
    )
    with pytest.raises(TypeError, match=error):
        Pipeline(Net(), [2], loss_fn=nn.functional.mse_loss)  # type: ignore[arg-type]


@pytest.mark.parametrize("plan", [_HasBalance(), "22", (2.0, 2.0)])
def test_a_plan_must_be_a_plan_or_layer_counts(plan: Any) -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    with pytest.raises(
        TypeError, match=r"plan must be a pipeline.Plan or a list of layer counts per stage, got "
    ):
        Pipeline(model, plan, loss_fn=nn.functional.mse_loss)


def test_checkpoint_is_the_old_name_of_recompute() -> None:
    model, _ = mlp(width=4, depth=4, batch_size=4)
    with pytest.warns(FutureWarning, match=r"Pipeline\(checkpoint=...\) is renamed recompute=...") as caught:
        pipe = Pipeline(model, [4], loss_fn=nn.functional.mse_loss, checkpoint="always")
    assert caught[0].filename == __file__  # points at the caller's line
    assert pipe.recompute == "always" and all(pipe.stages[0].recomputes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recompute= alone: no warning
        assert Pipeline(model, [4], loss_fn=nn.functional.mse_loss, recompute="always").recompute == "always"
    error = r"recompute='never' and checkpoint='always' disagree; .* pass recompute= alone"
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=error):
        Pipeline(model, [4], loss_fn=nn.functional.mse_loss, recompute="never", checkpoint="always")


def test_bad_step_input_in_one_process() -> None:
    model, _ = mlp(width=4, depth=2, batch_size=4)
    pipe = Pipeline(model, [2], schedule="gpipe", n_microbatches=4, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"inputs has 3 rows but n_microbatches is 4, .* <= 3"):
        pipe.step(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"the targets have 8 rows but the inputs \(on stage 0's rank\) 10"):
        pipe.step(torch.zeros(10, 4), torch.zeros(8, 4))
    with pytest.raises(TypeError, match=r"prefetch must be the next call's \(inputs, targets\) pair"):
        pipe.step(torch.zeros(8, 4), torch.zeros(8, 4), prefetch=torch.zeros(8, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dst \(1\) must be a rank of the pipeline's group, 0 to 0"):
        pipe.predict(torch.zeros(8, 4), dst=1)
    with pytest.raises(ValueError, match=r"rank 0 holds stage 0 but predict\(\) got no inputs"):
        pipe.predict()
    with pytest.raises(ValueError, match=r"rank 0 holds the last stage \(0\) but step\(\) got no targets"):
        pipe.step(torch.zeros(8, 4))
    with pytest.raises(ValueError, match=r"rank 0 holds stage 0 but step\(\) got no inputs"):
        pipe.step(None, torch.zeros(8, 4))
