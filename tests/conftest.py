import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Spawned ranks unpickle test functions by module name: make `tests.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Before the plain hooks (xdist's reads the marks): each test's pytest-xdist group (tests/dist.py
    worker_groups), so that modules whose rank jobs share a launch run on one worker. After them
    (after -k / -m deselection): batched rank jobs run only for the modules whose tests were
    collected, and the launches' fork server imports those modules once: its ranks, which unpickle
    their functions from them, then import none of them (about a second of CPU per rank and per
    launch)."""
    from pipeline.launch import FORKSERVER_PRELOAD
    from tests.dist import select_jobs, worker_groups

    groups = worker_groups({_module(item) for item in items} - {""})
    for item in items:
        if _module(item):
            item.add_marker(pytest.mark.xdist_group(groups[_module(item)]))
    yield
    modules = sorted({_module(item) for item in items} - {""})
    select_jobs(set(modules))
    FORKSERVER_PRELOAD.extend(["tests.dist", *(m for m in modules if m.startswith("tests."))])
    gc.freeze()  # the imported modules and the collected tests: no later collection scans them again


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else ""


_worker_job_times: list[str] = []  # under pytest-xdist: the job times each worker sent at its end


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand this worker's job times to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from tests.dist import job_times

        workeroutput["job_times"] = job_times()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """In pytest-xdist's controller: a worker finished; keep the job times it sent."""
    _worker_job_times.extend(getattr(node, "workeroutput", {}).get("job_times", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """With --durations: the time of each rank job in its shared launch (tests/dist.py)."""
    if config.getoption("durations", None) is None:
        return
    lines = list(_worker_job_times)
    if "tests.dist" in sys.modules:  # this process ran tests (not pytest-xdist's controller, which
        from tests.dist import job_times  # never imports torch)

        lines = job_times() + lines
    if lines:
        terminalreporter.write_sep("=", "rank jobs in shared launches (slowest rank)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def forked_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/train.py's launches fork their ranks from the server that imported torch once, as the
    launches of tests/dist.py do (1.5 s less per run): what these tests prove is the script's logic;
    its spawned start is run end to end by test_train's subprocess runs. Forked ranks print where the
    test's stdout and stderr are at the launch (``capfd`` reads them), as spawned ones do."""
    import functools

    import train  # the modules that use this put scripts/ on sys.path

    from pipeline.launch import launch

    monkeypatch.setattr(train, "launch", functools.partial(launch, start_method="forkserver"))
