import sys
from pathlib import Path

import pytest

# Spawned ranks unpickle test functions by module name: make `tests.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Batched rank jobs (tests/dist.py) run only for the modules whose tests were collected, and
    the launches' fork server imports those modules once: its ranks, which unpickle their functions
    from them, then import none of them (about a second of CPU per rank and per launch)."""
    from pipeline.launch import FORKSERVER_PRELOAD
    from tests.dist import select_jobs

    modules = sorted({item.module.__name__ for item in items if getattr(item, "module", None) is not None})
    select_jobs(set(modules))
    FORKSERVER_PRELOAD.extend(["tests.dist", *(m for m in modules if m.startswith("tests."))])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """With --durations: the time of each rank job in its shared launch (tests/dist.py)."""
    from tests.dist import job_times

    lines = job_times()
    if config.getoption("durations", None) is not None and lines:
        terminalreporter.write_sep("=", "rank jobs in shared launches (slowest rank)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def forked_ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/train.py's launches fork their ranks from the server that imported torch once, as the
    launches of tests/dist.py do (1.5 s less per run): what these tests prove is the script's logic;
    its spawned start is run end to end by test_train's subprocess runs. Not for a test marked
    ``spawned``: it reads its ranks' prints, which forked ranks write where the server's stdout is."""
    if request.node.get_closest_marker("spawned") is not None:
        return
    import functools

    import train  # the modules that use this put scripts/ on sys.path

    from pipeline.launch import launch

    monkeypatch.setattr(train, "launch", functools.partial(launch, start_method="forkserver"))
