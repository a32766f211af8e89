"""The folder of checkpoints: atomic writes, the ``latest`` pointer, and ``keep``.

    folder/.tmp-step-00000100   every rank writes here (``write_into``), then a barrier
    folder/.old-step-00000100   rank 0 moves an earlier save of the same step aside
    folder/step-00000100        rank 0 renames the finished folder into place
    folder/latest               then points here (a temporary file + os.replace)
                                then removes all but the newest ``keep`` (never this one)

A crash at any moment leaves ``latest`` naming a complete checkpoint (one
with dcp's ``.metadata``): the new one, or the one it named before
(``latest()`` finds a step moved aside). Steps sort by number, not by name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline.checkpoint import ranks

__all__ = ["LATEST", "complete", "latest", "resolve", "write"]

LATEST = "latest"
_PREFIX = "step-"
_OLD = ".old-"  # a step's previous checkpoint while the step is saved again


def write(root: Path, step: int, keep: int | None, write_into: Callable[[Path], None]) -> Path:
    """Checkpoint ``step`` in ``root``, written by ``write_into(folder)`` on every rank; its folder."""
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{_PREFIX}{step:08d}"
    if ranks.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    ranks.barrier()
    write_into(tmp)
    ranks.barrier()
    if ranks.rank() == 0:
        old = root / f"{_OLD}{final.name}"
        if final.exists():  # saving a step again, e.g. after resuming from it
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        with pointer.open("w") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)
        for stale in root.glob(f"{_OLD}*"):  # this save's, and any a crash left behind
            shutil.rmtree(stale, ignore_errors=True)
        if keep is not None:
            others = [p for p in complete(root) if p != final]
            for stale in others[: max(0, len(others) - (keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
    ranks.barrier()
    return final


def _step_of(path: Path) -> int | None:
    digits = path.name[len(_PREFIX) :]
    return int(digits) if path.name.startswith(_PREFIX) and digits.isdigit() else None


def complete(root: Path) -> list[Path]:
    """Finished checkpoints (with dcp's metadata file), oldest step first."""
    found = [p for p in root.glob(f"{_PREFIX}*") if _step_of(p) is not None and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: _step_of(p) or 0)


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None.

    A crash while a step is saved again, between moving its previous folder
    aside and moving the new one into place, leaves only ``.old-step-...``:
    that previous folder is then the one ``latest`` means.
    """
    root = Path(folder)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        for named in (root / name, root / f"{_OLD}{name}"):
            if (named / ".metadata").is_file():
                return named
    found = complete(root)
    return found[-1] if found else None


def resolve(path: Path) -> Path:
    """``path`` if it is one checkpoint, else the latest in it, else a FileNotFoundError."""
    if (path / ".metadata").is_file():
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"no complete checkpoint in {str(path)!r}; pass a folder that save() wrote into, or one "
            "step folder in it (check checkpointing.latest(folder) before loading)"
        )
    return found
