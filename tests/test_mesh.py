"""The ("dp", "pp") mesh: the rank layout, and a caller's mesh or world that does not fit the plan."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.runtime.replicas.mesh import (
    DIMS,
    build_mesh,
    check_mesh,
    check_world,
    layout_of,
    layout_table,
)
from tests.dist import job


def _error(fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _same_groups(a: DeviceMesh, b: DeviceMesh) -> bool:
    return all(a.get_group(name) is b.get_group(name) for name in DIMS) and a.mesh.tolist() == b.mesh.tolist()


def _on_four_ranks() -> dict[str, Any]:
    mesh = build_mesh(2, 2, "cpu")
    layout = layout_of(mesh)
    out: dict[str, Any] = {
        "layout": (layout.replica, layout.pp_rank, layout.pipeline, layout.replicas, layout.pipelines),
        "cached": _same_groups(build_mesh(2, 2, "cpu"), mesh),
        "ok": _error(check_mesh, mesh, 2, 2),
        "not a mesh": _error(check_mesh, "mesh", 2, 2),
        "wrong size": _error(check_mesh, mesh, 1, 2),
        "wrong p": _error(check_mesh, mesh, 4, 1),
    }
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "pipe"))
    out["wrong names"] = _error(check_mesh, named, 2, 2)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out["one dim"] = _error(check_mesh, flat, 2, 2)
    sub = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("dp", "pp"), _init_backend=False)
    out["not the world"] = _error(check_mesh, sub, 1, 2)
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # mesh[pp][dp]
    lay = layout_of(check_mesh(swapped, 2, 2))
    out["swapped"] = (lay.replica, lay.pp_rank, lay.pipeline)
    return out


_ON_FOUR_RANKS = job(4, _on_four_ranks, timeout=60.0)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _ON_FOUR_RANKS.results(tmp_path_factory)


def test_pp_is_innermost_so_a_pipeline_s_ranks_are_adjacent(results: list[dict[str, Any]]) -> None:
    for g, res in enumerate(results):
        d, r = divmod(g, 2)
        assert res["layout"] == (d, r, [2 * d, 2 * d + 1], [r, 2 + r], [[0, 1], [2, 3]])
        assert res["cached"] and res["ok"] == "ok"
        # dims given the other way round: the "pp" groups are then the columns
        assert res["swapped"] == (r, d, [r, r + 2])
    assert layout_table(2, 2).splitlines()[1:] == [
        "   0        0        0  0",
        "   1        0        1  1",
        "   2        1        0  0",
        "   3        1        1  1",
    ]


def test_a_mesh_that_does_not_fit_says_what_to_change(results: list[dict[str, Any]]) -> None:
    res = results[0]
    assert res["not a mesh"].startswith("TypeError: mesh must be a torch.distributed.device_mesh.DeviceMesh")
    assert res["wrong size"].startswith(
        "ValueError: mesh has dp=2, pp=2 but the plan is for dp=1 replicas of 2 ranks"
    )
    assert "plan.replace(dp=2)" in res["wrong size"]
    assert res["wrong p"].startswith("ValueError: mesh has dp=2, pp=2 but the plan is for dp=4 replicas of 1")
    for key in ("wrong names", "one dim"):
        assert "needs exactly two named 'dp' (replicas) and 'pp'" in res[key], res[key]
    assert "('data', 'pipe')" in res["wrong names"]
    assert res["not the world"].startswith(
        "ValueError: mesh {'dp': 1, 'pp': 2} has 2 ranks but the world has 4"
    )


def test_a_world_that_is_not_dp_pipelines() -> None:
    with pytest.raises(ValueError, match=r"the world has 5 ranks, not a multiple of the plan's 2 ranks per"):
        check_world(5, 2, 2)
    with pytest.raises(ValueError, match=r"dp=2 replicas of 2 ranks \(4 ranks\) but the world has 6; make "
                                         r"the plan with dp=3 \(plan.replace\(dp=3\)\)"):  # fmt: skip
        check_world(6, 2, 2)
    check_world(4, 2, 2)


def test_a_mesh_ends_with_the_world_it_was_made_for(tmp_path: Path) -> None:
    """The cache holds a world's meshes only while that world lives: destroying it frees them (and
    with them their groups' gloo threads, not kept until the interpreter finalizes), and a world made
    again gets meshes of its own, whose groups work."""
    gc.disable()  # freed with the world's last reference, not by a collection
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "one"), 1), rank=0, world_size=1)
        try:
            mesh = build_mesh(1, 1, "cpu")
            assert _same_groups(build_mesh(1, 1, "cpu"), mesh)  # made once while the world lives
            groups = [weakref.ref(mesh.get_group(name)) for name in DIMS]
            del mesh
        finally:
            dist.destroy_process_group()
        assert [ref() for ref in groups] == [None, None]
    finally:
        gc.enable()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "two"), 1), rank=0, world_size=1)
    try:
        ones = torch.ones(2)
        dist.all_reduce(ones, group=build_mesh(1, 1, "cpu").get_group("dp"))
        assert ones.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
