"""Resume is bit-identical: a loop stopped at step k, rebuilt and loaded, goes on as if never stopped.

The loop is the one a user writes: an nn.Sequential with BatchNorm and Dropout, AdamW
with two param groups (weights: weight decay; biases and BatchNorm: none, another lr),
a warm-up LambdaLR, fp32 or bf16 autocast with a GradScaler, a validation pass. Three
runs, each checking many things (later ones resume what earlier ones saved); the first two are
jobs of the shared launches (tests/dist.py):

    2 ranks, 1f1b        fp32 and bf16: N steps; again, saving at k = 0, 2, 5 (no side effect);
                         for every k a new Pipeline, optimizer, scheduler and scaler (other seeds)
                         load step k and go on: each loss, the validation loss, the scheduler's
                         and scaler's state equal the uninterrupted run's. Without dropout, saves
                         the step-2 checkpoint the 4-rank launch resumes.
    4 ranks, 1f1b        loads the 2-rank checkpoints: each parameter's param-group values and the
                         scheduler as saved; without dropout goes on and equals the 2-rank run
                         (no randomness: the stage count changes nothing), saving step 4; with
                         dropout, saves at once (the RNG of ranks 0 and 1 unchanged)
    2 ranks, v = 2       interleaved (4 stages on 2 ranks) resumes the 4-rank step 4; 1f1b resumes
                         the dropout round trip 2 -> 4 -> 2: both equal the first launch's runs
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pipeline import checkpointing
from pipeline.runtime.pipe import Pipeline
from tests.dist import job, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process dcp

N, M, BATCH, WARMUP = 6, 4, 16, 4  # steps, micro-batches, rows, warm-up steps
SAVES = (0, 2, 5)
TWO, FOUR = [5, 4], [2, 3, 2, 2]  # balances of the 9 layers


def _model(dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(16, 3),
    )  # fmt: skip


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def _optimizer(named: Any) -> torch.optim.AdamW:
    named = list(named)
    decay = [p for _, p in named if p.ndim > 1]
    rest = [p for _, p in named if p.ndim <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
    )


class Loop:
    """What a user's training loop holds, built from scratch with ``seed`` (init and RNG differ per seed)."""

    def __init__(self, seed: int, dropout: float, balance: list[int], schedule: str, amp: bool) -> None:
        torch.manual_seed(seed)
        self.scale = [1.0]  # the GradScaler's scale, read by the loss of every micro-batch
        self.pipe = Pipeline(
            _model(dropout), balance, schedule=schedule, n_microbatches=M, loss_fn=self._loss, timeout=60.0
        )
        self.opt = _optimizer(self.pipe.named_parameters())
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _warmup)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if amp else None
        self.amp = amp
        torch.manual_seed(seed + 1 + dist.get_rank())  # every rank its own dropout stream

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y) * self.scale[0]

    def objects(self) -> dict[str, Any]:
        return {
            "pipe": self.pipe,
            "optimizer": self.opt,
            "lr_scheduler": self.sched,
            "grad_scaler": self.scaler,
        }

    def step(self, t: int) -> float:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        if self.scaler is not None:  # scale() also creates the scale tensor that unscale_() needs
            self.scale[0] = float(self.scaler.scale(torch.ones(())))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp):
            loss = self.pipe.step(x, y) / self.scale[0]
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return loss

    def val(self) -> float:
        g = torch.Generator().manual_seed(999)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.amp):
            return self.pipe.evaluate(x, y) / self.scale[0]

    def train(self, start: int, stop: int, at: dict[int, Any] | None = None) -> list[float]:
        """Steps start..stop-1; ``at[t]()`` runs when t steps are done (t = start too)."""
        at = at or {}
        if start in at:
            at[start]()
        losses = []
        for t in range(start, stop):
            losses.append(self.step(t))
            if t + 1 in at:
                at[t + 1]()
        return losses

    def save(self, folder: str, t: int, keep: int | None = 2) -> None:
        checkpointing.save(folder, t, **self.objects(), extra={"step": t, "seen": [t, "batches"]}, keep=keep)

    def load(self, path: str) -> Any:
        return checkpointing.load(path, **self.objects())

    def states(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self.sched.state_dict(), self.scaler.state_dict() if self.scaler is not None else None

    def hyper(self) -> dict[str, dict[str, Any]]:
        """Each parameter's param-group values, by name: what must survive a change of stage count."""
        names = {id(p): n for n, p in self.pipe.named_parameters()}
        keys = ("lr", "initial_lr", "weight_decay", "betas", "eps")
        return {names[id(p)]: {k: g[k] for k in keys} for g in self.opt.param_groups for p in g["params"]}


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in results:
        assert not set(out) & set(r[key])  # every parameter on one rank
        out.update(r[key])
    return out


# ---- launch 1: 2 ranks


def _two_ranks(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for amp in (False, True):
        tag = "bf16" if amp else "fp32"
        folder = f"{root}/{tag}"
        cfg: dict[str, Any] = {"dropout": 0.3, "balance": TWO, "schedule": "1f1b", "amp": amp}
        plain = Loop(0, **cfg)
        res: dict[str, Any] = {"A": plain.train(0, N), "valA": plain.val(), "final": plain.states()}
        plain.pipe.close()
        saving = Loop(0, **cfg)
        vals: dict[int, float] = {}

        def save_and_validate(t: int, loop: Loop = saving, folder: str = folder, vals: Any = vals) -> None:
            loop.save(folder, t, keep=None)
            vals[t] = loop.val()

        res["B"] = saving.train(0, N, {t: functools.partial(save_and_validate, t) for t in SAVES})
        res["valB"], res["vals"], res["finalB"] = saving.val(), vals, saving.states()
        saving.pipe.close()
        res["resumed"] = {}
        for k in SAVES:
            loop = Loop(100 + k, **cfg)
            path = folder if k == SAVES[-1] else f"{folder}/step-{k:08d}"  # the folder: its latest
            extra = loop.load(path)
            res["resumed"][k] = (extra, loop.train(k, N), loop.val(), loop.states())
            loop.pipe.close()
        out[tag] = res
    # without dropout, for the change of stage count; and the deprecated API's checkpoint of the same state
    loop = Loop(0, dropout=0.0, balance=TWO, schedule="1f1b", amp=False)

    def at_two() -> None:
        loop.save(f"{root}/reshard", 2)
        out["hyper"], out["sched"], out["gathered"] = (
            loop.hyper(),
            loop.sched.state_dict(),
            loop.pipe.gather_state_dict(),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = checkpointing.training_state(loop.pipe.named_parameters(), loop.opt, {"step": 2})
            checkpointing.save(f"{root}/legacy", 2, state)
        out["legacy_warnings"] = [str(w.message) for w in caught if w.category is FutureWarning]

    out["L"], out["valL"] = loop.train(0, N, {2: at_two}), loop.val()
    return out


_TWO = job(2, _two_ranks, make_args=lambda factory: (str(factory.mktemp("ckpt")),), timeout=200.0, batch="b")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    results = _TWO.results(tmp_path_factory)
    return Path(_TWO.args[0]), results  # the folder of the run that gave the results


@pytest.mark.parametrize("tag", ["fp32", "bf16"])
def test_resume_at_every_save_point_is_bit_identical(two: Any, tag: str) -> None:
    root, results = two
    for rank, r in enumerate(results):
        res = r[tag]
        assert res["B"] == res["A"] and res["valB"] == res["valA"], "saving changed the run"
        assert res["finalB"] == res["final"]
        for k, (extra, losses, val, states) in res["resumed"].items():
            label = f"{tag} rank {rank} resumed at step {k}"
            assert extra == {"step": k, "seen": [k, "batches"]}, label
            assert losses == res["A"][k:], label  # every training loss, bit for bit
            assert val == res["valA"], label  # BatchNorm's running statistics came back
            assert states == res["final"], label  # scheduler (and scaler) state at the end
    assert sorted(p.name for p in (root / tag).iterdir()) == ["latest"] + [f"step-{k:08d}" for k in SAVES]
    if tag == "bf16":  # the scale grew during the run (growth_interval 2): its restore was needed
        assert results[0][tag]["final"][1]["scale"] > 2.0**10
        assert results[0]["bf16"]["A"] != results[0]["fp32"]["A"]  # autocast was on


def test_checkpoint_of_two_ranks_loads_into_one_process(two: Any) -> None:
    root, results = two
    whole = _model(0.0)
    opt = _optimizer(whole.named_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    with torch.random.fork_rng():
        extra = checkpointing.load(root / "reshard", pipe=whole, optimizer=opt, lr_scheduler=sched)
    assert extra == {"step": 2, "seen": [2, "batches"]}
    gathered = results[0]["gathered"]
    assert list(whole.state_dict()) == list(gathered)  # buffers too: running stats, num_batches_tracked
    for name, t in whole.state_dict().items():
        assert torch.equal(t, gathered[name]), name
    names = {id(p): n for n, p in whole.named_parameters()}
    hyper = {names[id(p)]: {k: g[k] for k in ("lr", "initial_lr", "weight_decay", "betas", "eps")}
             for g in opt.param_groups for p in g["params"]}  # fmt: skip
    assert hyper == _merged(results, "hyper")
    assert sched.state_dict() == results[0]["sched"]


def test_deprecated_api_still_saves_over_ranks_and_loads_with_a_warning(two: Any) -> None:
    root, results = two
    for r in results:
        assert len(r["legacy_warnings"]) == 2
        assert all(
            "checkpointing.save(folder, step, pipe=pipe, optimizer=optimizer" in w
            for w in r["legacy_warnings"]
        )
    whole = _model(0.0)
    opt = torch.optim.AdamW(whole.parameters())
    with pytest.warns(
        FutureWarning, match=r"call checkpointing\.load\(folder, pipe=pipe, optimizer=optimizer"
    ):
        extras = checkpointing.load(
            root / "legacy" / "step-00000002", whole.named_parameters(), opt, ["step"]
        )
    assert extras == {"step": 2}
    for name, p in whole.named_parameters():
        assert torch.equal(p, results[0]["gathered"][name]), name
    assert all("exp_avg" in opt.state[p] for p in whole.parameters())


# ---- launch 2: 4 ranks resume the 2-rank checkpoints


def _four_ranks(root: str) -> dict[str, Any]:
    loop = Loop(77, dropout=0.0, balance=FOUR, schedule="1f1b", amp=False)
    out: dict[str, Any] = {"extra": loop.load(f"{root}/reshard")}
    out["hyper"], out["sched"] = loop.hyper(), loop.sched.state_dict()
    out["losses"] = loop.train(2, N, {4: lambda: loop.save(f"{root}/reshard4", 4)})
    out["val"] = loop.val()
    loop.pipe.close()
    drop = Loop(78, dropout=0.3, balance=FOUR, schedule="1f1b", amp=False)
    drop.load(f"{root}/fp32/step-00000002")
    out["val_dropout"] = drop.val()
    drop.save(f"{root}/dropout4", 2)
    try:  # extra is saved once: every rank must pass the same
        checkpointing.save(f"{root}/differ", 2, **drop.objects(), extra={"rank": dist.get_rank()})
    except ValueError as exc:
        out["differ"] = str(exc)
    rank = dist.get_rank()
    try:  # a bad argument on one rank: every rank raises, none waits in a collective for it
        checkpointing.save(f"{root}/bad", 2, **drop.objects(), extra=object() if rank == 3 else 1)
    except TypeError as exc:
        out["bad_extra"] = str(exc)
    stranger = [nn.Parameter(torch.ones(2))] if rank == 2 else []
    opt = torch.optim.AdamW([*drop.pipe.parameters(), *stranger])
    try:
        checkpointing.load(f"{root}/dropout4", pipe=drop.pipe, optimizer=opt, lr_scheduler=drop.sched)
    except ValueError as exc:
        out["bad_load"] = str(exc)
    return out


def _after_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str]:
    _TWO.results(tmp_path_factory)  # the 2-rank checkpoints first (their launch, if not run yet)
    return (_TWO.args[0],)


# last in its launch: its failed saves and loads (caught) stay behind
_FOUR = job(4, _four_ranks, make_args=_after_two, timeout=200.0, batch="dp", last=True)


@pytest.fixture(scope="module")
def four(two: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = _FOUR.results(tmp_path_factory)
    assert _FOUR.args[0] == str(two[0])  # it resumed the checkpoints of the results the tests compare
    return results


def test_two_rank_checkpoint_resumes_at_four_ranks(two: Any, four: list[dict[str, Any]]) -> None:
    root, results = two
    assert [r["extra"] for r in four] == [{"step": 2, "seen": [2, "batches"]}] * 4
    # each parameter's group values moved with it (lr and weight decay differ between the groups)
    assert _merged(four, "hyper") == _merged(results, "hyper")
    for r in four:
        assert r["sched"] == results[0]["sched"]  # ranks 2 and 3 have rank 0's, lists from their groups
        assert r["losses"] == results[0]["L"][2:]  # no randomness: the stage count changes nothing
        assert r["val"] == results[0]["valL"]
        assert r["val_dropout"] == results[0]["fp32"]["vals"][2]  # parameters and buffers of the dropout run
        assert r["differ"].startswith(
            'save() got a different extra on rank 1 ({"rank": 1}) than on rank 0 ({"rank": 0})'
        )
    assert not (root / "differ").exists() and not (root / "bad").exists()
    assert four[3]["bad_extra"].startswith("extra must be JSON-able")
    for r in (0, 1, 2):
        assert four[r]["bad_extra"].startswith("rank 3 failed: extra must be JSON-able")
    assert four[2]["bad_load"].startswith(
        "optimizer.param_groups[0]['params'][2] (shape (2,)) is not a parameter"
    )
    for r in (0, 1, 3):
        assert four[r]["bad_load"].startswith(
            "rank 2 failed: optimizer.param_groups[0]['params'][2] (shape (2,))"
        )


# ---- launch 3: back to 2 ranks


def _back_to_two(root: str) -> dict[str, Any]:
    loop = Loop(88, dropout=0.0, balance=FOUR, schedule="interleaved-1f1b", amp=False)  # v = 2
    out: dict[str, Any] = {"extra": loop.load(f"{root}/reshard4")}
    out["losses"], out["val"] = loop.train(4, N), loop.val()
    loop.pipe.close()
    drop = Loop(89, dropout=0.3, balance=TWO, schedule="1f1b", amp=False)
    out["extra_dropout"] = drop.load(f"{root}/dropout4")
    out["losses_dropout"], out["val_dropout"] = drop.train(2, N), drop.val()
    return out


def test_four_rank_checkpoint_resumes_at_two_ranks(
    two: Any, four: list[dict[str, Any]], tmp_path: Path
) -> None:
    root, results = two
    back = run_ranks(tmp_path, _back_to_two, 2, str(root), timeout=200.0)
    for r, first in zip(back, results, strict=True):
        assert r["extra"]["step"] == 4 and r["extra_dropout"]["step"] == 2
        assert r["losses"] == first["L"][4:] and r["val"] == first["valL"]
        # 2 -> 4 -> 2 ranks: ranks 0 and 1 saved their generators again, so the dropout masks go on
        assert r["losses_dropout"] == first["fp32"]["A"][2:], "dropout run after 2 -> 4 -> 2 ranks"
        assert r["val_dropout"] == first["fp32"]["valA"]
