"""The folder of checkpoints: atomic writes with a manifest, the ``latest`` pointer, and ``keep`` per run.

    folder/.tmp-step-00000100   every rank writes its data here (``write_into``)
                                every rank digests its share of the files (manifest.py)
                                rank 0 writes manifest.json (temporary file, fsync, rename)
    folder/.old-step-00000100   rank 0 moves an earlier save of the same step (of this run) aside
    folder/step-00000100        rank 0 renames the finished folder into place (then fsyncs the folder)
    folder/latest               then points here (a temporary file + os.replace)
                                then removes this run's checkpoints beyond ``keep`` (never this one,
                                never another run's: each manifest names its run)

A crash at any moment leaves a complete checkpoint for ``latest`` (one with
its manifest, or dcp's ``.metadata`` for one written before manifests): the
new one, or the one before (``latest()`` finds a step moved aside). A failure
on any rank (a full disk, an unreadable file) is raised on every rank, naming
the path and the errno; rank 0 then removes the unfinished folder, and the
checkpoints already there stay as they were.

Order: ``latest`` names the checkpoint written last; the others follow by
their manifests' ``serial`` (the order of writing, whatever the step numbers:
a run resumed from an older step writes lower steps after higher ones), then
by step for those without a manifest.
"""

from __future__ import annotations

import errno as _errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from pipeline.checkpoint import manifest, ranks
from pipeline.checkpoint.manifest import Manifest

__all__ = ["LATEST", "candidates", "complete", "latest", "read_manifest", "write"]

LATEST = "latest"
_PREFIX = "step-"
_OLD = ".old-"  # a step's previous checkpoint while the step is saved again


def write(
    root: Path,
    step: int,
    keep: int | None,
    write_into: Callable[[Path], None],
    run_id: str,
    config: dict[str, Any] | None,
) -> Path:
    """Checkpoint ``step`` of run ``run_id`` in ``root``, written by ``write_into(folder)`` on every rank."""
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{_PREFIX}{step:08d}"
    error, serial = None, 0
    if ranks.rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
            _refuse_another_runs(final, run_id)
            serials = [m.serial for m in map(read_manifest, _folders(root)) if isinstance(m, Manifest)]
            serial = 1 + max(serials, default=0)
        except OSError as exc:
            error = _failed(exc, step, root, ranks.rank())
        except ValueError as exc:
            error = exc
    serial = ranks.from_rank0(error, serial)
    try:
        write_into(tmp)
    except (CheckpointException, OSError) as exc:  # dcp raises the same on every rank
        _discard(tmp)
        raise _failed(exc, step, root, ranks.rank()) from exc
    error, names, digests = None, [], {}
    try:
        names = manifest.listing(tmp) if ranks.rank() == 0 else []
    except OSError as exc:
        error = _failed(exc, step, root, 0)
    names = ranks.from_rank0(error, names)
    try:
        digests = {
            n: manifest.digest_file(tmp / n) for n in manifest.share(names, ranks.rank(), ranks.world())
        }
    except OSError as exc:
        error = _failed(exc, step, root, ranks.rank())
    shares = _gathered(error, digests, tmp)
    error = None
    if ranks.rank() == 0:
        files = {n: d for share in shares for n, d in share.items()}
        try:
            manifest.write(tmp, Manifest(step, run_id, serial, config, files))
            _move_into_place(root, tmp, final)
        except OSError as exc:
            _discard(tmp)
            error = _failed(exc, step, root, 0)
        if error is None:
            try:
                _point_latest(root, final)
                _prune(root, final, run_id, keep)
            except OSError as exc:  # the checkpoint is in place; ``latest`` may still name the one before
                error = OSError(exc.errno, f"checkpoint {str(final)!r} is saved, but updating {LATEST!r} or "
                                f"removing older checkpoints failed: {exc}")  # fmt: skip
    ranks.together(error, None)
    return final


def _gathered(error: Exception | None, digests: dict[str, tuple[int, int]], tmp: Path) -> list[Any]:
    try:
        return ranks.together(error, digests)
    except OSError:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    if ranks.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs back


def _failed(exc: BaseException, step: int, root: Path, rank: int) -> Exception:
    """A clear error for a save that failed: the path, the errno, and that older checkpoints are intact."""
    cause: BaseException = exc
    if isinstance(exc, CheckpointException):  # dcp's: {rank: (exception, traceback)} of the ranks that failed
        rank, (cause, _) = next(iter(exc.failures.items()))
    before = latest(root)
    kept = (
        f"the previous checkpoint {str(before)!r} is intact" if before else "no earlier checkpoint was there"
    )
    where = getattr(cause, "filename", None) or str(root / f".tmp-{_PREFIX}{step:08d}")
    if isinstance(cause, OSError) and cause.errno is not None:
        code = _errno.errorcode.get(cause.errno, str(cause.errno))
        return OSError(
            cause.errno,
            f"checkpoint step {step} was not saved: {cause.strerror} ({code}) writing {str(where)!r} on rank "
            f"{rank}; {kept}; free space (or save with a lower keep) and save again",
        )
    first = str(cause).splitlines()[0] if str(cause) else ""
    return RuntimeError(
        f"checkpoint step {step} was not saved: {type(cause).__name__}: {first}"
        f" writing {str(where)!r} on rank {rank}; {kept}"
    )


def _refuse_another_runs(final: Path, run_id: str) -> None:
    found = read_manifest(final)
    if isinstance(found, Manifest) and found.run_id != run_id:
        raise ValueError(
            f"{str(final)!r} is a checkpoint of another run ({found.run_id}); this save belongs to run "
            f"{run_id}: save into another folder, or resume that run (checkpointing.resume) to go on with it"
        )


def _move_into_place(root: Path, tmp: Path, final: Path) -> None:
    old = root / f"{_OLD}{final.name}"
    if final.exists():  # saving a step again, e.g. after resuming from it
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    manifest.fsync_dir(root)


def _point_latest(root: Path, final: Path) -> None:
    pointer = root / f".{LATEST}.tmp"
    with pointer.open("w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    manifest.fsync_dir(root)


def _prune(root: Path, final: Path, run_id: str, keep: int | None) -> None:
    for stale in root.glob(f"{_OLD}*"):  # superseded copies: this save's, or a crash's
        if (root / stale.name[len(_OLD) :]).exists():
            shutil.rmtree(stale, ignore_errors=True)
    if keep is None:
        return
    ours = [p for p in candidates(root) if p != final and _run_of(p) == run_id]  # newest first
    for stale in ours[keep - 1 :]:
        shutil.rmtree(stale, ignore_errors=True)


def _run_of(path: Path) -> str | None:
    found = read_manifest(path)
    return found.run_id if isinstance(found, Manifest) else None


def _step_of(path: Path) -> int | None:
    name = path.name.removeprefix(_OLD)
    digits = name[len(_PREFIX) :]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


def read_manifest(path: Path) -> Manifest | str | None:
    """``path``'s manifest; None when it has none; what is wrong (text) when it is damaged."""
    try:
        return manifest.read(path)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        return str(exc)


def _complete(path: Path) -> bool:
    return (path / manifest.NAME).is_file() or (path / ".metadata").is_file()


def _folders(root: Path) -> list[Path]:
    """Step folders (and steps moved aside whose folder is gone) that finished writing, in any order."""
    found = [p for p in root.glob(f"{_PREFIX}*") if _step_of(p) is not None and _complete(p)]
    found += [
        p for p in root.glob(f"{_OLD}{_PREFIX}*")
        if _step_of(p) is not None and _complete(p) and not (root / p.name[len(_OLD) :]).exists()
    ]  # fmt: skip
    return found


def candidates(root: Path) -> list[Path]:
    """The complete checkpoints in ``root``, newest first: the one ``latest`` names, then by serial."""

    def order(path: Path) -> tuple[int, int]:
        found = read_manifest(path)
        return (found.serial if isinstance(found, Manifest) else -1, _step_of(path) or 0)

    found = sorted(_folders(root), key=order, reverse=True)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        for named in (root / name, root / f"{_OLD}{name}"):
            if named in found:
                found.remove(named)
                return [named, *found]
    return found


def complete(root: Path) -> list[Path]:
    """The complete checkpoints in ``root``, oldest first (see ``candidates``)."""
    return candidates(root)[::-1]


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None (nothing is verified).

    A crash while a step is saved again, between moving its previous folder
    aside and moving the new one into place, leaves only ``.old-step-...``:
    that previous folder is then the one ``latest`` means.
    """
    found = candidates(Path(folder))
    return found[0] if found else None
