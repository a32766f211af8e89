"""``tests/dist.py``'s pytest-xdist groups: modules whose rank jobs share a launch run on one worker."""

from __future__ import annotations

from typing import Any

import pytest

from tests import dist


def _fn_of(module: str) -> Any:
    def fn() -> None: ...

    fn.__module__ = module
    return fn


def test_modules_sharing_any_batch_are_one_group_and_the_others_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [
        dist.Job(2, _fn_of("tests.c"), (), "gloo", 60.0, "a"),
        dist.Job(2, _fn_of("tests.b"), (), "gloo", 60.0, "a"),  # b, c and g share (2, "a")
        dist.Job(2, _fn_of("tests.g"), (), "gloo", 60.0, "a"),
        dist.Job(4, _fn_of("tests.b"), (), "gloo", 60.0, "a"),
        dist.Job(4, _fn_of("tests.d"), (), "gloo", 60.0, "a"),  # d joins them through b's (4, "a")
        dist.Job(2, _fn_of("tests.e"), (), "gloo", 60.0, "e"),  # a batch of its own
        dist.Job(4, _fn_of("tests.x"), (), "gloo", 60.0, "a"),  # not collected: joins nothing
    ]
    monkeypatch.setattr(dist, "_jobs", jobs)
    groups = dist.worker_groups({"tests.b", "tests.c", "tests.d", "tests.e", "tests.f", "tests.g"})
    assert groups == {  # a group is named by its smallest module: the same name on every worker
        "tests.b": "tests.b", "tests.c": "tests.b", "tests.d": "tests.b", "tests.g": "tests.b",
        "tests.e": "tests.e", "tests.f": "tests.f",
    }  # fmt: skip


def test_every_collected_test_has_one_group_shared_with_its_batch_mates(
    request: pytest.FixtureRequest,
) -> None:
    """conftest.py marks each test for ``--dist loadgroup``: one group per test, and the same group
    for every selected module with jobs in one batch (whatever -k or -m left selected)."""
    items = [item for item in request.session.items if getattr(item, "module", None) is not None]
    group_of: dict[str, set[Any]] = {}
    for item in items:
        marks = [mark.args for mark in item.iter_markers("xdist_group")]
        assert len(marks) == 1, (item.nodeid, marks)
        group_of.setdefault(item.module.__name__, set()).add(marks[0])  # type: ignore[attr-defined]
    assert all(len(groups) == 1 for groups in group_of.values()), group_of  # a module is one unit
    for job in dist._jobs:
        mates = {m.module for m in dist._jobs if (m.world_size, m.batch) == (job.world_size, job.batch)}
        marks = set().union(*(group_of[m] for m in mates if m in group_of))
        assert len(marks) <= 1, (job.world_size, job.batch, marks)
