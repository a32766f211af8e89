"""pipeline/schedules/registry.py: one entry per schedule, and a new one needs no other edit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioner import auto, partition
from pipeline.plan import Plan
from pipeline.runtime.pipe import Pipeline
from pipeline.schedules import registry
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.registry import REGISTRY, Entry, entry
from pipeline.schedules.schedule import SCHEDULES, Schedule, schedule, schedule_options, unchecked


def test_the_names_are_the_registrys() -> None:
    names = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipe-v", "v-half",
             "v-min")  # fmt: skip
    assert SCHEDULES == tuple(REGISTRY) == names
    assert [e.split_backward for e in REGISTRY.values()] == [False, False, False] + [True] * 6
    assert [e.placement for e in REGISTRY.values()] == ["loop"] * 5 + ["v"] * 4
    for name in ("zb-v", "dualpipe-v", "v-half", "v-min"):  # two stages per rank, in a V
        assert entry(name).virtual_counts(5) == [2]
    assert entry("interleaved-1f1b").virtual_counts(5) == [2, 3, 4, 5]
    assert entry("1f1b").virtual_counts(5) == [1]
    with pytest.raises(ValueError, match="unknown schedule 'nope'; valid schedules are gpipe, 1f1b"):
        entry("nope")


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("p", [1, 2, 3])
def test_every_entry_builds_what_its_options_allow(name: str, p: int) -> None:
    e = entry(name)
    for v in e.virtual_counts(3):
        for m in (p, 2 * p):
            v_, m_ = schedule_options(name, p, m, v)
            sched = schedule(name, p, m, n_virtual=v)  # validated
            assert (sched.n_virtual, sched.n_microbatches, sched.split_backward) == (v_, m_, e.split_backward)
            assert unchecked(name, p, m, v) == sched


def _lifo(p: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """GPipe with the backwards last-in first-out: a schedule the library does not ship."""
    return tuple(
        tuple([Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in reversed(range(m))])
        for r in range(p)
    )


def test_a_new_schedule_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered, it is built, validated, planned, searched and run with no other edit."""
    monkeypatch.setitem(registry.REGISTRY, "gpipe-lifo", Entry("gpipe-lifo", _lifo, False))
    sched = schedule("gpipe-lifo", 2, 3)
    assert sched.compute[0][3:] == (Action(0, Kind.B, 2), Action(0, Kind.B, 1), Action(0, Kind.B, 0))
    listing = [str(x) for x in sched.program(0, dp=2)]
    tail = ["wait reduce 0", "broadcast loss 1 0,1", "all_reduce loss replicas"]
    assert listing[-7:] == ["0B1", "wait 0RECV_B0", "0B0", "reduce 0", *tail]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    plan = Plan(balance=[3], schedule="gpipe-lifo", n_microbatches=3)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss)
    pipe.step(x, y)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    reference.load_state_dict(model.state_dict())
    for p in reference.parameters():
        p.grad = None
    nn.functional.mse_loss(reference(x), y).backward()  # type: ignore[no-untyped-call]
    for (name, a), b in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name  # type: ignore[arg-type]
    built: list[str] = []

    def spy(name: str, p: int, m: int, v: int) -> Schedule:
        built.append(name)
        return unchecked(name, p, m, v)

    monkeypatch.setattr(auto, "unchecked", spy)
    searched = partition(model, 2, x, schedule="auto", batch_size=6, memory_limit=1e9)
    assert "gpipe-lifo" in built  # the search simulated it beside the built-in ones
    assert searched.schedule in REGISTRY
