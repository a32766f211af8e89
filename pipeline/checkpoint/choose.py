"""Which checkpoint to load: verified against its manifest, the same choice on every rank.

    rank 0    lists the candidates, newest first, and reads their manifests  ──► every rank
    for each candidate, until one passes:
    rank r    checks its share of the files (size, then CRC-32)              ──► every rank (all-gather)
              every rank sees every rank's findings: all accept, or all reject and try the next

A folder of checkpoints falls back past a damaged one, with a warning that
names what was rejected and why, and which one is loaded instead; a single
step's folder is loaded or refused, never replaced by another. No rank reads
the folder's listing or a manifest on its own, and no rank decides on its own
findings: a file one rank sees damaged (a stale cache, a failing mount) is
rejected for all, so no two ranks ever load different steps.

A checkpoint without a manifest is one written before manifests existed
(dcp's ``.metadata`` has no ``integrity`` entry): it loads with a warning that
it cannot be verified. One whose ``.metadata`` has that entry lost its manifest.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemReader

from pipeline.checkpoint import manifest, ranks
from pipeline.checkpoint.folder import candidates, read_manifest
from pipeline.checkpoint.manifest import Manifest

__all__ = ["INTEGRITY", "CheckpointFallbackWarning", "Chosen", "CorruptCheckpoint", "choose", "is_checkpoint"]

INTEGRITY = "integrity"  # the dcp entry every checkpoint written with a manifest holds


class CorruptCheckpoint(ValueError):
    """No checkpoint that can be loaded: each one's damaged or missing files are named."""


class CheckpointFallbackWarning(UserWarning):
    """A newer checkpoint was damaged: an older complete one is loaded instead."""


@dataclass(frozen=True)
class Chosen:
    """The checkpoint to load, its manifest (None: written before manifests), and what was passed over."""

    path: Path
    manifest: Manifest | None
    rejected: list[tuple[Path, str]] = field(default_factory=list)


def is_checkpoint(path: Path) -> bool:
    """``path`` is one checkpoint (rather than a folder of them)."""
    return (path / manifest.NAME).is_file() or (path / ".metadata").is_file()


def choose(path: Path) -> Chosen | None:
    """The newest checkpoint in ``path`` (a folder) that verifies, or ``path`` itself (one checkpoint)
    when it verifies; None when there is none at all; a CorruptCheckpoint when none verifies."""
    error: OSError | None = None
    listed: list[tuple[str, str | None, str | None]] = []
    if ranks.rank() == 0:
        try:
            one = is_checkpoint(path)
            for p in [path] if one else candidates(path):
                m = read_manifest(p)  # shared as text: (folder, manifest JSON, what is wrong with it)
                listed.append(
                    (
                        str(p),
                        m.to_json() if isinstance(m, Manifest) else None,
                        m if isinstance(m, str) else None,
                    )
                )
        except OSError as exc:
            error = exc
    shared = ranks.from_rank0(error, listed)
    if not shared:
        return None
    rejected: list[tuple[Path, str]] = []
    for name, text, damage in shared:
        folder = Path(name)
        found = manifest.parse(text, folder / manifest.NAME) if text is not None else damage
        wrong = _verify(folder, found)
        if wrong is None:
            chosen = Chosen(folder, found if isinstance(found, Manifest) else None, rejected)
            _warn(chosen, len(shared) > 1)
            return chosen
        rejected.append((folder, wrong))
    lines = "\n  ".join(f"{str(p)!r}: {why}" for p, why in rejected)
    what = (
        f"checkpoint {str(path)!r} cannot"
        if len(shared) == 1 and shared[0][0] == str(path)
        else (f"no checkpoint in {str(path)!r} can")
    )
    raise CorruptCheckpoint(
        f"{what} be loaded:\n  {lines}\nrestore the damaged files from a copy, "
        "or start the run afresh in another folder"
    )


def _verify(folder: Path, found: Manifest | str | None) -> str | None:
    """What is wrong with ``folder`` (the same text on every rank), or None when it is sound."""
    if isinstance(found, str):  # the manifest itself is damaged (rank 0 read it)
        return found
    mine: list[str] = []
    if found is None:
        if ranks.rank() == 0:
            mine = _without_manifest(folder)
    else:
        mine = manifest.problems(
            folder, found, manifest.share(list(found.files), ranks.rank(), ranks.world())
        )
    wrong = sorted(w for share in ranks.together(None, mine) for w in share)
    return "; ".join(wrong) if wrong else None


def _without_manifest(folder: Path) -> list[str]:
    try:
        meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # pickle raises anything on a damaged file
        return [f".metadata: unreadable ({type(exc).__name__}: {str(exc)[:200]})"]
    if INTEGRITY in meta:
        return [f"{manifest.NAME}: missing (the checkpoint was written with one)"]
    return []


def _warn(chosen: Chosen, several: bool) -> None:
    if ranks.rank() != 0:
        return  # every rank made the same choice: one warning
    if chosen.manifest is None:
        warnings.warn(
            f"checkpoint {str(chosen.path)!r} has no {manifest.NAME} (it was written by an older stagewise): "
            "its files cannot be verified; it is loaded as it is",
            CheckpointFallbackWarning if chosen.rejected else UserWarning,
            stacklevel=4,
        )
    if chosen.rejected and several:
        why = "; ".join(f"{str(p)!r} ({reason})" for p, reason in chosen.rejected)
        step = f" (step {chosen.manifest.step})" if chosen.manifest is not None else ""
        warnings.warn(
            f"checkpoint rejected: {why}; loading {str(chosen.path)!r}{step}, the newest complete checkpoint "
            "before it, instead",
            CheckpointFallbackWarning,
            stacklevel=4,
        )
