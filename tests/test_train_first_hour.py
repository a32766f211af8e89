"""Issue 45, first-hour rough edges: memory figures printed as ``--memory-limit`` reads them (train.py),
``--plot`` refused at once without matplotlib and ``--model module:function`` found from the working
directory (profile_balance.py, the script with those flags)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from _train_flags import FlagError, blame, megabytes, parse_args  # noqa: E402

from scripts import profile_balance  # noqa: E402

TINY = ["--layers", "2", "--width", "16", "--seq-len", "16", "--batch-size", "8", "--steps", "1"]
RAW_BYTES = re.compile(r"\d{5,}(\.\d+)?")  # 1692096.0, 100000: bytes as the library counts them


# ---- memory figures (train.py)


@pytest.mark.parametrize(
    ("n", "shown"),
    [(29092864.0, "29.1 MB"), (3e8, "300 MB"), (1.5e9, "1.5 GB"), (100_000, "100 KB"), (512, "512 B"),
     (999_999, "1 MB"), (1692096.0, "1.69 MB"), (2e13, "20 TB")],
)  # fmt: skip
def test_megabytes_reads_as_the_flag_takes(n: float, shown: str) -> None:
    assert megabytes(n) == shown


def test_flags_echo_the_limit_as_typed() -> None:
    assert parse_args(["--memory-limit", "300MB"]).flags("memory_limit") == "--memory-limit 300MB"


# the partitioner's two refusals of a limit, worded as it words them (in bytes: its API's unit)
_FIXED = ("memory_limit (100000) is too small: no split into 2 stages fits it; the smallest limit that fits "
          "is 1692096.0; raise memory_limit or use more ranks")  # fmt: skip
_AUTO = ("memory_limit (100000) is too small for every configuration searched; the smallest "
         "memory_limit that fits is 933309.0 bytes per rank (schedule='1f1b', n_microbatches=16, "
         "n_virtual=1)")  # fmt: skip


@pytest.mark.parametrize("message", [_FIXED, _AUTO])
def test_a_memory_error_prints_sizes_not_raw_bytes(message: str) -> None:
    cfg = parse_args([*TINY, "--memory-limit", "100KB"])
    with pytest.raises(FlagError) as err, blame(cfg, "stages", "memory_limit"):
        raise ValueError(message)
    line = str(err.value)
    assert line.startswith("--stages 2 --memory-limit 100KB: memory_limit (100 KB) is too small"), line
    fixed, auto = "fits is 1.69 MB;", "fits is 933 KB per rank (schedule='1f1b', n_microbatches=16,"
    assert fixed in line or auto in line, line
    assert not RAW_BYTES.search(line), line


def test_other_errors_keep_their_numbers() -> None:
    with pytest.raises(FlagError, match="seq_len 100000 "), blame(parse_args(TINY), "seq_len"):
        raise ValueError("seq_len 100000 is longer than the data")


# ---- --plot without matplotlib (profile_balance.py)


def test_plot_without_matplotlib_fails_before_profiling(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    profiled: list[object] = []
    monkeypatch.setattr(profile_balance, "profile", lambda *a, **k: profiled.append(a))
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        profile_balance.main(["--model", "mlp", "--stages", "2", "--plot", "plan.png"])
    assert exit_.value.code == 2 and time.perf_counter() - start < 2.0
    assert profiled == []  # nothing was profiled or split before the refusal
    err = capsys.readouterr().err
    assert "--plot" in err and "pip install matplotlib" in err and "drop --plot" in err


# ---- --model module:function from the working directory (profile_balance.py)

_MODULE = """
from pipeline.reference.models import mlp

def build():
    return mlp(width=8, depth=2, batch_size=2)
"""


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working directory, and sys.path as the test found it afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    yield tmp_path
    for name in ("fh_mymod", "fh_broken"):
        sys.modules.pop(name, None)


def test_model_module_found_in_the_working_directory(in_tmp: Path) -> None:
    (in_tmp / "fh_mymod.py").write_text(_MODULE)
    model, sample = profile_balance.load_model("fh_mymod:build", profile_balance.argparse.ArgumentParser())
    assert isinstance(model, torch.nn.Sequential) and sample.shape[0] == 2


def test_model_not_importable_says_where_it_is_looked_for(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        profile_balance.load_model("fh_missing:build", profile_balance.argparse.ArgumentParser())
    err = capsys.readouterr().err
    assert "no module 'fh_missing'" in err and "working directory" in err and "PYTHONPATH" in err


def test_model_function_missing_is_named(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (in_tmp / "fh_mymod.py").write_text(_MODULE)
    with pytest.raises(SystemExit):
        profile_balance.load_model("fh_mymod:nope", profile_balance.argparse.ArgumentParser())
    assert "has no function 'nope'" in capsys.readouterr().err


def test_model_import_error_inside_the_module_is_its_own(in_tmp: Path) -> None:
    (in_tmp / "fh_broken.py").write_text("import fh_not_installed_anywhere\n")
    with pytest.raises(ModuleNotFoundError, match="fh_not_installed_anywhere"):
        profile_balance.load_model("fh_broken:build", profile_balance.argparse.ArgumentParser())
