"""Chaos suite: faults caused on purpose against short runs of ``scripts/train.py``, and what survived.

    python scripts/chaos.py                          # every scenario, 3 runs each, random fault timing
    python scripts/chaos.py --runs 1 --scenarios kill-mid-step,corrupt-shard --procs 2

Each scenario runs the very same training command that a user would restart
by hand or that ``torchrun --max-restarts N`` restarts, with a fault at a
random moment, and checks what the issue asks of a fault-tolerant run:

    scenario          fault                                      must hold
    kill-mid-step     SIGKILL a worker while it trains           restart, losses = uninterrupted run's
    kill-during-save  SIGKILL a worker while a checkpoint is     the previous checkpoint is used;
                      being written (.tmp-step-* exists)         losses = uninterrupted
    kill-startup      SIGKILL a worker 0-3 s after it started    restart from scratch or the checkpoint
    sigstop           SIGSTOP a worker (it hangs)                the bounded waits fail it; restart
    corrupt-shard     truncate or bit-flip the newest            resume names the file, falls back to
                      checkpoint's shard between runs            the previous one; losses = uninterrupted
    other-seed        the same folder, another --seed            refused, the folder left untouched
    kill-parent       SIGKILL the launcher (pipeline.launch)     its ranks end (no orphans); rerun exact
    nan-streak        gradients NaN on one rank for K steps      every rank skips; stops after K with the
                                                                 last good checkpoint; rerun exact

    launchers: "torchrun" (torch.distributed.run --standalone, c10d rendezvous on a free port,
               --max-restarts N restarts the workers) and "launch" (train.py's own pipeline.launch;
               this script reruns the same command after a failure, as a job scheduler would)
    procs:     2 (2 stages) and 4 (2 stages x dp 2)

Columns of the table: runs; time from the fault until every worker of the
faulted attempt is gone (median and max, seconds); restarts (total); runs
whose final losses equal the uninterrupted run's, bit for bit (from
``--loss-log``, the last value written for each step); orphaned processes
(any process carrying the run's tag in its environment, or in its session,
once the run is over: must be 0); checkpoints lost (a resume from an older
step than the newest complete checkpoint, or the last one missing) or loaded
wrongly (losses differing after a resume, another run's state): must be 0.

Every subprocess starts in its own session and is killed by process group in
``finally``; every wait has a deadline. Test-only hook used here:
STAGEWISE_TEST_NAN="RANK:STEP,STEP..." makes train.py put a NaN into one
gradient of global rank RANK at those (1-based) steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SCENARIOS",
    "Job",
    "Outcome",
    "Setup",
    "baseline",
    "damage",
    "losses_of",
    "main",
    "run_scenario",
    "tagged",
    "train_command",
]

TRAIN = Path(__file__).resolve().parent / "train.py"
TAG_ENV = "STAGEWISE_CHAOS_TAG"  # every process of one run carries it in its environment
NAN_ENV = "STAGEWISE_TEST_NAN"  # test-only: "RANK:STEP,STEP" -> a NaN gradient there (see train.py)
_POLL_S = 0.02


@dataclass(frozen=True)
class Setup:
    """One way to run: ``launcher`` "torchrun" or "launch", ``procs`` 2 or 4 (then dp 2)."""

    launcher: str
    procs: int
    steps: int = 16
    every: int = 4  # checkpoint interval
    max_restarts: int = 2
    wait_timeout_s: float = 30.0  # STAGEWISE_TIMEOUT: the bound on every wait for another rank
    job_timeout_s: float = 600.0

    def __str__(self) -> str:
        return f"{self.launcher}/{self.procs}"


@dataclass
class Outcome:
    scenario: str
    setup: Setup
    detect_s: float | None = None
    restarts: int = 0
    equal: bool | None = None  # None: not applicable
    orphans: int = 0
    lost: int = 0
    wrong: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and self.equal is not False and not (self.orphans or self.lost or self.wrong)


# ---------------------------------------------------------------------------- processes


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours
        return b""


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent, state, session) of ``pid``; None when it is gone."""
    text = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if not text:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[3])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def tagged(tag: str, session: int | None = None) -> list[int]:
    """Live processes whose environment carries ``tag`` (or that are in ``session``)."""
    needle, found = f"{TAG_ENV}={tag}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        st = _stat(pid)
        if st is None or st[1] in ("Z", "X"):
            continue
        if (session is not None and st[2] == session) or needle in _read(f"/proc/{pid}/environ").split(b"\0"):
            found.append(pid)
    return found


class Job:
    """One command in its own session with a tag; ``stop()`` kills its whole group (and tagged strays)."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex[:12]
        full = {**os.environ, **(env or {}), TAG_ENV: self.tag, "OMP_NUM_THREADS": "1"}
        self.log = log
        self.out_file = log.open("ab")
        self.proc = subprocess.Popen(
            list(argv), stdout=self.out_file, stderr=subprocess.STDOUT, env=full, start_new_session=True
        )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def workers(self) -> list[int]:
        """The live ranks: the launcher's children that carry the tag (not multiprocessing's helpers)."""
        out = []
        for pid in tagged(self.tag):
            st = _stat(pid)
            cmd = _read(f"/proc/{pid}/cmdline")
            if st is not None and st[0] == self.pid and b"resource_tracker" not in cmd:
                out.append(pid)
        return out

    def stray(self) -> list[int]:
        """Processes of this job still alive (the launcher included)."""
        return tagged(self.tag, session=self.pid)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Kill the group, then anything tagged that escaped it; reap the launcher."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in tagged(self.tag):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.wait(10.0)
        self.out_file.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def orphans_after(job: Job, grace_s: float = 15.0) -> int:
    """How many of ``job``'s processes outlive it by ``grace_s`` (ranks still exiting get that long)."""
    deadline = time.monotonic() + grace_s
    while job.stray() and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(job.stray())


# ---------------------------------------------------------------------------- runs


def small_data(folder: Path) -> Path:
    """A small text file to train on (the standard library's source would take long to read)."""
    path = folder / "data.txt"
    if not path.exists():
        src = Path(shutil.__file__).read_text() + Path(argparse.__file__).read_text()
        path.write_text(src)
    return path


def train_command(setup: Setup, run_dir: Path, data: Path, *extra: str) -> list[str]:
    """The one command that starts and restarts a run in ``run_dir``."""
    args = ["--layers", "2", "--width", "32", "--seq-len", "32", "--batch-size", "8", "--microbatches", "2",
            "--steps", str(setup.steps), "--eval-every", "1000", "--sample-chars", "0", "--quiet",
            "--cost", "flops", "--data", str(data), "--checkpoint-dir", str(run_dir / "ckpt"),
            "--checkpoint-every", str(setup.every), "--loss-log", str(run_dir / "loss.jsonl"),
            *extra]  # fmt: skip
    shape = ["--stages", "2"] + (["--dp", str(setup.procs // 2)] if setup.procs > 2 else [])
    if setup.launcher == "launch":
        return [sys.executable, str(TRAIN), *args, *shape]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={setup.procs}",
        f"--max-restarts={setup.max_restarts}",
        "--monitor-interval=0.2",
        str(TRAIN),
        *args,
        *shape,
    ]


def losses_of(path: Path) -> dict[int, float]:
    """Step -> loss from a ``--loss-log``; a step logged again after a resume: its last value."""
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):  # a line cut by a kill
                rec = json.loads(line)
                out[int(rec["step"])] = float(rec["loss"])
    return out


def complete_steps(ckpt: Path) -> set[int]:
    """Steps of the checkpoints in ``ckpt`` that finished (a manifest, or dcp's metadata)."""
    found = set()
    for p in ckpt.glob("step-*"):
        if p.name[5:].isdigit() and ((p / "manifest.json").is_file() or (p / ".metadata").is_file()):
            found.add(int(p.name[5:]))
    return found


_RESUMED = re.compile(r"resumed .*?from '?([^' ]+?)'? at step (\d+)")


def resumed_steps(text: str) -> list[int]:
    return [int(m.group(2)) for m in _RESUMED.finditer(text)]


@dataclass
class Watch:
    """What the monitor saw of one attempt."""

    rc: int | None = None
    t_fault: float | None = None
    detect_s: float | None = None
    generations: int = 1
    before_fault: set[int] = field(default_factory=set)  # complete checkpoint steps when the fault hit


Fault = Callable[[Job, Path], bool]  # called every poll until it returns True (it has struck)


def attempt(
    setup: Setup,
    run_dir: Path,
    argv: list[str],
    fault: Fault | None = None,
    env: dict[str, str] | None = None,
    until_gone: Callable[[Job], list[int]] | None = None,
) -> tuple[Watch, Job]:
    """Run ``argv`` once, calling ``fault`` until it strikes; measure detection and worker generations."""
    job, w = Job(argv, run_dir / "out.txt", env), Watch()
    deadline = job.started + setup.job_timeout_s
    faulted: list[int] = []
    seen: set[int] = set()
    try:
        while time.monotonic() < deadline:
            rc = job.proc.poll()
            workers = job.workers()
            if seen and workers and not (set(workers) & seen) and not any(_alive(p) for p in seen):
                w.generations += 1  # torchrun restarted every worker
                seen = set()
            seen |= set(workers)
            if fault is not None and w.t_fault is None:
                snapshot = complete_steps(run_dir / "ckpt")
                faulted = (until_gone or (lambda j: j.workers()))(job)
                if fault(job, run_dir):
                    w.t_fault, w.before_fault = time.monotonic(), snapshot
            if w.t_fault is not None and w.detect_s is None and not any(_alive(p) for p in faulted):
                w.detect_s = time.monotonic() - w.t_fault
            if rc is not None:
                w.rc = rc
                break
            time.sleep(_POLL_S)
        return w, job
    finally:
        if w.rc is None:
            job.stop()  # past its deadline: kill, then report
        job.out_file.flush()


def baseline(setup: Setup, work: Path, data: Path) -> dict[int, float]:
    """Losses of the uninterrupted run (per process count: the launchers must agree with it)."""
    run_dir = work / f"baseline-{setup.procs}"
    ref = run_dir / "losses.json"
    if ref.exists():
        return {int(k): v for k, v in json.loads(ref.read_text()).items()}
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    w, job = attempt(
        setup, run_dir, train_command(Setup("launch", setup.procs, setup.steps, setup.every), run_dir, data)
    )
    try:
        losses = losses_of(run_dir / "loss.jsonl")
        if w.rc != 0 or len(losses) != setup.steps:
            raise RuntimeError(f"the uninterrupted run failed (rc {w.rc}); see {run_dir / 'out.txt'}")
    finally:
        job.stop()
    ref.write_text(json.dumps(losses))
    return losses


# ---------------------------------------------------------------------------- faults


def _after_step(rng: random.Random, setup: Setup) -> int:
    return rng.randint(1, setup.steps - 2)


def kill_worker_at(sig: signal.Signals, ready: Callable[[Job, Path], bool], rng: random.Random) -> Fault:
    def fault(job: Job, run_dir: Path) -> bool:
        workers = job.workers()
        if not workers or not ready(job, run_dir):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(rng.choice(workers), sig)
        return True

    return fault


def damage(path: Path, how: str, rng: random.Random) -> str:
    """Truncate ``path`` to half, or flip 64 bytes in its middle; what was done."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return f"truncated {path.name} to {len(data) // 2} of {len(data)} bytes"
    at = rng.randrange(len(data) // 4, max(len(data) // 4 + 1, len(data) - 64))
    for k in range(at, min(len(data), at + 64)):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"flipped 64 bytes of {path.name} at {at}"


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- scenarios


def _finish(out: Outcome, setup: Setup, run_dir: Path, argv: list[str], w: Watch, job: Job,
            ref: dict[int, float], expect_from: int | None) -> None:  # fmt: skip
    """After the faulted attempt: rerun (launch) until done, then check losses, checkpoints, orphans."""
    out.orphans += orphans_after(job)
    job.stop()
    out.detect_s = w.detect_s
    out.restarts += w.generations - 1
    rc = w.rc
    while rc != 0 and out.restarts < setup.max_restarts and setup.launcher == "launch":
        out.restarts += 1
        w2, job2 = attempt(setup, run_dir, argv)
        out.orphans += orphans_after(job2)
        job2.stop()
        rc = w2.rc
    text = (run_dir / "out.txt").read_text(errors="replace")
    if rc != 0:
        out.failures.append(f"the run did not finish (rc {rc}); see {run_dir / 'out.txt'}")
    losses = losses_of(run_dir / "loss.jsonl")
    out.equal = losses == ref
    resumed = resumed_steps(text)
    if expect_from is not None and resumed and resumed[0] < expect_from:
        out.lost += 1  # resumed from older than the newest complete checkpoint at the fault
    if setup.steps not in complete_steps(run_dir / "ckpt"):
        out.lost += 1
    if resumed and not out.equal:
        out.wrong += 1


def run_scenario(name: str, setup: Setup, run_dir: Path, data: Path, ref: dict[int, float],
                 rng: random.Random) -> Outcome:  # fmt: skip
    """One run of scenario ``name``; every process it started is gone when it returns."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    out, argv = Outcome(name, setup), train_command(setup, run_dir, data)
    env = {"STAGEWISE_TIMEOUT": str(setup.wait_timeout_s)}
    loss_log = run_dir / "loss.jsonl"

    def progressed(at: int) -> Callable[[Job, Path], bool]:
        return lambda job, d: len(losses_of(loss_log)) >= at

    if name in ("kill-mid-step", "kill-during-save", "kill-startup", "sigstop"):
        if name == "kill-mid-step":
            at = _after_step(rng, setup)
            fault = kill_worker_at(signal.SIGKILL, progressed(at), rng)
        elif name == "kill-during-save":
            fault = kill_worker_at(signal.SIGKILL, lambda j, d: any((d / "ckpt").glob(".tmp-step-*")), rng)
        elif name == "kill-startup":
            delay = rng.uniform(0.0, 3.0)
            born: list[float] = []

            def started(job: Job, d: Path) -> bool:
                if not born:
                    born.append(time.monotonic())
                return time.monotonic() - born[0] >= delay

            fault = kill_worker_at(signal.SIGKILL, started, rng)
        else:
            fault = kill_worker_at(signal.SIGSTOP, progressed(_after_step(rng, setup)), rng)
        w, job = attempt(setup, run_dir, argv, fault, env)
        if w.t_fault is None:
            out.failures.append("the fault never struck (the run ended first)")
        newest = max(w.before_fault, default=None)
        _finish(out, setup, run_dir, argv, w, job, ref, newest)
        return out
    if name == "kill-parent":
        at = _after_step(rng, setup)

        def kill_parent(job: Job, d: Path) -> bool:
            if len(losses_of(loss_log)) < at:
                return False
            os.kill(job.pid, signal.SIGKILL)
            return True

        w, job = attempt(setup, run_dir, argv, kill_parent, env, until_gone=lambda j: j.stray())
        deadline = time.monotonic() + 30.0
        while job.stray() and time.monotonic() < deadline:  # the ranks notice their parent is gone
            time.sleep(_POLL_S)
        if w.t_fault is not None and not job.stray():
            w.detect_s = time.monotonic() - w.t_fault
        _finish(out, setup, run_dir, argv, w, job, ref, max(w.before_fault, default=None))
        return out
    if name == "nan-streak":
        k, once = 3, dataclasses.replace(setup, max_restarts=0)  # torchrun would rerun it in vain
        ckpt = run_dir / "ckpt"
        first = rng.randint(setup.every + 1, setup.steps - k)
        rank = rng.randrange(setup.procs)
        bad = ",".join(str(s) for s in range(first, first + k))
        w, job = attempt(
            setup,
            run_dir,
            [*train_command(once, run_dir, data), "--max-bad-steps", str(k)],
            None,
            {**env, NAN_ENV: f"{rank}:{bad}"},
        )
        out.orphans += orphans_after(job)
        job.stop()
        text = (run_dir / "out.txt").read_text(errors="replace")
        if w.rc == 0 or "consecutive" not in text:
            out.failures.append(f"NaN on rank {rank} at steps {bad}: the run did not stop with an error")
        last_good = (first - 1) // setup.every * setup.every
        if max(complete_steps(ckpt), default=0) != last_good:
            out.lost += 1
            out.failures.append(
                f"newest checkpoint {sorted(complete_steps(ckpt))}, expected step {last_good}"
            )
        w, job = attempt(setup, run_dir, argv, None, env)
        _finish(out, setup, run_dir, argv, w, job, ref, last_good)
        return out
    # the rest start from a finished run in the folder
    w, job = attempt(setup, run_dir, argv, None, env)
    out.orphans += orphans_after(job)
    job.stop()
    if w.rc != 0:
        out.failures.append(f"the first run failed (rc {w.rc}); see {run_dir / 'out.txt'}")
        return out
    ckpt = run_dir / "ckpt"
    if name == "corrupt-shard":
        final = ckpt / f"step-{setup.steps:08d}"
        shard = rng.choice(sorted(final.glob("*.distcp")))
        done = damage(shard, rng.choice(["truncate", "flip"]), rng)
        mark = len((run_dir / "out.txt").read_text(errors="replace"))
        w, job = attempt(setup, run_dir, argv, None, env)
        text = (run_dir / "out.txt").read_text(errors="replace")[mark:]
        if shard.name not in text:
            out.failures.append(f"{done}: the resume did not name {shard.name}")
        previous = setup.steps - setup.every
        if resumed_steps(text)[:1] != [previous]:
            out.lost += 1
            out.failures.append(f"{done}: expected a fall back to step {previous}, got {resumed_steps(text)}")
        _finish(out, setup, run_dir, argv, w, job, ref, None)
        return out
    if name == "other-seed":
        before = _files(ckpt)
        other = train_command(dataclasses.replace(setup, max_restarts=0), run_dir, data, "--seed", "1")
        w, job = attempt(setup, run_dir, other, None, env)
        out.orphans += orphans_after(job)
        job.stop()
        text = (run_dir / "out.txt").read_text(errors="replace")
        if w.rc == 0 or "seed" not in text.split("--seed")[-1]:
            out.wrong += 1
            out.failures.append(f"another seed in the same folder was not refused (rc {w.rc})")
        if _files(ckpt) != before:
            out.lost += 1
            out.failures.append("the refused run changed the folder")
        out.equal = losses_of(loss_log) == ref
        return out
    raise ValueError(f"unknown scenario {name!r}; use one of {SCENARIOS}")


SCENARIOS = ("kill-mid-step", "kill-during-save", "kill-startup", "sigstop", "corrupt-shard", "other-seed",
             "kill-parent", "nan-streak")  # fmt: skip


def setups_for(name: str, procs: Sequence[int], launchers: Sequence[str]) -> list[Setup]:
    """kill-parent is pipeline.launch's promise; the rest run under both launchers."""
    use = ["launch"] if name == "kill-parent" else list(launchers)
    return [Setup(launcher, p) for launcher in use if launcher in launchers for p in procs]


# ---------------------------------------------------------------------------- table


def table(outcomes: list[Outcome]) -> str:
    head = (f"{'scenario':<17} {'setup':<11} {'runs':>4} {'detect med s':>12} {'max s':>6} {'restarts':>8} "
            f"{'losses equal':>12} {'orphans':>7} {'lost/wrong':>10}  ok")  # fmt: skip
    rows, keys = [head, "-" * len(head)], []
    for o in outcomes:
        if (o.scenario, str(o.setup)) not in keys:
            keys.append((o.scenario, str(o.setup)))
    for scenario, setup in keys:
        group = [o for o in outcomes if o.scenario == scenario and str(o.setup) == setup]
        times = [o.detect_s for o in group if o.detect_s is not None]
        med = f"{statistics.median(times):.1f}" if times else "-"
        top = f"{max(times):.1f}" if times else "-"
        eq = [o.equal for o in group if o.equal is not None]
        equal = f"{sum(eq)}/{len(eq)}" if eq else "n/a"
        lw = f"{sum(o.lost for o in group)}/{sum(o.wrong for o in group)}"
        ok = "yes" if all(o.ok for o in group) else "NO"
        rows.append(f"{scenario:<17} {setup:<11} {len(group):>4} {med:>12} {top:>6} "
                    f"{sum(o.restarts for o in group):>8} {equal:>12} {sum(o.orphans for o in group):>7} "
                    f"{lw:>10}  {ok}")  # fmt: skip
    return "\n".join(rows)


@contextlib.contextmanager
def _workdir(given: str | None) -> Iterator[Path]:
    if given is not None:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given)
        return
    with tempfile.TemporaryDirectory(prefix="stagewise-chaos-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="chaos.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from the list above")
    p.add_argument("--runs", type=int, default=3, help="runs per scenario and setup, each with random timing")
    p.add_argument("--procs", default="2,4", help="process counts: 2 (2 stages), 4 (2 stages x dp 2)")
    p.add_argument("--launchers", default="torchrun,launch")
    p.add_argument("--seed", type=int, default=None, help="of the fault timing (default: random, printed)")
    p.add_argument("--work", help="folder for the runs (default: a temporary one, removed)")
    a = p.parse_args(argv)
    names = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    seed = a.seed if a.seed is not None else random.randrange(10**6)
    rng = random.Random(seed)
    procs, launchers = [int(x) for x in a.procs.split(",")], a.launchers.split(",")
    print(f"chaos: seed {seed}, scenarios {', '.join(names)}, {a.runs} runs each", flush=True)
    outcomes: list[Outcome] = []
    with _workdir(a.work) as work:
        data = small_data(work)
        for name in names:
            for setup in setups_for(name, procs, launchers):
                ref = baseline(setup, work, data)
                for i in range(a.runs):
                    t0 = time.monotonic()
                    o = run_scenario(
                        name, setup, work / f"{name}-{setup.launcher}-{setup.procs}-{i}", data, ref, rng
                    )
                    outcomes.append(o)
                    why = "; ".join(o.failures)
                    print(
                        f"  {name} {setup} #{i}: {'ok' if o.ok else 'FAILED'} ({time.monotonic() - t0:.0f} s)"
                        + (f" ({why})" if why else ""),
                        flush=True,
                    )
    print(table(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
