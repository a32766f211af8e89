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


def test_every_collected_test_carries_its_modules_group(request: pytest.FixtureRequest) -> None:
    """conftest.py marks each test with its module's group, for ``--dist loadgroup``."""
    items = [item for item in request.session.items if getattr(item, "module", None) is not None]
    groups = dist.worker_groups({item.module.__name__ for item in items})  # type: ignore[attr-defined]
    for item in items:
        marks = [mark.args for mark in item.iter_markers("xdist_group")]
        assert marks == [(groups[item.module.__name__],)], item.nodeid  # type: ignore[attr-defined]
