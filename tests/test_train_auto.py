"""``scripts/train.py --schedule auto --memory-limit SIZE``: the partitioner's search wired into the script.

The flags (sizes such as 300MB, what auto refuses), the plan it makes and what the rest of the run
takes from it (the plan's schedule, m, v and recomputation, never the flags' "auto"), what the
checkpoints record (the request, and the plan chosen), the rule that a restart reuses the recorded
plan rather than searching again, and (``-m slow``) a run of it on 2 ranks that is restarted.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the ranks find `train` through the sys.path they inherit

import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_ranks")  # ranks forked, not spawned: conftest.py
from _train_flags import FlagError, parse_args, recorded_plan, run_config  # noqa: E402

from pipeline.checkpoint import manifest  # noqa: E402
from pipeline.plan import Plan  # noqa: E402

# 2 blocks + embedding, norm, head = 5 layers; unconstrained the search picks m = 1 or 2 with
# peaks of ~0.2-0.3 MB per rank, so 200KB makes it trade micro-batches and recomputation for memory
TINY = ["--layers", "2", "--width", "16", "--seq-len", "16", "--batch-size", "8"]
LIMIT = "200KB"
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Profile as ``main`` does (one thread, as each rank runs): on shared cores more threads make
    the profile noisy, and its adaptive repeats slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("text", "size"),
    [("300MB", 300_000_000), ("1.5GB", 1_500_000_000), ("512MiB", 512 * 2**20), ("300000000", 300_000_000),
     ("3e8", 300_000_000), (" 2 kb ", 2000), ("64B", 64), ("0.5KiB", 512)],
)  # fmt: skip
def test_memory_limit_sizes(text: str, size: int) -> None:
    assert parse_args(["--memory-limit", text]).memory_limit == size


def test_auto_defaults() -> None:
    fixed = parse_args([])
    assert (fixed.schedule, fixed.microbatches, fixed.recompute) == ("1f1b", 4, "never")
    assert fixed.memory_limit is None
    assert not fixed.auto
    auto = parse_args(["--schedule", "auto"])
    assert auto.microbatches == "auto" and auto.recompute == "never" and auto.auto
    assert parse_args(["--schedule", "auto", "--microbatches", "2"]).microbatches == 2
    m_only = parse_args(["--microbatches", "auto"])
    assert m_only.schedule == "1f1b" and m_only.auto


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-limit", "300XB"],
         "argument --memory-limit: '300XB' is not a memory size; give bytes per rank: 300MB, 1.5GB, 512MiB"),
        (["--memory-limit=-5MB"], "'-5MB' is not a memory size"),  # argparse: "=" for a leading "-"
        (["--memory-limit", "lots"], "KiB, MiB, GiB, TiB (powers of 1024)"),
        (["--memory-limit", "0"], "argument --memory-limit: '0' is 0 bytes: a limit must be at least 1 byte"),
        (["--microbatches", "many"], "--microbatches: must be an integer >= 1 or 'auto', got 'many'"),
        (["--microbatches", "0"], "argument --microbatches: must be an integer >= 1 or 'auto', got '0'"),
        (["--schedule", "auto", "--recompute", "always"],
         "--schedule auto --microbatches auto --recompute always: the search chooses recomputation"),
        (["--schedule", "auto", "--balance", "3,2"],
         "--schedule auto --microbatches auto --balance 3,2: the search chooses the balance; omit --balance"),
        (["--microbatches", "auto", "--balance", "3,2"], "the search chooses the balance"),
        # the library's checks, in the flags' terms (these profile the tiny model: well under a second)
        ([*TINY, "--schedule", "auto", "--microbatches", "3"],
         "--schedule auto --microbatches 3 --stages 2 --batch-size 8 --dp 1: n_microbatches (3) does not "
         "divide batch_size (8)"),
        ([*TINY, "--schedule", "auto", "--memory-limit", "1KB"],
         "--memory-limit 1KB: memory_limit (1 KB) is too small for every configuration: the weights"),
        ([*TINY, "--balance", "2,3", "--memory-limit", "1KB"],
         "--balance 2,3 --memory-limit 1KB: the predicted peak exceeds the limit (rank 0 "),
        ([*TINY, "--memory-limit", "1KB"], "--memory-limit 1KB: memory_limit (1 KB)"),  # the fixed schedule's
    ],
)  # fmt: skip
def test_bad_auto_flags_exit_2_with_one_line(args: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        train.main(args)  # every check runs before a rank is started
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err


def test_auto_plan_fits_the_limit_and_the_run_takes_its_values() -> None:
    cfg = parse_args([*TINY, "--schedule", "auto", "--memory-limit", LIMIT])
    plan = train.make_plan(cfg, CPU)
    assert max(plan.rank_peaks) <= 200_000 and plan.n_ranks == 2
    best = plan.candidates[0]
    assert (best.schedule, best.n_microbatches, best.balance) == (
        plan.schedule, plan.n_microbatches, plan.balance,
    )  # fmt: skip
    assert 8 % plan.n_microbatches == 0
    config = run_config(cfg, plan)  # what the checkpoints record: the request, and the plan chosen
    assert (config["schedule"], config["microbatches"], config["memory_limit"]) == ("auto", "auto", 200_000)
    mode = plan.recompute if isinstance(plan.recompute, str) else list(plan.recompute)
    assert config["plan"] == {"schedule": plan.schedule, "n_stages": 2, "n_virtual": plan.n_virtual,
                              "n_microbatches": plan.n_microbatches, "recompute": mode, "dp": 1,
                              "balance": plan.balance}  # fmt: skip
    said = train.chosen(cfg, plan)
    assert said.startswith("auto (--schedule auto --microbatches auto --memory-limit 200KB): chose ")
    assert f"{plan.summary()} balance {plan.balance}" in said and "(limit 200 KB)" in said
    # the model the ranks build does not depend on the sample's rows: the same weights at any m
    a, _ = train.build_model(cfg, plan.n_microbatches)
    b, _ = train.build_model(cfg, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    # an integer --microbatches stays fixed under --schedule auto; a fixed schedule's m is searched
    fixed_m = train.make_plan(parse_args([*TINY, "--schedule", "auto", "--microbatches", "2"]), CPU)
    assert fixed_m.n_microbatches == 2 and all(c.n_microbatches == 2 for c in fixed_m.candidates)
    only_m = train.make_plan(parse_args([*TINY, "--schedule", "gpipe", "--microbatches", "auto"]), CPU)
    assert {c.schedule for c in only_m.candidates} == {"gpipe"}
    # without auto, the limit bounds the partitioner's balance and is recorded, with the balance chosen;
    # a balance given is recorded as asked, and the plan's is not
    capped = parse_args([*TINY, "--memory-limit", "1GB"])
    capped_plan = train.make_plan(capped, CPU)
    config = run_config(capped, capped_plan)
    assert config["memory_limit"] == 10**9 and config["plan"]["balance"] == capped_plan.balance
    given = parse_args([*TINY, "--balance", "3,2"])
    config = run_config(given, train.make_plan(given, CPU))
    assert config["balance"] == [3, 2] and "balance" not in config["plan"]
    assert "memory_limit" not in run_config(parse_args(TINY), plan)  # runs from before the flag


def _record(folder: Path, step: int, config: dict[str, Any]) -> Path:
    """A checkpoint folder holding only a manifest with ``config``: all ``recorded_plan`` reads."""
    path = folder / f"step-{step:08d}"
    path.mkdir(parents=True)
    manifest.write(path, manifest.Manifest(step, "run", step, config, {}))
    return path


def test_a_restart_reuses_the_recorded_plan_instead_of_searching(tmp_path: Path) -> None:
    args = [*TINY, "--schedule", "auto", "--memory-limit", LIMIT, "--checkpoint-dir", str(tmp_path)]
    cfg = parse_args(args)
    # a plan the search would not choose (m = 4, stage 0 recomputed, 3 layers then 2): a new search
    # cannot come out as it by chance
    theirs = Plan(balance=[3, 2], schedule="1f1b", n_microbatches=4, recompute=("always", "never"))
    saved = run_config(cfg, theirs)
    path = _record(tmp_path, 2, saved)
    plan = train.make_plan(cfg, CPU)
    assert (plan.schedule, plan.n_microbatches, plan.n_virtual, plan.balance, plan.recompute) == (
        "1f1b", 4, 1, [3, 2], ("always", "never"),
    )  # fmt: skip
    assert run_config(cfg, plan) == saved  # so resume finds no difference
    assert plan.search is None and plan.stages  # not searched; predicted, for the busy-time report
    said = train.chosen(cfg, plan)
    assert said is not None and said.startswith("auto (--schedule auto --microbatches auto --memory")
    assert f"reusing the plan recorded in {path}, [1f1b, m=4, v=1, recompute (always, never)]" in said
    # another request (here the limit) is searched afresh: resume then names the differences
    other = parse_args([*args[:-2], "--checkpoint-dir", str(tmp_path), "--memory-limit", "250KB"])
    assert train.make_plan(other, CPU).search is not None
    # a fixed schedule whose balance the partitioner chose: its restart reuses the recorded balance too
    # (flops, not times: the premise that partitioning would not choose [4, 1] holds on a busy host)
    fixed = parse_args([*TINY, "--cost", "flops", "--checkpoint-dir", str(tmp_path / "fixed")])
    odd = Plan(balance=[4, 1], schedule="1f1b", n_microbatches=4)  # not what partitioning chooses
    assert train.make_plan(parse_args([*TINY, "--cost", "flops"]), CPU).balance != [4, 1]
    saved = run_config(fixed, odd)
    path = _record(tmp_path / "fixed", 2, saved)
    plan = train.make_plan(fixed, CPU)
    assert plan.balance == [4, 1] and run_config(fixed, plan) == saved
    said = train.chosen(fixed, plan)
    assert said is not None and said.startswith(f"restart: reusing the plan recorded in {path}, [1f1b, m=4")
    assert train.chosen(parse_args(TINY), plan) is None  # nothing to say of a plan made as asked
    # a balance given by --balance is the request, recorded as asked: no plan balance, nothing to reuse
    given = parse_args([*TINY, "--balance", "3,2", "--checkpoint-dir", str(tmp_path / "given")])
    _record(tmp_path / "given", 2, run_config(given, theirs))
    assert recorded_plan(given) is None
    # one checkpoint given for the folder: refused before any search, naming the flag
    with pytest.raises(FlagError, match=r"^--checkpoint-dir .*02: recorded_config\(\) takes the folder"):
        train.make_plan(parse_args([*args[:-2], "--checkpoint-dir", str(path)]), CPU)


# ---- runs on 2 ranks: searched and trained (~10 s); checkpointed and restarted (-m slow: ~20 s)


def _main(*args: str) -> list[dict[str, Any]]:
    return train.main([*TINY, "--schedule", "auto", "--memory-limit", LIMIT, "--steps", "4",
                       "--eval-every", "2", "--sample-chars", "0", "--quiet", *args])  # fmt: skip


def _printed_choice(out: str) -> tuple[str, int, int]:
    """(schedule, m, v) of the one line rank 0 prints; the runners-up table printed too."""
    said = [line for line in out.splitlines() if line.startswith("auto (")]
    assert len(said) == 1 and " chose [" in said[0], out  # rank 0, once
    assert "candidates (auto search, fastest first):" in out and " #  schedule" in out  # the runners-up
    name, rest = said[0].split(" chose [", 1)[1].split(", m=", 1)
    return name, int(rest.split(",")[0]), int(rest.split(", v=")[1].split(",")[0])


def test_auto_run_prints_its_choice_and_trains_it_on_every_rank(capfd: Any) -> None:
    results = _main()
    ran = _printed_choice(capfd.readouterr().out)
    assert all(r["ran"] == ran for r in results)  # every rank ran the printed choice
    losses = results[0]["losses"]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_auto_run_resumes_on_its_recorded_plan_exactly(tmp_path: Path, capfd: Any) -> None:
    straight = _main("--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "2")
    ran = _printed_choice(capfd.readouterr().out)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-00000002", tmp_path / "b" / "step-00000002")
    (tmp_path / "b" / "latest").write_text("step-00000002\n")
    resumed = _main("--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "2")
    out = capfd.readouterr().out
    assert "reusing the plan recorded in" in out and " chose [" not in out, out
    assert resumed[0]["start"] == 2 and all(r["ran"] == ran for r in resumed)
    assert resumed[0]["losses"] == straight[0]["losses"][2:]  # exactly: the same plan, not a new search's
