"""The prepared GPU check: the pipeline's CUDA and NCCL path on this machine, one command, one table.

    python scripts/gpu_check.py                          # 1 GPU; with N >= 2 it spawns N NCCL ranks
    torchrun --nproc-per-node N scripts/gpu_check.py     # the same NCCL rows under torchrun

Rows (letters: p ranks, v stages per rank, m micro-batches):

  stream ordering        a stand-in transfer (a copy held back on a side stream, as NCCL's stream
                         runs late) consumed through the runtime's ordering: right; the same without
                         ordering, and ordered on another stream (the old bug), must read poison,
                         or the check could not see a missing ordering (FAIL)
  pinned copy stream     Executor.to_device behind a busy copy stream: pinned, ordered before compute
  one GPU, interleaved   all stages on one rank (v = 2..4) vs one process; busy time from CUDA events
  NCCL <schedule>        every schedule (interleaved with m = p and m = 2p), fp32 and bf16, step
                         and evaluate on p ranks vs one process running the same micro-batches
  memory <schedule>      micro-batches held per stage vs the plan's count (partitioner.memory);
                         on GPUs each rank's CUDA peak (Pipeline.memory_stats) vs plan_for's bytes
  killed rank            rank 1 SIGKILLed mid-step: named within seconds, no process left behind
  step time              ours vs torch.distributed.pipelining (1F1B), same model and devices

Without CUDA the GPU rows say "skipped" and the multi-rank rows run on 2 CPU ranks under
the strict NCCL emulation (STAGEWISE_EMULATE_NCCL), which runs the same NCCL code path on
gloo; a step-time row then also shows the emulation's own overhead. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import plan_for, profile
from partitioner.memory import in_flight
from pipeline.launch import RankError, init_distributed, launch
from pipeline.plan import Plan
from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime.comm import emulation
from pipeline.runtime.comm.channels import NcclTransfer
from pipeline.runtime.pipe import Pipeline

Row = tuple[str, str, str]
_VOCAB, _SEQ = 96, 16
_TOL = {"fp32": 1e-5, "bf16": 2e-2}  # bf16: same micro-batches, but GPU reductions are not bitwise


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


def _pipe(
    model: nn.Sequential, p: int, name: str, v: int, m: int, device: torch.device, group: Any = None
) -> Pipeline:
    plan = _plan(len(model), p, name, v, m)
    return Pipeline(model, plan, loss_fn=gpt_loss, device=device, group=group, timeout=60.0)


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


def check_stream_ordering(rows: list[Row], group: Any) -> None:
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


def check_copy_stream(rows: list[Row], group: Any) -> None:
    label = "pinned copy stream (Executor.to_device)"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    model, _, _ = _model(2)
    ex = _pipe(model, 1, "gpipe", 1, 1, dev, group).executor
    host = torch.randn(1 << 22)
    with torch.cuda.stream(ex.copy_stream):  # type: ignore[arg-type]
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # the copy stream is busy: compute must wait for the copy
    out = ex.to_device(host)
    ok = bool(torch.equal(out.cpu(), host))  # element by element: GPU and CPU sums round differently
    rows.append((label, "ok" if ok else "FAIL", f"{host.numel() * 4 >> 20} MiB, ordered before compute"))


def check_one_gpu(rows: list[Row], group: Any) -> None:
    if not torch.cuda.is_available():
        rows.append(("one GPU, interleaved v=2..4, busy from CUDA events", "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    model, x, y = _model(4)
    torch.autograd.backward(gpt_loss(model(x), y))
    ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    for v in (2, 3, 4):
        model, x, y = _model(4)
        pipe = _pipe(model, 1, "interleaved-1f1b", v, 8, dev, group)
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


def check_memory_one_gpu(rows: list[Row], group: Any) -> None:
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
        pipe = _pipe(model, 1, name, v, 8, dev, group)
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


def check_nccl_one_rank(rows: list[Row], group: Any) -> None:
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


_ALLOWED_SYNC = ("_loss", "float(value)")  # the step's one sync: its returned loss (Pipeline._loss)


def _sync_sites(fn: Any) -> list[str]:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``; each host sync as file:line in the
    library (the innermost frame under pipeline/ or partitioner/)."""
    import traceback
    import warnings

    sites: list[str] = []
    root = str(Path(__file__).resolve().parent.parent)

    def hook(message: Any, *args: Any, **kwargs: Any) -> None:
        if "called a synchronizing CUDA operation" not in str(message):
            return  # e.g. the mode's one-time notice that it is a prototype
        ours = [f for f in traceback.extract_stack()
                if f.filename.startswith(root) and "/scripts/" not in f.filename]  # fmt: skip
        if ours and (ours[-1].name, (ours[-1].line or "").split("return ")[-1]) == _ALLOWED_SYNC:
            return
        if ours:
            sites.append(f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}")
        else:  # raised off the Python stack (the autograd engine's device thread, say)
            sites.append(f"outside Python frames: {str(message).splitlines()[0][:80]}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def _first_sync(fn: Any) -> str:
    """Run ``fn`` under ``set_sync_debug_mode("error")``: where the first host sync raised."""
    import traceback

    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        root = str(Path(__file__).resolve().parent.parent)
        ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(root)]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
        return f"first at {where}: {str(exc).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "the error pass raised none"


def check_no_host_sync(rows: list[Row], group: Any) -> None:
    """One pipeline step (the second: the first allocates) under sync debug mode: the only host
    synchronisation allowed is the returned loss's, at the step's end."""
    label = "one step under set_sync_debug_mode: host syncs"
    if not torch.cuda.is_available():
        rows.append((label, "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    for name, v in (("interleaved-1f1b", 2), ("1f1b", 1), ("zb-h1", 1)):
        model, x, y = _model(4)
        pipe = _pipe(model, 1, name, v, 4, dev, group)
        pipe.step(x, y)
        torch.cuda.synchronize()
        sites = _sync_sites(lambda pipe=pipe, x=x, y=y: pipe.step(x, y))
        unique = sorted(set(sites))
        detail = "none but the returned loss" if not sites else f"{len(sites)}: " + "; ".join(unique[:6])
        if sites:  # the same step again, raising at its first sync: its traceback names the place
            detail += "; " + _first_sync(lambda pipe=pipe, x=x, y=y: pipe.step(x, y))
        rows.append((f"{label} ({name} v={v})", "ok" if not sites else "FAIL", detail))


def check_oom_stall(rows: list[Row], group: Any) -> None:
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


def check_overhead(rows: list[Row], group: Any) -> None:
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
    pipe = _pipe(model2, 1, "1f1b", 1, 8, dev, group)
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
    return [("gpipe", 1, 2 * p), ("1f1b", 1, 2 * p), ("zb-h1", 1, 2 * p),
            ("interleaved-1f1b", 2, p), ("interleaved-1f1b", 2, 2 * p)]  # fmt: skip


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank_checks() -> dict[str, Any]:
    """On every rank: each schedule x dtype (loss, evaluation, grads, held, peak memory), and step times."""
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
    out["time"] = _step_times(p, dev, emulate)
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


def _single_gpu_rows(group: Any = None) -> list[Row]:
    """``group``: a one-rank group under torchrun (the checks run on one process's GPU)."""
    rows: list[Row] = []
    checks = [check_stream_ordering, check_copy_stream, check_one_gpu, check_memory_one_gpu,
              check_no_host_sync, check_overhead, check_oom_stall]  # fmt: skip
    if group is None and not dist.is_initialized():  # a 1-rank world of its own: not under torchrun
        checks.append(check_nccl_one_rank)
    for check in checks:
        _guarded(rows, check, group)
    return rows


def _guarded(rows: list[Row], check: Any, group: Any) -> None:
    """Run one check; an exception is its FAIL row (the traceback to stderr), not the table's end."""
    import traceback

    try:
        check(rows, group)
    except Exception as exc:  # a broken check must not hide the others' rows
        traceback.print_exc()
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        rows.append((getattr(check, "__name__", "a check"), "FAIL", f"{type(exc).__name__}: {first}"))


def main() -> int:
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "no CUDA device"
    if "LOCAL_RANK" in os.environ and "MASTER_ADDR" in os.environ:  # under torchrun
        init_distributed("nccl" if cuda else None)  # None: gloo, or its NCCL emulation if exported
        solo = dist.new_group([0])  # every rank makes it; rank 0 runs the one-GPU checks in it
        rows = _single_gpu_rows(solo) if dist.get_rank() == 0 else []
        emulate = emulation.enabled()
        mine = _rank_checks()
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        if dist.get_rank() != 0:
            return 0
        print(f"torch {torch.__version__}, {dist.get_world_size()} ranks under torchrun, {name}")
        rows += _matrix_rows(per_rank, _device(), "nccl-emulated" if emulate else "nccl")
        rows.append(("killed rank", "skipped", "torchrun tears the job down: run without torchrun"))
        return _print(rows)
    n_gpus = torch.cuda.device_count() if cuda else 0
    print(f"torch {torch.__version__}, {n_gpus} GPUs ({name})")
    rows = _single_gpu_rows()
    if n_gpus >= 2:
        p, backend = min(n_gpus, 8), "nccl"
    else:  # NCCL takes one GPU per rank: the multi-rank rows run on CPU ranks, emulated
        p, backend = 2, "nccl-emulated"
        if cuda:
            rows.append(("NCCL on several GPUs: schedules, memory, killed", "skipped", "needs >= 2 GPUs"))
    per_rank = launch(_rank_checks, p, backend=backend, timeout=600.0)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    rows += _matrix_rows(per_rank, dev, backend)
    check_killed(rows, p, backend)
    return _print(rows)


if __name__ == "__main__":
    raise SystemExit(main())
