"""The prepared GPU check: the pipeline's CUDA and NCCL path on this machine, one command, one table.

    python scripts/gpu_check.py                          # 1 GPU; with N >= 2 it spawns N NCCL ranks
    torchrun --nproc-per-node N scripts/gpu_check.py     # the same NCCL rows under torchrun

Rows (letters: p ranks, v stages per rank, m micro-batches):

  stream ordering        a stand-in transfer (a copy held back on a side stream, as NCCL's stream
                         runs late) consumed through the runtime's ordering: right; the same without
                         ordering, and ordered on another stream (the old bug), must read poison,
                         or the check could not see a missing ordering (FAIL)
  pinned copy stream     Placer.to_device behind a busy copy stream: pinned, ordered before compute
  one GPU, interleaved   all stages on one rank (v = 2..4) vs one process; busy time from CUDA events
  host syncs             a step under set_sync_debug_mode: one sync, at the site the library names
                         (pipeline.runtime.step.steps.HOST_SYNC, the returned loss), none elsewhere
  NCCL <schedule>        every entry of the schedule registry (its fewest v; m = 2p, and m = p too
                         where m must be a multiple of p), fp32 and bf16, step and evaluate on p
                         ranks vs one process running the same micro-batches
  memory <schedule>      micro-batches held per stage vs the plan's count (partitioner.memory);
                         on GPUs each rank's CUDA peak (Pipeline.memory_stats) vs plan_for's bytes
  features (FEATURES)    each on every rank of the world vs one process: dp = 2 with a caller's
                         mesh; a weight tied across ranks (2 SGD steps); variable-length steps;
                         fp16 with GradScaler (an overflow on the last rank, skipped alike);
                         predict(dst=0) at p = the world; load_pretrained into a meta-built model;
                         a drain mid-step (STAGEWISE_DRAIN_AT for one rank, and a device-wide
                         synchronize in a forward hook of a middle stage): done within the
                         pipeline's timeout, same loss and gradients; a synchronize that hangs
                         ends its rank at a deadline, stacks on stderr (without torchrun the
                         drain has a launch of its own: that is its FAIL row, not the table's end)
  killed rank            rank 1 SIGKILLed mid-step: named within seconds, no process left behind
  step time              ours vs torch.distributed.pipelining (1F1B), same model and devices

Without CUDA the GPU rows say "skipped" and the multi-rank rows run on 2 CPU ranks under
the strict NCCL emulation (STAGEWISE_EMULATE_NCCL), which runs the same NCCL code path on
gloo; a step-time row then also shows the emulation's own overhead. Exit status 1 on any FAIL.

Under torchrun every rank runs the multi-rank rows first (the drain last: a rank its deadline ends
ends the job, its stacks on stderr; run without torchrun for the table); the results are gathered
over a gloo group and the world is destroyed, and only then does rank 0 run the one-GPU rows,
alone: no rank waits for them.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import gc
import json
import os
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partitioner
import pipeline
from partitioner import plan_for, profile
from partitioner.memory import in_flight
from pipeline.launch import RankError, init_distributed, launch
from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.channels import NcclTransfer
from pipeline.runtime.inputs.varlen import VarLen
from pipeline.runtime.pipe import Pipeline
from pipeline.runtime.step.drain import ENV as DRAIN_ENV
from pipeline.runtime.step.steps import HOST_SYNC, host_sync_site
from pipeline.schedules.registry import REGISTRY
from pipeline.schedules.schedule import schedule_options

Row = tuple[str, str, str]
_VOCAB, _SEQ = 96, 16
_TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}  # half: same micro-batches, GPU reductions not bitwise
_TIMEOUT_S = 60.0  # every Pipeline's: each wait on another rank
_CONTROL_TIMEOUT_S = 900.0  # the ranks' agreements between rows: the slowest rank's row, with its waits
# the library's own files (of the tree imported above): a host sync's site is its innermost frame there
_LIBRARY = tuple(str(Path(m.__file__ or "").resolve().parent) + os.sep for m in (pipeline, partitioner))


def _balance(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (1 if k < n_layers % n_stages else 0) for k in range(n_stages)]


def _model(n_layers: int, width: int = 32, batch: int = 16) -> tuple[nn.Sequential, torch.Tensor, Any]:
    torch.manual_seed(0)
    model, x = gpt(vocab_size=_VOCAB, width=width, n_layers=n_layers, n_heads=2, max_seq_len=_SEQ,
                   batch_size=batch)  # fmt: skip
    return model, x, torch.randint(0, _VOCAB, x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _plan(n_layers: int, p: int, name: str, v: int, m: int) -> Plan:
    return Plan(balance=_balance(n_layers, p * v), schedule=name, n_microbatches=m, n_virtual=v)


def _pipe(model: nn.Sequential, p: int, name: str, v: int, m: int, device: torch.device) -> Pipeline:
    plan = _plan(len(model), p, name, v, m)
    return Pipeline(model, plan, loss_fn=gpt_loss, device=device, timeout=_TIMEOUT_S)


# ---- one GPU


class _DelayedCopy:
    """An NCCL work stand-in: its data lands late on a side stream; ``wait`` orders the current stream."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, side: torch.cuda.Stream) -> None:
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s of GPU time: a late transfer
            dst.copy_(src)
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.done.record(side)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)

    def is_completed(self) -> bool:
        return bool(self.done.query())  # type: ignore[no-untyped-call]


def check_stream_ordering(rows: list[Row]) -> None:
    label = "stream ordering (delayed side-stream copy)"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    side, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    compute = torch.cuda.current_stream(dev)
    src = torch.full((1 << 22,), 3.0, device=dev)

    def consume(how: str) -> float:
        dst = torch.full_like(src, float("nan"))  # what a read before the transfer sees
        torch.cuda.synchronize()
        transfer = NcclTransfer([_DelayedCopy(src, dst, side)], [dst])
        if how == "ordered":
            transfer.order(compute)  # the runtime's receive path (Comm.order on NCCL)
        elif how == "other stream":
            transfer.order(other)
        out = float((dst * 2).sum())
        torch.cuda.synchronize()
        return out

    good, missing, wrong = consume("ordered"), consume("none"), consume("other stream")
    ok = good == 6.0 * src.numel()
    sees = missing != missing and wrong != wrong  # NaN: the stand-in exposes a missing ordering
    status = "ok" if ok and sees else "FAIL"
    rows.append((label, status, f"ordered {'right' if ok else 'WRONG'}; unordered / other stream read "
                 f"{'poison' if sees else 'data (check inconclusive)'}"))  # fmt: skip


def check_copy_stream(rows: list[Row]) -> None:
    label = "pinned copy stream (Placer.to_device)"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    model, _, _ = _model(2)
    ex = _pipe(model, 1, "gpipe", 1, 1, dev).runner.placer
    host = torch.randn(1 << 22)
    with torch.cuda.stream(ex.copy_stream):  # type: ignore[arg-type]
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # the copy stream is busy: compute must wait for the copy
    out = ex.to_device(host)
    ok = bool(torch.equal(out.cpu(), host))  # element by element: GPU and CPU sums round differently
    rows.append((label, "ok" if ok else "FAIL", f"{host.numel() * 4 >> 20} MiB, ordered before compute"))


def check_one_gpu(rows: list[Row]) -> None:
    if not torch.cuda.is_available():
        rows.append(("one GPU, interleaved v=2..4, busy from CUDA events", "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    model, x, y = _model(4)
    torch.autograd.backward(gpt_loss(model(x), y))
    ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for v in (2, 3, 4):
        model, x, y = _model(4)
        pipe = _pipe(model, 1, "interleaved-1f1b", v, 8, dev)
        start = time.perf_counter()
        pipe.step(x, y)
        wall = time.perf_counter() - start
        worst = max(_rel(p.grad, ref[k]) for k, p in pipe.named_parameters() if p.grad is not None)
        busy = pipe.busy_time
        ok = worst < 1e-3 and 0 < busy <= wall  # TF32 may be on here: CPU vs GPU
        rows.append((f"one GPU, interleaved v={v} vs CPU", "ok" if ok else "FAIL",
                     f"max rel {worst:.1e}; busy {busy * 1e3:.1f} ms of {wall * 1e3:.1f} ms"))  # fmt: skip


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def check_memory_one_gpu(rows: list[Row]) -> None:
    """One rank's CUDA allocator peak in a step against the plan's bytes for it (plan_for's walk) and
    against memory_stats' own count (parameters, gradients, held activations), and what is on the
    device before the step: the gap between them is what the memory model misses."""
    label = "memory on one GPU: allocator peak vs plan"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    for width, name, v in ((64, "interleaved-1f1b", 2), (1024, "1f1b", 1), (1024, "interleaved-1f1b", 2)):
        pipe = model = None  # the last row's
        gc.collect()  # anything of the last row that a cycle holds (a Pipeline holds none)
        torch.cuda.empty_cache()
        model, x, y = _model(8, width=width, batch=64)
        prof = profile(_model(8, width=width, batch=64)[0].to(dev), x.chunk(8)[0].to(dev), device=dev)
        pipe = _pipe(model, 1, name, v, 8, dev)
        pipe.step(x, y)  # the first step: cuBLAS workspaces, the allocator's pools
        before = torch.cuda.memory_allocated(dev)
        pipe.step(x, y, measure_memory=True)  # the held bytes counted too
        stats = pipe.memory_stats()
        planned = plan_for(prof, _balance(len(model), v), schedule=name, n_microbatches=8, n_virtual=v,
                           optimizer_state_factor=0.0).rank_peaks[0]  # fmt: skip
        peak = stats["allocator_peak"]
        rows.append((f"{label} (width {width}, {name} v={v}, m=8)", "info",
                     f"allocator peak {_mib(peak)} MiB, memory_stats {_mib(stats['peak'])} MiB, planned "
                     f"{_mib(planned)} MiB (peak / planned {peak / planned:.2f}); {_mib(before)} MiB "
                     "allocated before the step"))  # fmt: skip


def check_nccl_one_rank(rows: list[Row]) -> None:
    """Real NCCL objects on one GPU: a 1-rank group's work, held back behind a sleeping launch
    stream, consumed on another stream through ``NcclTransfer.order`` (what every receive does)."""
    label = "NCCL 1-rank group: work ordered onto another stream"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(str(Path(folder, "store")), 1)  # type: ignore[attr-defined]
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            launch_stream, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
            src = torch.full((1 << 22,), 3.0, device=dev)

            def gather(how: str) -> tuple[float, float]:
                out = torch.full((1, src.numel()), float("nan"), device=dev)  # read early: poison
                torch.cuda.synchronize()
                with torch.cuda.stream(launch_stream):  # NCCL's stream waits for this one at launch
                    torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # ~0.2 s: a late peer
                    work = dist.all_gather_into_tensor(out, src, async_op=True)
                start = time.perf_counter()
                if how == "ordered":
                    NcclTransfer([work], [out]).order(consumer)
                host = time.perf_counter() - start
                with torch.cuda.stream(consumer):
                    total = (out * 2).sum()
                torch.cuda.synchronize()
                return float(total), host

            (good, host), (missing, _) = gather("ordered"), gather("none")
            ok = good == 6.0 * src.numel() and host < 0.1
            sees = missing != missing
            right = "right" if good == 6.0 * src.numel() else "WRONG"
            unordered = "poison" if sees else "data (inconclusive)"
            detail = f"ordered {right}, host went on after {host * 1e3:.1f} ms; unordered read {unordered}"
            rows.append((label, "ok" if ok and sees else "FAIL", detail))
        finally:
            dist.destroy_process_group()


def _in_library(filename: str) -> bool:
    """A frame of the library itself (pipeline/ or partitioner/ of the tree this script imported)."""
    return str(Path(filename).resolve()).startswith(_LIBRARY)


def _where(f: traceback.FrameSummary) -> str:
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def sync_site(stack: Sequence[traceback.FrameSummary], allowed: tuple[str, int]) -> tuple[bool, str]:
    """A host sync whose Python stack (outermost first) is ``stack``: (whether it is the allowed site,
    where it is). The site is the innermost library frame, ``file:line function``; it is the allowed
    one when that frame is ``allowed``'s line (steps.host_sync_site(): the library names it)."""
    ours = [f for f in stack if _in_library(f.filename)]
    if not ours:  # raised off the library's frames (the autograd engine's device thread, say)
        return False, "outside the library's frames"
    here = (str(Path(ours[-1].filename).resolve()), ours[-1].lineno)
    return here == (str(Path(allowed[0]).resolve()), allowed[1]), _where(ours[-1])


def _sync_sites(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``: how many host syncs were at the
    library's allowed site (``HOST_SYNC``), and where each other one was (``sync_site``)."""
    import warnings

    allowed = host_sync_site()
    at_allowed, others = 0, []

    def hook(message: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal at_allowed
        if "called a synchronizing CUDA operation" not in str(message):
            return  # e.g. the mode's one-time notice that it is a prototype
        ok, where = sync_site(traceback.extract_stack(), allowed)
        if ok:
            at_allowed += 1
        elif "outside" in where:
            others.append(f"{where}: {str(message).splitlines()[0][:80]}")
        else:
            others.append(where)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return at_allowed, others


def _first_sync(fn: Callable[[], object]) -> str:
    """Run ``fn`` under ``set_sync_debug_mode("error")``: where the first host sync raised."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        ours = [f for f in traceback.extract_tb(exc.__traceback__) if _in_library(f.filename)]
        return f"first at {_where(ours[-1]) if ours else '?'}: {str(exc).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "the error pass raised none"


def check_no_host_sync(rows: list[Row]) -> None:
    """One pipeline step (the second: the first allocates) under sync debug mode: one host
    synchronisation, at the site the library names (steps.HOST_SYNC: the returned loss), no other."""
    label = "one step under set_sync_debug_mode: host syncs"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    file, line = host_sync_site()
    site = f"{Path(file).name}:{line} {HOST_SYNC[0]}"
    for name, v in (("interleaved-1f1b", 2), ("1f1b", 1), ("zb-h1", 1)):
        model, x, y = _model(4)
        pipe = _pipe(model, 1, name, v, 4, dev)
        pipe.step(x, y)
        torch.cuda.synchronize()
        at_site, others = _sync_sites(functools.partial(pipe.step, x, y))
        ok = at_site == 1 and not others
        detail = f"{at_site} at {site} (HOST_SYNC, expected 1)"
        if others:  # the same step again, raising at its first sync: its traceback names the place
            detail += f"; {len(others)} elsewhere: " + "; ".join(sorted(set(others))[:6])
            detail += "; " + _first_sync(functools.partial(pipe.step, x, y))
        rows.append((f"{label} ({name} v={v})", "ok" if ok else "FAIL", detail))


def check_oom_stall(rows: list[Row]) -> None:
    """What the caching allocator does when an allocation must free cached blocks while work is still
    queued on another stream (as a pre-posted NCCL receive is, until its peer sends): the host stalls
    until that work ends (cudaFree synchronises the device). With a real receive whose peer waits on
    this rank, that stall is a deadlock: the reason the runtime never allocates to the device's limit
    with receives posted. A sleeping kernel stands in for the receive."""
    label = "allocator OOM retry behind a pending transfer"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    chunk = 4 << 30

    def retry(pending: bool) -> tuple[float, float]:
        torch.cuda.empty_cache()
        held = []
        try:
            while True:
                held.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            pass
        del held  # cached by the allocator, not returned to the device
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            begin.record()
            if pending:
                torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]  # ~1 s
            end.record()
        start = time.perf_counter()
        big = torch.empty(chunk + chunk // 2, dtype=torch.uint8, device=dev)  # fits no cached block
        host = time.perf_counter() - start
        del big
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return host, begin.elapsed_time(end) / 1e3

    idle, _ = retry(False)
    stalled, pending = retry(True)
    verdict = "STALLS" if stalled > pending / 2 else "goes on"
    detail = (f"allocation {stalled * 1e3:.0f} ms with a {pending * 1e3:.0f} ms transfer pending, "
              f"{idle * 1e3:.0f} ms with none: the host {verdict}")  # fmt: skip
    rows.append((label, "info", detail))


def check_overhead(rows: list[Row]) -> None:
    """Seconds per step on one GPU: the pipeline (one rank, m micro-batches) against a plain loop
    over the same micro-batches, measured side by side."""
    label = "runtime overhead on one GPU"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    model, x, y = _model(8, width=1024, batch=64)
    plain = model.to(dev)
    xd, yd = x.to(dev), y.to(dev)

    def loop() -> None:
        for a, b in zip(xd.chunk(8), yd.chunk(8), strict=True):
            (gpt_loss(plain(a), b) / 8).backward()  # type: ignore[no-untyped-call]

    model2, _, _ = _model(8, width=1024, batch=64)
    pipe = _pipe(model2, 1, "1f1b", 1, 8, dev)
    times = {}
    for name, fn in (("loop", loop), ("ours", lambda: pipe.step(x, y))):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 10
    rows.append((label, "info", f"ours {times['ours'] * 1e3:.2f} ms, plain loop {times['loop'] * 1e3:.2f} ms "
                 f"per step of 8 micro-batches: {times['ours'] / times['loop']:.2f}x"))  # fmt: skip


# ---- p ranks: NCCL (or its emulation)


def _configs(p: int) -> list[tuple[str, int, int]]:
    """(schedule, v, m) for every entry of the registry (never a list of names here): its fewest stages
    per rank, m = 2p (dualpipe-v's order is for m >= 2p), and m = p too where m must be a multiple
    of p (a single group of micro-batches); each checked by ``schedule_options``, the one check."""
    out = []
    for name, e in REGISTRY.items():
        for m in (p, 2 * p) if e.m_multiple_of_p else (2 * p,):
            v, m = schedule_options(name, p, m, e.default_virtual)
            out.append((name, v, m))
    return out


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_group() -> Any:
    """A gloo group of the world for the ranks' own agreements and the table's gather: it stays usable
    after a row's pipeline failed (whose watchdog may close the connections of the groups it used)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_CONTROL_TIMEOUT_S))


def _launched(features: Sequence[str]) -> dict[str, Any]:
    """One rank of ``launch``: every multi-rank check, with the features named."""
    return _rank_checks(control_group(), _named(features))


def _launched_alone(features: Sequence[str]) -> dict[str, Any]:
    """One rank of a ``launch`` of its own: the features named (see ``ALONE``)."""
    return {"features": run_features(control_group(), _named(features))}


def _rank_checks(control: Any, features: Sequence[Feature]) -> dict[str, Any]:
    """On every rank: each schedule x dtype (loss, evaluation, grads, held, peak memory), step times,
    and each feature row (``run_features``)."""
    p, dev, emulate = dist.get_world_size(), _device(), emulation.enabled()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out: dict[str, Any] = {"busy": True}
    for dtype in ("fp32", "bf16"):
        for name, v, m in _configs(p):
            model, x, y = _model(2 * p)
            pipe = _pipe(model, p, name, v, m, dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                ev = pipe.evaluate(x, y)
                loss = pipe.step(x, y)
            memory = pipe.memory_stats()
            grads = {k: t.grad.float().cpu() for k, t in pipe.named_parameters() if t.grad is not None}
            out[f"{dtype}/{name}/{m}"] = (
                loss,
                ev,
                grads,
                memory["held"],
                memory["allocator_peak"] or memory["peak"],
            )
            out["busy"] = out["busy"] and pipe.busy_time > 0
    out["time"] = _step_times(p, dev, emulate)  # first: a failed feature may leave the world unusable
    out["features"] = run_features(control, features)
    return out


def _step_times(p: int, dev: torch.device, emulate: bool) -> dict[str, float]:
    """Seconds per 1F1B step: ours (and ours on plain gloo under the emulation) and torch's."""
    from torch.distributed import pipelining as tp

    big = dev.type == "cuda"
    model, x, y = _model(4 * p, width=512 if big else 32, batch=32 if big else 16)
    m = 2 * p
    ours = _pipe(model, p, "1f1b", 1, m, dev)
    times = {"ours": _timed(lambda: ours.step(x, y), dev)}
    if emulate:  # the same runtime on the same gloo ranks, off the emulation (read when a Pipeline is made)
        os.environ[emulation.ENV] = "0"
        plain = _pipe(model, p, "1f1b", 1, m, dev)
        os.environ[emulation.ENV] = "1"
        times["ours, plain gloo"] = _timed(lambda: plain.step(x, y), dev)
    rank, bounds = dist.get_rank(), [sum(_balance(len(model), p)[:s]) for s in range(p + 1)]
    stage = tp.PipelineStage(model[bounds[rank] : bounds[rank + 1]].to(dev), rank, p, dev)
    sched = tp.Schedule1F1B(stage, m, loss_fn=gpt_loss)
    xd, yd = x.to(dev), y.to(dev)

    def torch_step() -> None:
        if rank == 0:
            sched.step(xd)
        else:
            sched.step(target=yd) if rank == p - 1 else sched.step()

    times["torch.distributed.pipelining"] = _timed(torch_step, dev)
    return times


def _timed(step: Any, dev: torch.device, n: int = 5) -> float:
    step()
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return (time.perf_counter() - start) / n


def _reference(p: int, m: int, dtype: str, dev: torch.device) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One process over the same micro-batches (sum of loss / m), and the mean evaluation loss."""
    model, x, y = _model(2 * p)
    model.to(dev)
    total, chunks = 0.0, list(zip(x.chunk(m), y.chunk(m), strict=True))
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
        with torch.no_grad():
            model.eval()
            ev = sum(float(gpt_loss(model(a.to(dev)), b.to(dev))) for a, b in chunks) / m
            model.train()
        for a, b in chunks:
            loss = gpt_loss(model(a.to(dev)), b.to(dev)) / m
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
    return total, ev, {k: t.grad.float().cpu() for k, t in model.named_parameters() if t.grad is not None}


def _matrix_rows(per_rank: list[dict[str, Any]], dev: torch.device, backend: str) -> list[Row]:
    p, rows = len(per_rank), []
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for dtype in ("fp32", "bf16"):
        for name, v, m in _configs(p):
            key = f"{dtype}/{name}/{m}"
            loss_ref, ev_ref, grads_ref = _reference(p, m, dtype, dev)
            merged = {k: g for r in per_rank for k, g in r[key][2].items()}
            same = set(merged) == set(grads_ref)
            worst = max(_rel(merged[k], g) for k, g in grads_ref.items()) if same else 1.0
            losses = [abs(r[key][0] - loss_ref) / loss_ref for r in per_rank]
            evs = [abs(r[key][1] - ev_ref) / ev_ref for r in per_rank]
            ok = max(worst, *losses, *evs) < _TOL[dtype]
            detail = f"max rel grads {worst:.1e}, losses {max(losses + evs):.1e}"
            rows.append((f"{backend} {name} v={v} m={m} {dtype}: step + evaluate vs one process",
                         "ok" if ok else "FAIL", detail))  # fmt: skip
    n_layers = len(_model(2 * p)[0])
    for name, v, m in _configs(p):
        key, plan = f"fp32/{name}/{m}", _plan(n_layers, p, name, v, m)
        sched = plan.build_schedule()
        want = in_flight(sched)  # per stage, the plan's count
        held = [per_rank[sched.rank_of(s)][key][3][s] for s in range(p * v)]
        detail = f"held {held}, plan {want}"
        if dev.type == "cuda":  # each rank's peak against the plan's bytes for its stages
            model, x, _ = _model(2 * p)
            prof = profile(model.to(dev), x.chunk(m)[0].to(dev), device=dev)
            planned = plan_for(prof, plan.balance, schedule=name, n_microbatches=m, n_virtual=v,
                               optimizer_state_factor=0.0).rank_peaks  # fmt: skip
            ratios = [per_rank[r][key][4] / planned[r] for r in range(p)]
            detail += f"; CUDA peak / planned bytes per rank {[round(x, 2) for x in ratios]}"
        rows.append((f"memory {name} v={v} m={m}: micro-batches held", "ok" if held == want else "FAIL",
                     detail))  # fmt: skip
    rows.append(("busy time > 0 on every rank", "ok" if all(r["busy"] for r in per_rank) else "FAIL", ""))
    times = per_rank[0]["time"]
    ours = times["ours"]
    detail = ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in times.items())
    detail += f"; ours / torch = {ours / times['torch.distributed.pipelining']:.2f}"
    if "ours, plain gloo" in times:
        detail += f"; emulation overhead {ours / times['ours, plain gloo']:.2f}x"
    rows.append((f"step time, 1F1B on {p} ranks", "info", detail))
    return rows


# ---- features on every rank of the world: each row is a ``Feature``: its ``run(dev)`` on every rank
# (real NCCL, its emulation, or gloo in tests/test_gpu_check.py), its ``reference(world, dev)`` in one
# process running the same micro-batches, and its ``judge`` comparing the two. Both results are plain
# dicts (they cross processes): "losses" (every loss seen, the same on every rank), "tensors" (this
# rank's gradients or outputs, CPU, under the one-process model's names; a tied weight's copies each
# under its first name), "group" (the model copy they belong to: the replica) and "extra" (what the
# row also checks).

Result = dict[str, Any]


class Skip(Exception):
    """A row that this world cannot run (the same decision on every rank); its reason is the row's."""


@dataclass(frozen=True)
class Feature:
    name: str
    run: Callable[[torch.device], Result]  # on every rank, in the same order everywhere
    reference: Callable[[int, torch.device], Result]  # one process, for a world of that many ranks
    judge: Callable[[list[Result], Result], tuple[str, str]]  # (status, detail): every rank vs one process


def _result(losses: list[float], tensors: Mapping[str, torch.Tensor], group: int = 0, **extra: Any) -> Result:
    return {"losses": losses, "tensors": dict(tensors), "group": group, "extra": extra}


def _grads(named: Iterable[tuple[str, nn.Parameter]], rename: Mapping[str, str] | None = None
           ) -> dict[str, torch.Tensor]:  # fmt: skip
    """The gradients (fp32, CPU) by name, ``rename``d (a tied weight's other name to its first)."""
    rename = rename or {}
    return {rename.get(k, k): t.grad.float().cpu() for k, t in named if t.grad is not None}


def _agreement(results: list[Result], ref: Result, tol: float, what: str = "grads") -> tuple[bool, str]:
    """Every rank's losses, and each group's tensors (every copy of each), against one process's: ok
    when each is there, of its shape, and within ``tol`` (relative to the reference's largest value)."""
    problems: list[str] = []
    worst_loss = 0.0
    for r, res in enumerate(results):
        if len(res["losses"]) != len(ref["losses"]):
            problems.append(f"rank {r} has {len(res['losses'])} losses, one process {len(ref['losses'])}")
            continue
        for got, want in zip(res["losses"], ref["losses"], strict=True):
            worst_loss = max(worst_loss, abs(got - want) / max(abs(want), 1e-12))
    worst = 0.0
    for group in sorted({res["group"] for res in results}):
        seen: set[str] = set()
        for r, res in enumerate(results):
            for k, t in res["tensors"].items() if res["group"] == group else ():
                if k not in ref["tensors"] or t.shape != ref["tensors"][k].shape:
                    problems.append(f"rank {r}: {k} {tuple(t.shape)} is not the model's")
                    continue
                worst = max(worst, _rel(t, ref["tensors"][k]))
                seen.add(k)
        if set(ref["tensors"]) - seen:
            problems.append(f"group {group} lacks {sorted(set(ref['tensors']) - seen)[:3]}")
    ok = not problems and max(worst, worst_loss) < tol
    detail = f"max rel {what} {worst:.1e}" + (f", losses {worst_loss:.1e}" if ref["losses"] else "")
    return ok, detail + "".join(f"; {p}" for p in problems[:3])


def _one_process(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, dev: torch.device,
                 scaler: torch.amp.GradScaler | None = None) -> float:  # fmt: skip
    """One process over ``chunks`` equal micro-batches of the batch, as a pipeline runs them: ``.grad``
    gets the gradient of their mean loss (scaled by ``scaler``); returns that mean."""
    model.to(dev)
    total = 0.0
    for a, b in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
        loss = gpt_loss(model(a.to(dev)), b.to(dev)) / chunks
        (scaler.scale(loss) if scaler is not None else loss).backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
    return total


def _verdict(ok: bool, detail: str) -> tuple[str, str]:
    return ("ok" if ok else "FAIL"), detail


# dp = 2 replicas with a caller's mesh; the global batch is _model's 16 rows, 8 per replica


def _run_dp(dev: torch.device) -> Result:
    world = dist.get_world_size()
    if world % 2:
        raise Skip(f"dp = 2 needs an even number of ranks, the world has {world}")
    p = world // 2
    mesh = init_device_mesh(dev.type, (2, p), mesh_dim_names=("dp", "pp"))
    model, x, y = _model(2 * p)
    plan = Plan(balance=_balance(len(model), p), schedule="1f1b", n_microbatches=2 * p, dp=2)
    pipe = Pipeline(model, plan, loss_fn=gpt_loss, mesh=mesh, timeout=_TIMEOUT_S)
    rows = slice(pipe.replica * len(x) // 2, (pipe.replica + 1) * len(x) // 2)
    loss = pipe.step(x[rows], y[rows])
    return _result([loss], _grads(pipe.named_parameters()), group=pipe.replica)


def _reference_dp(world: int, dev: torch.device) -> Result:
    p = world // 2
    model, x, y = _model(2 * p)
    loss = _one_process(model, x, y, 2 * 2 * p, dev)  # both replicas' micro-batches, in order
    return _result([loss], _grads(model.named_parameters()), p=p)


def _judge_dp(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"])
    p = ref["extra"]["p"]
    replicas = [res["group"] for res in results]
    ok = ok and replicas == [g // p for g in range(2 * p)]  # global rank g = d * p + r
    return _verdict(ok, f"dp=2 x p={p}, 1f1b m={2 * p}, replicas {replicas}: {detail}")


# a weight tied across ranks: the LM head is the token embedding (stage 0 and the last stage)

_TIED = "0.token.weight"  # its first name, as one process's named_parameters gives it


def _tied_model(n_layers: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    model, x, y = _model(n_layers)
    model[-1].weight = model.get_parameter(_TIED)  # (V, C) both: one Parameter, used on two ranks
    return model, x, y


def _two_sgd_steps(params: Iterable[nn.Parameter], step: Callable[[], float]) -> list[float]:
    """Two steps, an SGD update between: the second runs on the copies as the first update left them."""
    opt = torch.optim.SGD(params, lr=0.1)
    losses = [step()]
    opt.step()
    opt.zero_grad()
    return [*losses, step()]


def _run_tied(dev: torch.device) -> Result:
    p = dist.get_world_size()
    model, x, y = _tied_model(2 * p)
    pipe = _pipe(model, p, "1f1b", 1, 2 * p, dev)
    losses = _two_sgd_steps(pipe.parameters(), lambda: pipe.step(x, y))
    return _result(losses, _grads(pipe.named_parameters(), {f"{len(model) - 1}.weight": _TIED}))


def _reference_tied(world: int, dev: torch.device) -> Result:
    model, x, y = _tied_model(2 * world)
    losses = _two_sgd_steps(model.parameters(), lambda: _one_process(model, x, y, 2 * world, dev))
    return _result(losses, _grads(model.named_parameters()), copies=min(world, 2))


def _judge_tied(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"])  # each copy against the one summed gradient
    copies = sum(_TIED in res["tensors"] for res in results)
    detail = f"{_TIED} on {copies} ranks, 2 SGD steps: {detail}"
    return _verdict(ok and copies == ref["extra"]["copies"], detail)


# variable-length steps: lists of sequences, packed per step


def _sequences(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A step's 24 sequences of 1.._SEQ tokens and their targets, a few target tokens ignored."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, _SEQ + 1, (24,), generator=g).tolist()
    xs = [torch.randint(0, _VOCAB, (n,), generator=g) for n in lengths]
    ys = [torch.randint(0, _VOCAB, (n,), generator=g) for n in lengths]
    ys[0][: len(ys[0]) // 2] = -100  # a prompt the loss ignores: the step weighs target tokens
    return xs, ys


_VARLEN_SEEDS = (1, 2)  # two steps of other lengths: other shapes


def _run_varlen(dev: torch.device) -> Result:
    p = dist.get_world_size()
    model, _, _ = _model(2 * p)
    plan = _plan(len(model), p, "1f1b", 1, 2 * p)
    varlen = VarLen(token_budget=24 * _SEQ, max_len=_SEQ)
    pipe = Pipeline(model, plan, loss_fn=gpt_loss, varlen=varlen, timeout=_TIMEOUT_S)
    losses = []
    for seed in _VARLEN_SEEDS:  # gradients accumulate over the steps
        xs, ys = _sequences(seed)
        losses.append(pipe.step(xs if pipe.needs_inputs else None, ys if pipe.needs_targets else None))
    return _result(losses, _grads(pipe.named_parameters()))


def _reference_varlen(world: int, dev: torch.device) -> Result:
    model, _, _ = _model(2 * world)
    model.to(dev)
    losses = []
    for seed in _VARLEN_SEEDS:  # each step padded to its longest sequence, the padding ignored
        xs, ys = _sequences(seed)
        x = nn.utils.rnn.pad_sequence(xs, batch_first=True).to(dev)
        y = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100).to(dev)
        loss = gpt_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(float(loss.detach()))
    return _result(losses, _grads(model.named_parameters()), p=world)


def _judge_varlen(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"])
    m = 2 * ref["extra"]["p"]
    return _verdict(ok, f"1f1b m={m}, 2 steps of 24 sequences (1..{_SEQ} tokens): {detail}")


# fp16 with torch.amp.GradScaler: an overflow on the last rank only, skipped alike everywhere

_FP16_STEPS, _OVERFLOW = 3, 1


def _fp16_steps(model: nn.Sequential, dev: torch.device, step: Callable[[torch.amp.GradScaler], float],
                unscale: Callable[[torch.amp.GradScaler, torch.optim.Optimizer], None],
                clip: Callable[[], object], params: Callable[[], Iterable[tuple[str, nn.Parameter]]],
                ) -> Result:  # fmt: skip
    """The fp16 loop, the pipeline's or one process's: the losses, the last step's unscaled grads, and
    the scale after each update."""
    opt = torch.optim.SGD([t for _, t in params()], lr=0.1)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**10, growth_interval=1)
    losses, scales, grads = [], [], {}
    head = f"{len(model) - 1}.weight"  # the last stage's: on the last rank only
    for k in range(_FP16_STEPS):
        with torch.autocast(dev.type, dtype=torch.float16):
            losses.append(step(scaler))
        for name, t in params():
            if k == _OVERFLOW and name == head and t.grad is not None:
                t.grad[0, 0] = float("inf")
        unscale(scaler, opt)
        grads = _grads(params())
        clip()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return _result(losses, grads, scales=scales)


def _run_fp16(dev: torch.device) -> Result:
    p = dist.get_world_size()
    model, x, y = _model(2 * p)
    pipe = _pipe(model, p, "1f1b", 1, 2 * p, dev)
    return _fp16_steps(
        model, dev, lambda scaler: pipe.step(x, y, scaler=scaler), pipe.unscale_,
        lambda: pipe.clip_grad_norm_(1.0), pipe.named_parameters,
    )  # fmt: skip


def _reference_fp16(world: int, dev: torch.device) -> Result:
    model, x, y = _model(2 * world)
    model.to(dev)
    return _fp16_steps(
        model, dev, lambda scaler: _one_process(model, x, y, 2 * world, dev, scaler),
        lambda scaler, opt: scaler.unscale_(opt), lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        model.named_parameters,
    )  # fmt: skip


def _judge_fp16(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp16"])
    scales = ref["extra"]["scales"]
    same = all(res["extra"]["scales"] == scales for res in results)
    backed_off = scales[_OVERFLOW] == scales[_OVERFLOW - 1] / 2  # the overflowed step was skipped
    detail = f"{_FP16_STEPS} steps, scales {scales} {'alike' if same else 'DIFFER'}: {detail}"
    return _verdict(ok and same and backed_off, detail)


# predict(dst=): the outputs to one rank only, at the world's p (the largest this machine has)

_DST = 0  # not the last stage's rank: the outputs travel


def _run_predict(dev: torch.device) -> Result:
    p = dist.get_world_size()
    model, x, _ = _model(2 * p)
    pipe = _pipe(model, p, "1f1b", 1, 2 * p, dev)
    out = pipe.predict(x if pipe.needs_inputs else None, dst=_DST)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"predict gave a {type(out).__name__}, expected the logits tensor")
    return _result([], {} if out is None else {"outputs": out.float().cpu()}, got=out is not None)


def _reference_predict(world: int, dev: torch.device) -> Result:
    model, x, _ = _model(2 * world)
    model.to(dev).eval()
    with torch.no_grad():
        return _result([], {"outputs": model(x.to(dev)).float().cpu()}, p=world)


def _judge_predict(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"], "outputs")
    where = [r for r, res in enumerate(results) if res["extra"]["got"]]
    detail = f"p={ref['extra']['p']}, dst={_DST}: outputs on ranks {where}; {detail}"
    return _verdict(ok and where == [_DST], detail)


# load_pretrained: a meta-built model, each rank reading its own tensors from a safetensors file

_SAFETENSORS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """``tensors`` as one safetensors file (8 bytes: the header's length, the JSON header, the data),
    the format ``save_pretrained`` writes, without the safetensors package."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for key, t in tensors.items():
        if t.dtype not in _SAFETENSORS:
            known = ", ".join(map(str, _SAFETENSORS))
            raise ValueError(f"{key} is {t.dtype}; write_safetensors takes {known}: convert it first")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": _SAFETENSORS[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _run_pretrained(dev: torch.device) -> Result:
    p = dist.get_world_size()
    model, x, y = _model(2 * p)  # the "pretrained" weights
    with torch.device("meta"):
        blank, _, _ = _model(2 * p)  # no storage: each rank's stages are materialised, then loaded
    pipe = _pipe(blank, p, "1f1b", 1, 2 * p, dev)
    with tempfile.TemporaryDirectory() as folder:  # each rank its own copy: no rank waits for a writer
        write_safetensors(Path(folder, "model.safetensors"), model.state_dict())
        pipe.load_pretrained(folder)
    return _result([pipe.step(x, y)], _grads(pipe.named_parameters()))


def _reference_pretrained(world: int, dev: torch.device) -> Result:
    model, x, y = _model(2 * world)
    loss = _one_process(model, x, y, 2 * world, dev)
    return _result([loss], _grads(model.named_parameters()), p=world)


def _judge_pretrained(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"])
    m = 2 * ref["extra"]["p"]
    return _verdict(ok, f"meta model, 1f1b m={m}, a step on the file's weights: {detail}")


# a drain: a rank waits for its posted transfers, and a device-wide sync mid-step


_DRAIN_DEADLINE_S = 2 * _TIMEOUT_S  # past the pipeline's own timeouts, which end every other wait


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Past ``seconds`` this process writes every thread's stack to stderr and exits (code 1): for a
    wait nothing else can end (``torch.cuda.synchronize`` behind a transfer whose peer waits on this
    rank), which would otherwise hold the check, and its GPUs, until NCCL's own timeout."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class DeviceSyncAt:
    """A forward hook: a host-side device-wide synchronisation (``torch.cuda.synchronize``; on CPU
    ``torch.cpu.synchronize``) at the layer's ``at``-th real forward, 0-based (passes on fake tensors,
    which infer shapes, are not counted): the host blocks there until all queued work has run,
    transfers posted before it included."""

    def __init__(self, dev: torch.device, at: int) -> None:
        self.dev, self.at, self.calls = dev, at, 0
        self.synced_at: int | None = None
        self.drain: str | None = None  # DRAIN_ENV as the step saw it

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, FakeTensor):
            return
        if self.calls == self.at:
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            else:
                torch.cpu.synchronize()
            self.synced_at, self.drain = self.calls, os.environ.get(DRAIN_ENV)
        self.calls += 1


def _drain_plan(p: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Plan, int, int]:
    """The drain row's model, batch and plan (interleaved-1f1b, v = 2, m = 2p), its middle stage
    (p // 2: neither the first nor the last of 2p) and that stage's rank."""
    model, x, y = _model(2 * p)
    plan = _plan(len(model), p, "interleaved-1f1b", 2, 2 * p)
    stage = p // 2
    return model, x, y, plan, stage, plan.build_schedule().rank_of(stage)


def _run_drain(dev: torch.device) -> Result:
    p = dist.get_world_size()
    if p < 2:
        raise Skip(f"a drain between ranks needs a pipeline of 2 ranks or more, the world has {p}")
    model, x, y, plan, stage, rank = _drain_plan(p)
    sync = DeviceSyncAt(dev, at=p)  # micro-batch p of 2p: mid-step
    hook = model[sum(plan.balance[:stage])].register_forward_hook(sync)  # the stage's first layer
    saved = os.environ.get(DRAIN_ENV)
    os.environ[DRAIN_ENV] = f"{rank}:*"  # that rank drains at each of its computes
    try:
        pipe = Pipeline(model, plan, loss_fn=gpt_loss, timeout=_TIMEOUT_S)
        start = time.perf_counter()
        with deadline(_DRAIN_DEADLINE_S):
            loss = pipe.step(x, y)
        wall = time.perf_counter() - start
    finally:
        hook.remove()
        if saved is None:
            os.environ.pop(DRAIN_ENV, None)
        else:
            os.environ[DRAIN_ENV] = saved
    grads = _grads(pipe.named_parameters())
    return _result([loss], grads, synced_at=sync.synced_at, drain=sync.drain, wall=wall)


def _reference_drain(world: int, dev: torch.device) -> Result:
    model, x, y, plan, stage, rank = _drain_plan(world)
    loss = _one_process(model, x, y, plan.n_microbatches, dev)
    return _result([loss], _grads(model.named_parameters()), p=world, stage=stage, rank=rank)


def _judge_drain(results: list[Result], ref: Result) -> tuple[str, str]:
    ok, detail = _agreement(results, ref, _TOL["fp32"])
    p, stage, rank = ref["extra"]["p"], ref["extra"]["stage"], ref["extra"]["rank"]
    synced = [(res["extra"]["synced_at"], res["extra"]["drain"]) for res in results]
    wall = max(res["extra"]["wall"] for res in results)
    # once, on the stage's rank, with the drain set for the step, and within the pipeline's timeout
    hooked = synced == [(p, f"{rank}:*") if r == rank else (None, None) for r in range(p)]
    seen = "synced" if hooked else f"SYNCED (at, drain) {synced}"
    detail = (f"{DRAIN_ENV}={rank}:*, device sync at micro-batch {p} of stage {stage} (rank {rank}): "
              f"{seen}; step {wall:.2f} s; {detail}")  # fmt: skip
    return _verdict(ok and hooked and wall < _TIMEOUT_S, detail)


FEATURES = (
    Feature("dp=2 with a mesh", _run_dp, _reference_dp, _judge_dp),
    Feature("tied weight across ranks", _run_tied, _reference_tied, _judge_tied),
    Feature("variable-length steps", _run_varlen, _reference_varlen, _judge_varlen),
    Feature("fp16 with GradScaler", _run_fp16, _reference_fp16, _judge_fp16),
    Feature("predict(dst=)", _run_predict, _reference_predict, _judge_predict),
    Feature("load_pretrained", _run_pretrained, _reference_pretrained, _judge_pretrained),
    Feature("drain mid-step", _run_drain, _reference_drain, _judge_drain),
)
# run in a launch of their own when not under torchrun: a rank that one of them ends (a drain's
# synchronize that nothing can interrupt: its deadline) takes that launch down, not the table
ALONE = ("drain mid-step",)


def _named(names: Sequence[str]) -> tuple[Feature, ...]:
    return tuple(f for f in FEATURES if f.name in names)


def run_features(control: Any, features: Sequence[Feature] = FEATURES) -> dict[str, tuple[str, Any]]:
    """On every rank: each feature's (status, result): "ok" and its result, "failed" and the error,
    "skipped" and why. Once one failed on any rank (agreed over ``control``, a gloo group), the rest
    are skipped: its pipeline may have closed the connections of the groups the next ones use."""
    dev = _device()
    out: dict[str, tuple[str, Any]] = {}
    failed: str | None = None
    for f in features:
        if failed is not None:
            out[f.name] = ("skipped", f"after the failed row {failed!r}")
            continue
        try:
            out[f.name] = ("ok", f.run(dev))
        except Skip as why:
            out[f.name] = ("skipped", str(why))
        except Exception as exc:  # this row's FAIL, named in the table
            traceback.print_exc()
            out[f.name] = ("failed", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
        statuses: list[Any] = [None] * dist.get_world_size(control)
        dist.all_gather_object(statuses, out[f.name][0], group=control)
        if "failed" in statuses:
            failed = f.name
        gc.collect()  # the row's pipelines, before the next row's
    return out


def feature_rows(per_rank: list[dict[str, tuple[str, Any]]], dev: torch.device, backend: str,
                 features: Sequence[Feature] = FEATURES) -> list[Row]:  # fmt: skip
    """The table's row of each feature, from every rank's ``run_features``: a rank's failure, or the
    judge's verdict against one process run on ``dev``."""
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows: list[Row] = []
    for f in features:
        label = f"{backend} {f.name}, {len(per_rank)} ranks"
        outcomes = [r[f.name] for r in per_rank]
        bad = next(((r, o) for r, o in enumerate(outcomes) if o[0] == "failed"), None)
        if bad is not None:
            rows.append((label, "FAIL", f"rank {bad[0]}: {bad[1][1]}"))
        elif any(o[0] == "skipped" for o in outcomes):
            rows.append((label, "skipped", next(o[1] for o in outcomes if o[0] == "skipped")))
        else:
            rows.append((label, *f.judge([o[1] for o in outcomes], f.reference(len(per_rank), dev))))
    return rows


def _killed(folder: str) -> None:
    rank, p, dev = dist.get_rank(), dist.get_world_size(), _device()
    Path(folder, f"pid{rank}").write_text(str(os.getpid()))
    model, x, y = _model(2 * p)
    pipe = _pipe(model, p, "1f1b", 1, 2 * p, dev)
    for k in range(3):
        if k == 1 and rank == 1:
            Path(folder, "killed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        pipe.step(x, y)


def check_killed(rows: list[Row], p: int, backend: str) -> None:
    label = f"killed rank ({backend}, {p} ranks)"
    with tempfile.TemporaryDirectory() as folder:
        try:
            launch(_killed, p, folder, backend=backend, timeout=120.0)
        except RankError as exc:
            named = time.time() - float(Path(folder, "killed_at").read_text())
            gone = all(not _alive(int(Path(folder, f"pid{r}").read_text())) for r in range(p))
            ok = exc.rank == 1 and named < 10.0 and gone
            left = "no process left" if gone else "PROCESSES LEFT"
            rows.append(
                (label, "ok" if ok else "FAIL", f"rank {exc.rank} named {named:.1f} s after the kill; {left}")
            )
            return
    rows.append((label, "FAIL", "the launch returned although rank 1 was killed"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- the table


def _print(rows: list[Row]) -> int:
    width = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<7}  {detail}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


def _single_gpu_rows() -> list[Row]:
    """The one-GPU checks, in a process with no process group of its own (each makes what it needs)."""
    rows: list[Row] = []
    checks = [check_stream_ordering, check_copy_stream, check_one_gpu, check_memory_one_gpu,
              check_no_host_sync, check_overhead, check_oom_stall, check_nccl_one_rank]  # fmt: skip
    for check in checks:
        _guarded(rows, check)
    return rows


def _guarded(rows: list[Row], check: Callable[[list[Row]], None]) -> None:
    """Run one check; an exception is its FAIL row (the traceback to stderr), not the table's end."""
    try:
        check(rows)
    except Exception as exc:  # a broken check must not hide the others' rows
        traceback.print_exc()
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        rows.append((getattr(check, "__name__", "a check"), "FAIL", f"{type(exc).__name__}: {first}"))


def _multi_rank_rows(
    per_rank: list[dict[str, Any]], dev: torch.device, backend: str, features: Sequence[Feature]
) -> list[Row]:
    """Every multi-rank row but the killed rank's, judged on ``dev`` against one process."""
    rows = _matrix_rows(per_rank, dev, backend)
    return rows + feature_rows([r["features"] for r in per_rank], dev, backend, features)


def _alone_rows(p: int, backend: str, dev: torch.device) -> list[Row]:
    """The ``ALONE`` features' rows, from a launch of their own: a rank that one of them ended is
    their FAIL, naming the rank (its stacks are on stderr)."""
    features = _named(ALONE)
    try:
        per_rank = launch(_launched_alone, p, ALONE, backend=backend, timeout=600.0)
    except RankError as exc:
        last = (str(exc).strip().splitlines() or [""])[-1][:160]
        return [(f"{backend} {f.name}, {p} ranks", "FAIL", f"rank {exc.rank}: {last}") for f in features]
    return feature_rows([r["features"] for r in per_rank], dev, backend, features)


def _under_torchrun(cuda: bool, name: str) -> int:
    """Every rank runs the multi-rank checks; the table is gathered over a gloo group and the world
    is destroyed; only then does rank 0 run the one-GPU checks and judge, alone: no rank ever waits
    for them (they take minutes; a peer waiting in a collective would time out or hold its GPU)."""
    init_distributed("nccl" if cuda else None)  # None: gloo, or its NCCL emulation if exported
    emulate, rank, dev = emulation.enabled(), dist.get_rank(), _device()
    control = control_group()
    mine = _rank_checks(control, FEATURES)  # the drain last: its deadline may end a rank (and the job)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine, group=control)
    del mine, control
    gc.collect()  # the rows' pipelines: nothing of ours holds the groups past destroy_process_group
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(f"torch {torch.__version__}, {len(per_rank)} ranks under torchrun, {name}")
    rows = _single_gpu_rows()  # the 1-rank NCCL row makes its own group now that the world is gone
    rows += _multi_rank_rows(per_rank, dev, "nccl-emulated" if emulate else "nccl", FEATURES)
    rows.append(("killed rank", "skipped", "torchrun tears the job down: run without torchrun"))
    return _print(rows)


def main() -> int:
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "no CUDA device"
    if "LOCAL_RANK" in os.environ and "MASTER_ADDR" in os.environ:
        return _under_torchrun(cuda, name)
    n_gpus = torch.cuda.device_count() if cuda else 0
    print(f"torch {torch.__version__}, {n_gpus} GPUs ({name})")
    rows = _single_gpu_rows()
    if n_gpus >= 2:
        p, backend = min(n_gpus, 8), "nccl"
    else:  # NCCL takes one GPU per rank: the multi-rank rows run on CPU ranks, emulated
        p, backend = 2, "nccl-emulated"
        if cuda:
            rows.append(("NCCL on several GPUs: schedules, memory, features, killed", "skipped",
                         "needs >= 2 GPUs"))  # fmt: skip
    rest = tuple(f.name for f in FEATURES if f.name not in ALONE)
    per_rank = launch(_launched, p, rest, backend=backend, timeout=600.0)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    rows += _multi_rank_rows(per_rank, dev, backend, _named(rest))
    rows += _alone_rows(p, backend, dev)
    check_killed(rows, p, backend)
    return _print(rows)


if __name__ == "__main__":
    raise SystemExit(main())
