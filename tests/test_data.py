from __future__ import annotations

import math
import string
from pathlib import Path

import pytest
import torch

from pipeline.reference.data import (
    CHARS,
    UNKNOWN_ID,
    VOCAB_SIZE,
    CharDataset,
    decode,
    encode,
    stdlib_files,
    text_files,
)


def test_vocabulary_is_printable_ascii_newline_tab_and_one_unknown() -> None:
    expected = set(string.ascii_letters + string.digits + string.punctuation + " \n\t")
    assert set(CHARS) == expected and len(CHARS) == len(expected) == 97
    assert UNKNOWN_ID == 97 and VOCAB_SIZE == 98


def test_encode_decode_round_trip_and_unknowns() -> None:
    text = "def f(x):\n\treturn x ~ 1\n"
    ids = encode(text)
    assert ids.dtype == torch.uint8 and len(ids) == len(text)
    assert decode(ids) == text
    odd = encode("é\r中\x00a")
    assert odd.tolist() == [UNKNOWN_ID] * 4 + [CHARS.index("a")]
    assert decode(odd) == "\ufffd" * 4 + "a"


def test_stdlib_sources_are_found_without_vendored_or_test_folders() -> None:
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "argparse.py", "functools.py"} <= names
    parts = {part for f in files for part in f.parts}
    assert "site-packages" not in parts and "test" not in parts
    assert files == sorted(files)


def test_text_files_of_a_folder_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "b" / "c.md").write_text("world\n")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02")
    (tmp_path / ".hidden").write_text("secret")
    assert [f.relative_to(tmp_path).as_posix() for f in text_files(tmp_path)] == ["a.txt", "b/c.md"]
    assert text_files(tmp_path / "a.txt") == [tmp_path / "a.txt"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_files(tmp_path / "missing")


def test_split_is_nine_to_one_and_covers_the_text(tmp_path: Path) -> None:
    text = "".join(CHARS[i % 95 + 2] for i in range(1000))
    (tmp_path / "t.txt").write_text(text)
    ds = CharDataset.load(tmp_path / "t.txt")
    assert (len(ds.train), len(ds.val)) == (900, 100)
    assert decode(torch.cat([ds.train, ds.val])) == text


def test_batches_are_a_pure_function_of_split_step_and_seed(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("".join(CHARS[i % 97] for i in range(5000)))
    a, b = CharDataset.load(tmp_path), CharDataset.from_files(text_files(tmp_path), str(tmp_path))
    x1, y1 = a.batch("train", 5, 4, 16, seed=0)
    x2, y2 = b.batch("train", 5, 4, 16, seed=0)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(x1, a.batch("train", 6, 4, 16, seed=0)[0])
    assert not torch.equal(x1, a.batch("train", 5, 4, 16, seed=1)[0])
    xv, _ = a.batch("val", 5, 4, 16, seed=0)
    assert all(decode(row) in decode(a.val) for row in xv)


def test_a_source_is_read_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.txt").write_text("abc\n" * 100)
    reads: list[str] = []
    real = CharDataset.from_files

    def counted(files: list[Path], source: str) -> CharDataset:
        reads.append(source)
        return real(files, source)

    monkeypatch.setattr(CharDataset, "from_files", counted)
    first = CharDataset.load(tmp_path / "t.txt")
    (tmp_path / "t.txt").write_text("changed\n" * 100)  # not read again
    assert CharDataset.load(str(tmp_path / ".." / tmp_path.name / "t.txt")) is first  # same resolved path
    assert decode(first.train).startswith("abc") and reads == [str(tmp_path / "t.txt")]
    other = CharDataset.load(tmp_path)  # another source: the folder
    assert other is not first and len(reads) == 2


def test_batches_do_not_use_the_default_device(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("".join(CHARS[i % 97] for i in range(500)))
    ds = CharDataset.load(tmp_path)
    x, y = ds.batch("train", 3, 2, 8, seed=0)
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        xm, ym = ds.batch("train", 3, 2, 8, seed=0)
    finally:
        torch.set_default_device(previous)
    assert xm.device.type == "cpu" and torch.equal(xm, x) and torch.equal(ym, y)


def test_too_little_text_for_the_sequence_length_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("x" * 100)
    ds = CharDataset.load(tmp_path / "t.txt")
    with pytest.raises(ValueError, match=r"validation split .* 10 characters, fewer than seq_len \+ 1 = 33"):
        ds.check(32)
    with pytest.raises(ValueError, match="split must be"):
        ds.batch("test", 0, 1, 4, 0)


def test_stdlib_corpus_unigram_entropy_is_near_but_below_log_vocab() -> None:
    # what "loss starts at ln(V)" is measured against: the data is far from uniform
    ds = CharDataset.load(None)
    counts = torch.bincount(ds.val.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * p.log()).sum())
    assert len(ds.train) > 1_000_000 and 2.5 < entropy < math.log(VOCAB_SIZE)
