"""Reference data: character-level text for the scripts, tests and examples.

Importable by users (``from pipeline.reference.data import CharDataset``), but
not part of the runtime: nothing in ``pipeline.runtime`` or ``pipeline.schedules``
depends on it.

    # B: batch, T: time (sequence), N: characters in a split

    ds = CharDataset.load(None)                       # the Python standard library's sources
    x, y = ds.batch("train", step=7, batch_size=16, seq_len=128, seed=0)   # (B, T), (B, T)

A source is read once per process: ``CharDataset.load`` keeps what it loaded,
by resolved path, so a script that checks the data and then trains on it reads
the files once.

The vocabulary is fixed, so every rank and every checkpoint agree on it without
reading the data: tab, newline and the 95 printable ASCII characters (space to
``~``), plus one unknown symbol (id 97) that every other character maps to.
Batches are a pure function of (split, step, seed): resuming at step k draws the
very batches an uninterrupted run would have drawn, with no data-loader state.
"""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "CHARS",
    "UNKNOWN_ID",
    "VOCAB_SIZE",
    "CharDataset",
    "decode",
    "encode",
    "stdlib_files",
    "text_files",
]

CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN_ID = len(CHARS)  # 97: any character outside CHARS
VOCAB_SIZE = len(CHARS) + 1
_UNKNOWN_TEXT = "\ufffd"  # how decode shows the unknown symbol

# code point (< 128) -> id; everything else is unknown
_TABLE = np.full(128, UNKNOWN_ID, dtype=np.uint8)
_TABLE[[ord(c) for c in CHARS]] = np.arange(len(CHARS), dtype=np.uint8)

# folders of the standard library that are not representative source (vendored
# packages, test data with odd encodings, generated codec tables, pydoc's generated help text)
_SKIP_PARTS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)
_VAL_FRACTION = 0.1
_SHUFFLE_SEED = 1234  # fixed: the split must not depend on the training seed


def encode(text: str) -> torch.Tensor:
    """Text -> ids (N,) uint8; characters outside the vocabulary become ``UNKNOWN_ID``."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.where(points < 128, _TABLE[np.minimum(points, 127)], UNKNOWN_ID).astype(np.uint8)
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Ids -> text; the unknown symbol (and any id out of range) shows as U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(CHARS[i] if 0 <= i < len(CHARS) else _UNKNOWN_TEXT for i in values)


def stdlib_files() -> list[Path]:
    """The standard library's own ``.py`` files, found through ``sysconfig``, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_PARTS and not d.startswith(".")]  # prune the walk
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(
            f"no .py files under the standard library folder {root}; "
            "pass CharDataset.load the path of a text file or folder instead of None"
        )
    return sorted(files)


def _is_text(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" not in f.read(4096)


def text_files(path: str | os.PathLike[str]) -> list[Path]:
    """A text file, or every text file (no NUL byte in its head) under a folder, sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"data path {str(p)!r} does not exist; pass a text file or a folder of them")
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts) and _is_text(f)
    )
    if not files:
        raise FileNotFoundError(f"data folder {str(p)!r} holds no text files")
    return files


class CharDataset:
    """Train and validation ids (N,) uint8, with batches drawn deterministically by step."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, source: str) -> None:
        self.train = train
        self.val = val
        self.source = source

    @classmethod
    def from_files(cls, files: list[Path], source: str) -> CharDataset:
        """Files are shuffled with a fixed seed, then the last tenth of the characters is validation.

        Shuffling first makes both splits a mix of all sources instead of the
        alphabetically last ones; a single file is split by position.
        """
        order = list(files)
        random.Random(_SHUFFLE_SEED).shuffle(order)
        text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in order)
        ids = encode(text)
        n_val = int(len(ids) * _VAL_FRACTION)
        return cls(ids[: len(ids) - n_val], ids[len(ids) - n_val :], source)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> CharDataset:
        """``path`` None: the standard library's sources; else a text file or folder.

        Read once per process: a later call for the same source (the same
        resolved path) returns the same dataset, and files changed since are
        not read again (``from_files`` always reads).
        """
        key = None if path is None else str(Path(path).resolve())
        if key not in _LOADED:
            if path is None:
                _LOADED[key] = cls.from_files(stdlib_files(), "python standard library")
            else:
                _LOADED[key] = cls.from_files(text_files(path), os.fspath(path))
        return _LOADED[key]

    def check(self, seq_len: int) -> None:
        """Both splits must hold at least one window of ``seq_len + 1`` characters."""
        for name, ids in (("train", self.train), ("validation", self.val)):
            if len(ids) < seq_len + 1:
                raise ValueError(
                    f"the {name} split of {self.source!r} has {len(ids)} characters, fewer than "
                    f"seq_len + 1 = {seq_len + 1}; use more text or a smaller seq_len"
                )

    def batch(
        self, split: str, step: int, batch_size: int, seq_len: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets (B, T) int64, a pure function of the arguments."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        ids = self.train if split == "train" else self.val
        self.check(seq_len)
        g = torch.Generator().manual_seed(_mix(seed, step, split == "val"))
        # on the data's device, whatever the default device is (the generator is a CPU one)
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=g, device=ids.device)  # (B,)
        window = ids[starts[:, None] + torch.arange(seq_len + 1, device=ids.device)].long()  # (B, T + 1)
        return window[:, :-1], window[:, 1:]


_LOADED: dict[str | None, CharDataset] = {}  # resolved source path (None: stdlib) -> its dataset


def _mix(seed: int, step: int, val: bool) -> int:
    """One generator seed per (seed, step, split), far apart for nearby inputs."""
    return (seed * 1_000_003 + step * 2 + int(val)) % (2**63 - 1)
