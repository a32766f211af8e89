from __future__ import annotations

import functools
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.dist import free_port

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the ranks find `train` through the sys.path they inherit

import _train_flags  # noqa: E402
import _train_support  # noqa: E402
import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_ranks")  # ranks forked, not spawned: conftest.py

# a model that trains a step in milliseconds: 2 blocks + embedding, norm, head = 5 layers
TINY = ["--layers", "2", "--width", "16", "--seq-len", "16", "--batch-size", "8", "--microbatches", "4"]
QUIET = ["--quiet", "--sample-chars", "0", "--eval-every", "2"]


def _run(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    return train.main([*TINY, *QUIET, *args])


def _copy_checkpoint(src: Path, step: int, dst: Path) -> None:
    """A folder holding only checkpoint ``step`` of ``src``: the state of a run stopped there."""
    name = f"step-{step:08d}"
    shutil.copytree(src / name, dst / name)
    (dst / "latest").write_text(name + "\n")


# ---- bad flags: one line on stderr, exit code 2, before any rank starts


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--stages", "6", "--layers", "2"],
            "--stages 6 --layers 2: n_ranks (6) x n_virtual (1) is 6 stages",
        ),
        (["--schedule", "2f2b"], "invalid choice: '2f2b'"),
        (["--recompute", "sometimes"], "invalid choice: 'sometimes'"),
        (["--data", "/nonexistent/corpus"], "'/nonexistent/corpus' does not exist"),
        (["--batch-size", "3", "--microbatches", "4"], "--batch-size 3 --microbatches 4: "),
        (["--batch-size", "3", "--microbatches", "4"], "batch has 3 rows but n_microbatches is 4"),
        (
            ["--balance", "4,4"],
            "--balance 4,4 --layers 4: balance [4, 4] covers 8 layers but the model has 7",
        ),
        (["--balance", "3,1,1,1,1"], "--balance gives 5 stages, 5 ranks x 1, but --stages is 2"),
        (["--balance", "a,b"], "must be comma-separated layer counts"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--allow-config-change", "stages,colour"], "--allow-config-change colour: not a recorded setting"),
        (["--width", "30"], "--width 30 --layers 4: width (30) must be divisible by n_heads (4)"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--lr", "-1"], "argument --lr: must be >= 0.0, got -1"),
        (
            ["--schedule", "interleaved-1f1b", "--microbatches", "3", "--batch-size", "6"],
            "must be a multiple of the number of ranks (2)",
        ),
        (
            ["--virtual", "2"],
            "--schedule 1f1b --stages 2 --virtual 2 --microbatches 4: n_virtual (2) must be 1",
        ),
        (["--zero"], "--zero shards the optimizer state over the replicas: give --dp 2 or more"),
        (["--dp", "0"], "--dp 0 must be >= 1"),
        (["--dp", "3"], "--batch-size 16 --dp 3: the batch is split evenly over the replicas, so"),
        (
            ["--dp", "4", "--batch-size", "8", "--microbatches", "4"],
            "--batch-size 8 --dp 4 --microbatches 4: batch has 2 rows but n_microbatches is 4",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        train.main(args)  # every check runs before a rank is started
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err


def test_a_balance_that_misses_the_models_layers_fails_before_the_profile(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("profiled before checking --balance against the model")

    monkeypatch.setattr(train, "profile", never)
    with pytest.raises(SystemExit):
        train.main(["--balance", "4,4"])
    message = "--balance 4,4 --layers 4: balance [4, 4] covers 8 layers but the model has 7"
    assert message in capsys.readouterr().err


def test_resume_without_a_checkpoint_and_cuda_without_gpu(tmp_path: Path, capsys: Any) -> None:
    cfg = _train_flags.parse_args(
        ["--resume", "--checkpoint-dir", str(tmp_path), "--allow-config-change", "stages,--dp"]
    )
    assert cfg.resume and cfg.allow_config_change == ("stages", "dp")  # an empty folder: a fresh start
    # a setting that shapes the plan lets the whole plan change (it is made again: balance, stage count)
    assert cfg.allow_changes == {"stages", "dp", "plan"}
    assert _train_flags.parse_args(["--allow-config-change", "steps,lr"]).allow_changes == {"steps", "lr"}
    if not train.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            _train_flags.parse_args(["--device", "cuda"])
        assert "--device cuda needs a GPU per rank: 2 ranks, 0 GPUs here" in capsys.readouterr().err


def test_under_torchrun_the_world_is_split_into_dp_x_stages(capsys: Any) -> None:
    assert _train_flags.split_world(None, None, None) == (2, 1)  # standalone: the defaults
    assert _train_flags.split_world(None, 4, 2) == (4, 2)
    assert _train_flags.split_world(4, None, None) == (4, 1)  # torchrun: one pipeline over the world
    assert _train_flags.split_world(4, None, 2) == (2, 2)
    assert _train_flags.split_world(4, 2, None) == (2, 2)
    assert _train_flags.split_world(8, 2, 4) == (2, 4)
    for stages, dp in ((3, None), (2, 4), (None, 3)):
        with pytest.raises(SystemExit):
            _train_flags.split_world(4, stages, dp)
        assert "does not split torchrun's world of 4 ranks into dp x stages" in capsys.readouterr().err


def test_too_short_data_file_is_a_flag_error(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "tiny.txt").write_text("abc" * 10)
    with pytest.raises(SystemExit):
        _train_flags.parse_args(["--data", str(tmp_path / "tiny.txt"), "--seq-len", "64"])
    err = capsys.readouterr().err
    assert "--seq-len 64: " in err and "fewer than seq_len + 1 = 65" in err


def test_script_reports_a_bad_flag_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "train.py"), "--stages", "9"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert (
        proc.stderr.startswith("train.py: error: --stages 9 --layers 4: ")
        and "model has 7 layers" in proc.stderr
    )


# ---- progress output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_without_tqdm_or_terminal_prints_plain_lines(
    terminal: bool, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed: importing it fails
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    progress = _train_support.Progress(total=40, start=0, tokens_per_step=10, show=True)
    assert progress.bar is None
    for done in range(1, 41):
        progress.step(done, loss=1.0 / done)
    progress.write("step 40 | message")
    captured = capsys.readouterr()
    err = sys.stderr.getvalue() if terminal else captured.err  # type: ignore[attr-defined]
    lines = err.splitlines()
    assert [line.split(" steps")[0] for line in lines] == [f"{k}/40" for k in range(2, 41, 2)]  # every 5%
    assert "\r" not in err and lines[-1].startswith("40/40 steps | loss 0.025 | tokens/s ")
    assert captured.out == "step 40 | message\n"


def test_quiet_progress_prints_nothing_and_needs_no_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    progress = _train_support.Progress(total=3, start=0, tokens_per_step=10, show=False)
    for done in range(1, 4):
        progress.step(done, loss=1.0)
    assert sys.stderr.getvalue() == "" and capsys.readouterr().out == ""


# ---- runs


def test_end_to_end_two_stages_partitioned_with_trace_and_sample(tmp_path: Path) -> None:
    trace = tmp_path / "runs" / "new" / "step.json"  # its folders do not exist yet
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "train.py"), *TINY, "--steps", "6", "--eval-every", "3",
         "--dtype", "bf16", "--sample-chars", "40", "--trace", str(trace),
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "fwd ms" in out and "balance [" in out  # the partitioner's stage table
    evals = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in evals] == ["step 3", "step 6"]
    assert all(" | train loss " in e and " | val loss " in e and " | tokens/s " in e for e in evals)
    assert "predicted ms" in out and "measured ms" in out
    assert "---- generated text ----\ndef " in out
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e["name"] == "process_name"}  # fmt: skip
    assert names == {0: "simulated", 1: "measured"}
    measured = [e for e in events if e["pid"] == 1]
    assert {e["tid"] for e in measured} == {0, 1}  # both ranks in one file
    assert sorted(e["name"] for e in measured if e["tid"] == 1 and e["cat"] == "compute") == sorted(
        f"1{k}{i}" for k in "FB" for i in range(4)
    )  # every forward and backward of stage 1's four micro-batches
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000006\n"
    # stderr is a pipe, not a terminal: one plain progress line per step (6 steps < 20), no "\r" updates
    progress = [line for line in proc.stderr.splitlines() if " steps | loss " in line]
    assert [line.split(" steps")[0] for line in progress] == [f"{k}/6" for k in range(1, 7)]
    assert "\r" not in proc.stderr and "\r" not in proc.stdout


@pytest.mark.slow
def test_without_tqdm_the_script_still_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "tqdm.py").write_text("raise ImportError('tqdm is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}:{SCRIPTS.parent}"}
    proc = subprocess.run(  # --quiet without tqdm: test_quiet_progress_prints_nothing_and_needs_no_tqdm
        [sys.executable, str(SCRIPTS / "train.py"), *TINY, "--steps", "2", "--sample-chars", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2/2 steps | loss " in proc.stderr, proc.stderr


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path: Path, capfd: Any) -> None:
    ckpt = ["--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "3"]
    straight = _run(tmp_path, "--steps", "6", *ckpt)
    losses = straight[0]["losses"]
    assert len(losses) == 6 and all(r["losses"] == losses for r in straight)  # every rank has the loss
    assert losses[-1] < losses[0]
    _copy_checkpoint(tmp_path / "a", 3, tmp_path / "b")
    # the very command that started a run restarts it: no --resume needed
    resumed = _run(
        tmp_path, "--steps", "6", "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "3"
    )
    assert resumed[0]["start"] == 3
    assert resumed[0]["losses"] == losses[3:]  # exactly, not approximately
    assert resumed[0]["evals"][-1][2] == straight[0]["evals"][-1][2]  # the same final validation loss
    out = capfd.readouterr()
    assert f"from {str(tmp_path / 'b' / 'step-00000003')!r} at step 3" in out.out, out.out  # said which
    # another --steps changes the learning-rate schedule: named, not applied
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, "--steps", "7", "--checkpoint-dir", str(tmp_path / "b"))
    err = capfd.readouterr().err
    assert exc.value.code == 2 and "steps: 6 -> 7" in err and "--allow-config-change" in err, err


@pytest.mark.slow
def test_four_stage_checkpoint_resumes_on_two_stages(tmp_path: Path, capfd: Any) -> None:
    four = _run(tmp_path, "--stages", "4", "--steps", "4", "--checkpoint-dir", str(tmp_path / "a"),
                "--checkpoint-every", "2")  # fmt: skip
    _copy_checkpoint(tmp_path / "a", 2, tmp_path / "b")
    with pytest.raises(SystemExit):  # a deliberate change must be said
        _run(tmp_path, "--stages", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"))
    err = capfd.readouterr().err
    assert "stages: 4 -> 2" in err and "plan.n_stages: 4 -> 2" in err, err
    two = _run(tmp_path, "--stages", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
               "--allow-config-change", "stages")  # fmt: skip
    assert two[0]["start"] == 2
    assert two[0]["losses"] == pytest.approx(four[0]["losses"][2:], rel=1e-6)


def test_non_finite_updates_are_skipped_on_every_rank_and_a_streak_stops_the_run(
    tmp_path: Path, capfd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank 1 (the last stage's) gets a NaN gradient at step 2, then at 4, 5, 6: rank 0's own gradients
    # stay finite, so only the all-ranks check can make it skip too
    monkeypatch.setenv(_train_support.NAN_ENV, "1:2,4,5,6")
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "8", "--balance", "3,2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    args += ["--max-bad-steps", "3"]
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, *args, "--loss-log", str(tmp_path / "loss.jsonl"))
    out = capfd.readouterr()
    assert exc.value.code == 2, out.err
    assert (
        "step 2: a loss or gradient is not finite on some rank: update skipped on every rank (1 in a row"
        in out.out
    )
    assert "3 consecutive steps (4-6) had a non-finite loss or gradient; stopped" in out.err, out.err
    assert "last good update was step 3" in out.err
    steps = sorted(int(p.name[5:]) for p in ckpt.glob("step-*"))
    assert steps[-1] == 3  # no checkpoint after a skipped update: the last good one is the newest
    losses = [json.loads(line)["loss"] for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)  # the NaN was in a gradient only
    # the same command without the fault resumes from step 3 and finishes
    monkeypatch.delenv(_train_support.NAN_ENV)
    done = _run(tmp_path, *args)
    assert done[0]["start"] == 3 and len(done[0]["losses"]) == 5


def test_fp16_with_grad_scaler_trains(tmp_path: Path) -> None:
    # (bf16 runs in the end-to-end test)
    losses = _run(tmp_path, "--steps", "4", "--dtype", "fp16", "--balance", "3,2")[0]["losses"]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_seed_lr_and_recompute_steer_the_run(tmp_path: Path) -> None:
    base = _run(tmp_path, "--steps", "3", "--balance", "3,2")[0]["losses"]  # deterministic: see below
    other_seed = _run(tmp_path, "--steps", "3", "--balance", "3,2", "--seed", "7")[0]["losses"]
    assert other_seed[0] != base[0]  # another initialisation and other batches
    frozen = _run(tmp_path, "--steps", "3", "--balance", "3,2", "--lr", "1e-12")[0]["losses"]
    assert frozen[0] == base[0]  # the first loss is computed before any update
    assert frozen[1:] != base[1:]  # then the learning rate decides how far the weights move
    # recomputing activations changes the memory, not the numbers (equal also proves a run repeats)
    recomputed = _run(tmp_path, "--steps", "3", "--balance", "3,2", "--recompute", "always")[0]["losses"]
    assert recomputed == base


# ---- replicas (data parallel), ZeRO-1, and two torchrun "nodes" on this host


_DP_FLAGS = ["--steps", "3", "--balance", "3,2", "--microbatches", "2", "--dp", "2", "--stages", "2"]


@functools.cache
def _replicas_run() -> tuple[list[dict[str, Any]], Path]:
    """One single-node run of dp = 2 x 2 stages, with its loss log: two tests read it."""
    log = Path(tempfile.mkdtemp(prefix="stagewise-dp2-")) / "logs" / "dp2.jsonl"
    return train.main([*TINY, *QUIET, *_DP_FLAGS, "--loss-log", str(log)]), log


def test_replicas_train_like_one_pipeline_on_the_whole_batch(tmp_path: Path) -> None:
    args = ("--steps", "3", "--balance", "3,2", "--microbatches", "2")
    one = _run(tmp_path, *args)[0]["losses"]
    two, log = _replicas_run()
    assert len(two) == 4 and all(r["losses"] == two[0]["losses"] for r in two)  # the global mean everywhere
    assert two[0]["losses"] == pytest.approx(one, rel=1e-5)  # each replica half of the same batch
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"step": k + 1, "loss": loss} for k, loss in enumerate(two[0]["losses"])
    ]
    zero = _run(tmp_path, *args, "--dp", "2", "--zero")
    assert zero[0]["losses"] == two[0]["losses"]  # the same updates, the state sharded


def test_two_torchrun_nodes_on_this_host_give_the_single_node_losses(tmp_path: Path) -> None:
    flags = [*TINY, *QUIET, *_DP_FLAGS]
    single = _replicas_run()[0][0]["losses"]  # the same flags on one node (and a loss log)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent), "GLOO_SOCKET_IFNAME": "lo"}
    nodes = []
    try:
        for k in range(2):
            log = str(tmp_path / f"node{k}.jsonl")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", f"test-{port}", "--rdzv-conf", "join_timeout=60", "--max-restarts", "0",
                   str(SCRIPTS / "train.py"), *flags, "--loss-log", log]  # fmt: skip
            nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))  # fmt: skip
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:  # the agents and their ranks: each node's own process group
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    logs = [p for p in tmp_path.glob("node*.jsonl")]  # written by global rank 0, on either node
    assert len(logs) == 1
    losses = [json.loads(line)["loss"] for line in logs[0].read_text().splitlines()]
    assert losses == single
