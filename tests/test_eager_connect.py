"""Eager connections: nothing NCCL connects inside a step or a checkpoint (issue 42).

NCCL 2.22 and later make a communicator without connecting it: each collective algorithm is
connected at its first use unless ``NCCL_RUNTIME_CONNECT=0``, and each pair of ranks at its first
message, at any setting (``pipeline/nccl_env.py``). Here:

    the environment     ``import pipeline`` sets NCCL_RUNTIME_CONNECT=0 when unset and keeps a
                        user's value; ``nccl_env.check`` warns where NCCL may run lazily (the
                        value is not 0, or torch.distributed had NCCL before the import)
    the emulation       in a call after construction, a collective on a communicator made lazily
                        and a pair's first message raise (one process, stand-in groups)
    the runtime         on 2 and 4 ranks under the emulation, and dp = 2 x 2 ranks (a stage with no
                        tensor: the replicas' group has only the warm-up to make it): step, the
                        optimizer step's companions, predict(dst=) and gather_state_dict to every
                        rank (non-neighbours at p = 4), the timeline gather and a checkpoint's
                        save, resume and load run, and the emulation's records of what is made and
                        connected do not change after construction
    planted lazy paths  a communicator made with NCCL_RUNTIME_CONNECT=1 (the replicas' first
                        all-reduce raises), the non-neighbour pairs skipped (predict(dst=) and
                        gather_state_dict raise), the world's communicator or its pairs with rank
                        0 skipped (a checkpoint's save raises): each named
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipeline import checkpointing, nccl_env
from pipeline.plan import Plan
from pipeline.reference.models import mlp
from pipeline.runtime.comm import channels, emulation, world
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.pipe_common import balance_of

ROOT = Path(__file__).resolve().parent.parent
WIDTH, DEPTH, BATCH = 8, 8, 8
CONFIG = {"run": "eager"}

# ---- the environment


def _imported(env: dict[str, str]) -> list[str]:
    """What a fresh interpreter sees after ``import pipeline``: the variable, the value the user had
    given, and ``check``'s warnings; torch is never imported."""
    code = (
        "import os, sys, warnings\n"
        "import pipeline\n"
        "from pipeline import nccl_env\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    nccl_env.check()\n"
        "print(os.environ.get('NCCL_RUNTIME_CONNECT'), nccl_env.given, 'torch' in sys.modules)\n"
        "print(*[f'{w.category.__name__}: {w.message}' for w in caught])\n"
    )
    clean = {k: v for k, v in os.environ.items() if k != nccl_env.VAR}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_importing_pipeline_sets_eager_connection_when_unset() -> None:
    values, warned = _imported({})
    assert values == "0 None False"
    assert warned == ""


def test_a_users_own_value_stays_and_is_warned_about() -> None:
    values, warned = _imported({nccl_env.VAR: "1"})
    assert values == "1 1 False"
    assert warned.startswith(
        "LazyConnectWarning: NCCL_RUNTIME_CONNECT is '1' in this process (set before pipeline was "
        "imported), not '0': NCCL then connects each collective algorithm"
    )
    assert "Export NCCL_RUNTIME_CONNECT=0 in every rank's environment" in warned
    values, warned = _imported({nccl_env.VAR: "0"})  # the user's 0: nothing to say
    assert (values, warned) == ("0 0 False", "")


def test_the_reasons_to_warn() -> None:
    reason = nccl_env.lazy_reason
    assert reason("0", None, None, None) is None and reason(" 0", "0", None, (2, 26, 2)) is None
    assert reason("1", "1", None, (2, 21, 5)) is None  # NCCL before 2.22 connects when it makes one
    removed = reason(None, None, None, (2, 23, 4))
    assert removed is not None and removed.startswith(
        "NCCL_RUNTIME_CONNECT is unset in this process (removed after import pipeline set it)"
    )
    changed = reason("1", None, None, None)
    assert changed is not None and "'1' in this process (set after pipeline was imported)" in changed
    late = reason(
        "0", None, "init_process_group(device_id=cuda:0) had made the world's NCCL communicator", None
    )
    assert late is not None and late.startswith(
        "pipeline set NCCL_RUNTIME_CONNECT=0 when it was imported, but init_process_group(device_id=cuda:0) "
        "had made the world's NCCL communicator before that, and NCCL reads NCCL_RUNTIME_CONNECT once per "
        "process, at its first communicator"
    )
    assert late.endswith(
        "Import pipeline before init_process_group, or export NCCL_RUNTIME_CONNECT=0 in the launch "
        "environment"
    )
    assert reason("0", "0", "too late", None) is None  # the user's own 0 was there all along


def _c10d(initialised: bool, backend: str, bound: Any) -> dict[str, Any]:
    group = types.SimpleNamespace(bound_device_id=bound)
    module = types.SimpleNamespace(
        is_initialized=lambda: initialised, get_backend=lambda: backend, _get_default_group=lambda: group
    )
    return {"torch.distributed.distributed_c10d": module}


def test_an_nccl_group_made_before_the_import_is_found() -> None:
    found = nccl_env.nccl_initialised
    assert found({}) is None  # torch.distributed never imported: no communicator through torch
    assert found(_c10d(False, "nccl", None)) is None
    assert found(_c10d(True, "gloo", None)) is None
    assert found(_c10d(True, "cpu:gloo,cuda:nccl", "cuda:1")) == (
        "init_process_group(device_id=cuda:1) had made the world's NCCL communicator"
    )
    assert "initialised with NCCL" in str(found(_c10d(True, "nccl", None)))


# ---- the emulation's rules, in one process (stand-in groups: made already, so no rendezvous)


@contextlib.contextmanager
def _made(mode: str | None) -> Iterator[object]:
    """A stand-in group whose communicator the emulation made with NCCL_RUNTIME_CONNECT ``mode``."""
    group = object()
    emulation._made.add(id(group))
    emulation._connect_mode[id(group)] = mode
    try:
        yield group
    finally:
        emulation._made.discard(id(group))
        emulation._connect_mode.pop(id(group), None)
        emulation._pairs.difference_update({k for k in emulation._pairs if k[0] == id(group)})


def test_in_a_call_a_lazily_made_communicator_refuses_collectives() -> None:
    for mode in (None, "1"):
        with _made(mode) as group:
            emulation.collective(group, 4, "the warm-up")  # at construction: connects what it picks
            with emulation.stepping(), pytest.raises(RuntimeError) as info:
                emulation.collective(group, 4, "the loss from rank 1")
            shown = "unset" if mode is None else "'1'"
            assert str(info.value).startswith(
                "NCCL emulation: the loss from rank 1 is a collective inside a step (or another call after "
                f"construction) on a communicator made with NCCL_RUNTIME_CONNECT {shown}"
            )
            assert str(info.value).endswith("(import pipeline does when it is unset)")
    with _made("0") as group, emulation.stepping():
        emulation.collective(group, 4, "the loss from rank 1")  # every algorithm connected when made


def test_in_a_call_a_pairs_first_message_is_refused() -> None:
    with _made("0") as group:
        with (
            emulation.stepping(),
            pytest.raises(
                RuntimeError,
                match=r"^NCCL emulation: the outputs from rank 3 would be the first message from rank 3 to "
                r"rank 1 on its group, inside a step \(or another call after construction\): NCCL connects",
            ),
        ):
            emulation.message(group, 4, 3, 1, "the outputs from rank 3")
        emulation.message(group, 4, 3, 1, "the pair's first message")  # at construction
        with emulation.stepping():
            with emulation.stepping():  # calls nest
                emulation.message(group, 4, 3, 1, "the outputs from rank 3")
            with pytest.raises(RuntimeError, match="first message from rank 1 to rank 3"):  # one way only
                emulation.message(group, 4, 1, 3, "the outputs from rank 1")
        emulation.uses(group, 4, 0, "a gather", [(3, 1), (2, 3)])  # neither pair is this rank's (0)


# ---- the runtime under the emulation: nothing made or connected after construction


def _records() -> tuple[frozenset[int], dict[int, str | None], frozenset[tuple[int, int, int]]]:
    """What the emulation has made and connected in this process."""
    return frozenset(emulation._made), dict(emulation._connect_mode), frozenset(emulation._pairs)


def _build() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model, inputs and targets, the same in every process (seeded)."""
    torch.manual_seed(0)
    model, _ = mlp(width=WIDTH, depth=DEPTH, batch_size=1)
    return model, torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def _calls(folder: str) -> dict[str, Any]:
    """Every call a training loop makes, after construction, on p ranks (1f1b)."""
    p = dist.get_world_size()
    model, x, y = _build()
    plan = Plan(balance=balance_of(DEPTH, p), schedule="1f1b", n_microbatches=4)
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=30.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    made = _records()
    out: dict[str, Any] = {"loss": pipe.step(x, y, record=True)}
    out["norm"], out["finite"] = pipe.clip_grad_norm_(1.0), pipe.grads_finite()
    opt.step()
    opt.zero_grad()
    out["timeline"] = pipe.gather_timeline() is not None
    out["predict"] = [pipe.predict(x, dst=d) for d in range(p)]  # p = 4: 3 -> 1 is no neighbour
    out["evaluate"] = pipe.evaluate(x, y, return_outputs=True, dst=0)
    out["state"] = [pipe.gather_state_dict(d) for d in range(p)]  # p = 4: 2 -> 0 is no neighbour
    checkpointing.save(folder, 1, pipe=pipe, optimizer=opt, config=CONFIG)
    with torch.no_grad():
        for t in pipe.parameters():
            t.zero_()
    resumed = checkpointing.resume(folder, pipe=pipe, optimizer=opt, config=CONFIG)
    out["resumed"] = None if resumed is None else resumed.step
    checkpointing.load(folder, pipe=pipe, optimizer=opt)
    out["after"] = {n: t.detach().clone() for n, t in pipe.named_parameters()}
    out["unchanged"] = _records() == made
    return out


_CALLS = {
    p: job(p, _calls, make_args=lambda f: (str(f.mktemp("eager")),), backend="nccl-emulated", timeout=120.0)
    for p in (2, 4)
}


@pytest.mark.parametrize("p", [2, 4])
def test_every_call_after_construction_makes_and_connects_nothing(
    tmp_path_factory: pytest.TempPathFactory, p: int
) -> None:
    results = _CALLS[p].results(tmp_path_factory)
    assert all(r["unchanged"] for r in results)
    assert len({r["loss"] for r in results}) == 1 and all(r["finite"] for r in results)
    assert [r["timeline"] for r in results] == [True] + [False] * (p - 1)
    state = results[0]["state"][0]
    model, x, _ = _build()
    model.load_state_dict(state)  # the model after one SGD step, from every rank's stages
    model.eval()
    with torch.no_grad():
        want = model(x)
    for d in range(p):
        for r, res in enumerate(results):
            got, state_d = res["predict"][d], res["state"][d]
            if r == d:
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (p, d)
                assert list(state_d) == list(state) and all(torch.equal(state_d[k], state[k]) for k in state)
            else:
                assert got is None and state_d is None, (p, d, r)
    assert torch.allclose(results[0]["evaluate"][1], want, rtol=1e-5, atol=1e-6)
    assert all(r["resumed"] == 1 for r in results)
    after = {k: t for r in results for k, t in r["after"].items()}
    assert set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in after)


def _stateless_stage() -> tuple[nn.Sequential, Plan]:
    """Stage 1 is one ReLU: its ranks broadcast nothing over the replicas at construction."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU())
    return model, Plan(balance=[3, 1], schedule="1f1b", n_microbatches=2, dp=2)


def _replicated(folder: str) -> dict[str, Any]:
    """dp = 2 replicas of 2 ranks: a step, its companions and the state where stage 1 holds no tensor
    (a fresh mesh: its groups are made by this pipeline alone); then a checkpoint of a pipeline whose
    every rank has parameters (an optimizer needs some)."""
    torch.manual_seed(0)
    model, plan = _stateless_stage()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pipe = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, mesh=mesh, timeout=30.0)
    made = _records()
    x, y = torch.randn(2 * BATCH, WIDTH), torch.randn(2 * BATCH, WIDTH)
    rows = slice(pipe.replica * BATCH, (pipe.replica + 1) * BATCH)
    out: dict[str, Any] = {"loss": pipe.step(x[rows], y[rows]), "norm": pipe.clip_grad_norm_(1.0)}
    out["predict"] = pipe.predict(x[rows], dst=0)
    out["state"] = pipe.gather_state_dict(0)
    unchanged = _records() == made
    full, _, _ = _build()
    saved = Pipeline(full, Plan(balance=[4, 4], n_microbatches=2, dp=2), loss_fn=nn.functional.mse_loss)
    made = _records()
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    saved.step(x[rows], y[rows])
    opt.step()
    checkpointing.save(folder, 1, pipe=saved, optimizer=opt, config=CONFIG)
    checkpointing.load(folder, pipe=saved, optimizer=opt)
    out["unchanged"] = unchanged and _records() == made
    return out


_REPLICATED = job(
    4, _replicated, make_args=lambda f: (str(f.mktemp("eagerdp")),), backend="nccl-emulated", timeout=120.0
)


def test_replicas_make_and_connect_nothing_after_construction(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _REPLICATED.results(tmp_path_factory)
    assert all(r["unchanged"] for r in results)
    assert len({r["loss"] for r in results}) == 1 and len({r["norm"] for r in results}) == 1
    for g, res in enumerate(results):  # rank 0 of each replica: global ranks 0 and 2
        assert (res["state"] is not None, res["predict"] is not None) == ((g % 2 == 0,) * 2), g


# ---- planted lazy paths: the emulation names each


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@contextlib.contextmanager
def _forgotten(group: Any, communicator: bool) -> Iterator[None]:
    """As in a process where construction skipped them: the emulation forgets ``group``'s pairs, and
    with ``communicator`` the communicator itself."""
    made, modes, pairs = set(emulation._made), dict(emulation._connect_mode), set(emulation._pairs)
    if communicator:
        emulation._made.discard(id(group))
    emulation._pairs.difference_update({k for k in pairs if k[0] == id(group)})
    try:
        yield
    finally:
        emulation._made.clear()
        emulation._made.update(made)
        emulation._connect_mode.clear()
        emulation._connect_mode.update(modes)
        emulation._pairs.clear()
        emulation._pairs.update(pairs)


def _planted(folder: str) -> dict[str, Any]:
    p = dist.get_world_size()
    model, x, y = _build()
    plan = Plan(balance=balance_of(DEPTH, p), schedule="1f1b", n_microbatches=4)
    Pipeline(model, plan, loss_fn=nn.functional.mse_loss, timeout=20.0).close()  # the world, made eagerly
    out: dict[str, Any] = {}

    # the replicas' and the pipelines' communicators made with NCCL_RUNTIME_CONNECT=1
    lazy, replicated = _stateless_stage()
    os.environ[nccl_env.VAR] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))  # fresh groups
            pipe = Pipeline(lazy, replicated, loss_fn=nn.functional.mse_loss, mesh=mesh, timeout=20.0)
    finally:
        os.environ[nccl_env.VAR] = nccl_env.EAGER
    out["warned"] = [str(w.message) for w in caught if w.category is nccl_env.LazyConnectWarning]
    out["lazy"] = _outcome(lambda: pipe.step(x, y))

    # the first messages between non-neighbours skipped at construction (fresh groups: new pairs)
    real_init = channels.Channels.__init__

    def without_pairs(self: channels.Channels, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.off_channel = []

    channels.Channels.__init__ = without_pairs  # type: ignore[method-assign]
    try:
        to_one = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=dist.new_group(), timeout=20.0)
        gathered = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=dist.new_group(), timeout=20.0)
    finally:
        channels.Channels.__init__ = real_init  # type: ignore[method-assign]
    out["predict"] = _outcome(lambda: to_one.predict(x, dst=1))  # rank 3 -> rank 1
    out["gather"] = _outcome(lambda: gathered.gather_state_dict(0))  # rank 2 -> rank 0

    # the world's communicator, or its pairs with rank 0, skipped at construction
    real_connect = world.connect
    world.connect = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        saving = Pipeline(model, plan, loss_fn=nn.functional.mse_loss, group=dist.new_group(), timeout=20.0)
    finally:
        world.connect = real_connect  # type: ignore[assignment]
    opt = torch.optim.SGD(saving.parameters(), lr=0.1)
    for key, communicator in (("world", True), ("world pairs", False)):
        with _forgotten(dist.group.WORLD, communicator):
            out[key] = _outcome(lambda: checkpointing.save(folder, 1, pipe=saving, optimizer=opt))
    out["saved after"] = _outcome(lambda: checkpointing.save(folder, 1, pipe=saving, optimizer=opt))
    return out


# last in its launch: the planted pipelines fail (on groups of their own)
_PLANTED = job(
    4, _planted, make_args=lambda f: (str(f.mktemp("planted")),), backend="nccl-emulated", timeout=120.0,
    last=True,
)  # fmt: skip


def test_planted_lazy_paths_are_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    results = _PLANTED.results(tmp_path_factory)
    for g, res in enumerate(results):
        assert len(res["warned"]) == 1 and res["warned"][0].startswith(
            "NCCL_RUNTIME_CONNECT is '1' in this process (set after pipeline was imported)"
        ), (g, res["warned"])
        # the first collective of the step: the replicas' rows (rank 1 and 3's group has nothing else)
        assert "is a collective inside a step (or another call after construction) on a communicator " \
            "made with NCCL_RUNTIME_CONNECT '1'" in res["lazy"], (g, res["lazy"])  # fmt: skip
        assert "over replicas" in res["lazy"], (g, res["lazy"])
        world_first = (
            "RuntimeError: NCCL emulation: checkpointing.save on the world group would be the first "
            "operation on its group, inside a step (or another call after construction)"
        )
        assert res["world"].startswith(world_first), (g, res["world"])
        peer = 1 if g == 0 else g
        assert res["world pairs"].startswith(
            f"RuntimeError: NCCL emulation: checkpointing.save on the world group (rank 0 -> rank {peer}) "
            f"would be the first message from rank 0 to rank {peer} on its group, inside a step"
        ), (g, res["world pairs"])
        assert res["saved after"] == "ok", g
    pair = "would be the first message from rank 3 to rank 1 on its group, inside a step"
    assert pair in results[3]["predict"] and pair in results[1]["predict"]
    assert results[0]["predict"] == results[2]["predict"] == "ok"
    pair = "would be the first message from rank 2 to rank 0 on its group, inside a step"
    assert pair in results[0]["gather"] and pair in results[2]["gather"]
