import sys
from pathlib import Path

import pytest

# Spawned ranks unpickle test functions by module name: make `tests.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Batched rank jobs (tests/dist.py) run only for the modules whose tests were collected."""
    from tests.dist import select_jobs

    select_jobs({item.module.__name__ for item in items if getattr(item, "module", None) is not None})
