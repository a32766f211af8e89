import sys
from pathlib import Path

# Spawned ranks unpickle test functions by module name: make `tests.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
