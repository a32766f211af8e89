import sys
from pathlib import Path

import pytest

# Spawned ranks unpickle test functions by module name: make `tests.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Batched rank jobs (tests/dist.py) run only for the modules whose tests were collected."""
    from tests.dist import select_jobs

    select_jobs({item.module.__name__ for item in items if getattr(item, "module", None) is not None})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """With --durations: the time of each rank job in its shared launch (tests/dist.py)."""
    from tests.dist import job_times

    lines = job_times()
    if config.getoption("durations", None) is not None and lines:
        terminalreporter.write_sep("=", "rank jobs in shared launches (slowest rank)")
        for line in lines:
            terminalreporter.write_line(line)
