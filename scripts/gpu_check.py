"""Prepared single-GPU check of the executor's CUDA path; runs (with CUDA parts skipped) on CPU too.

    python scripts/gpu_check.py            # about a minute on an H200, seconds on CPU

What one GPU allows: the copy stream with pinned host memory, all stages of an
interleaved schedule on one rank (world size 1, n_virtual 2..4, stages passing
tensors locally), gradients checked against a single-process CPU run, and a
pipeline step timed against the plain model. Prints one table.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.reference.models import gpt, gpt_loss
from pipeline.runtime import stream
from pipeline.runtime.pipe import Pipeline

M = 8


def _balance(n_layers: int, n_stages: int) -> list[int]:
    return [n_layers // n_stages + (1 if k < n_layers % n_stages else 0) for k in range(n_stages)]


def _model(big: bool) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    kw = dict(width=512, n_layers=8, n_heads=8, max_seq_len=128, batch_size=32) if big else {}
    model, x = gpt(**(kw or dict(width=32, n_layers=4, n_heads=2, max_seq_len=16, batch_size=16)))
    return model, x, torch.randint(0, 96, x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.abs().max().clamp_min(1e-12))


def check_streams(rows: list[tuple[str, str, str]]) -> None:
    if not torch.cuda.is_available():
        rows.append(("copy stream + pinned H2D", "skipped", "no CUDA device"))
        return
    dev = torch.device("cuda")
    host = stream.pin(torch.randn(1 << 22))
    copy, compute = stream.new_stream(dev), stream.current_stream(dev)
    out = stream.to_device(host, dev, copy, compute)
    ok = host.is_pinned() and torch.equal(out.cpu(), host)
    rows.append(("copy stream + pinned H2D", "ok" if ok else "FAIL", f"{host.numel() * 4 >> 20} MiB"))


def check_interleaved(rows: list[tuple[str, str, str]], device: torch.device) -> None:
    model, x, y = _model(big=False)
    ref_model, _, _ = _model(big=False)
    torch.autograd.backward(gpt_loss(ref_model(x), y))
    ref = {k: p.grad for k, p in ref_model.named_parameters() if p.grad is not None}
    for v in (2, 3, 4):
        model, _, _ = _model(big=False)
        pipe = Pipeline(model, _balance(len(model), v), schedule="interleaved-1f1b", n_virtual=v,
                        n_microbatches=M, loss_fn=gpt_loss, device=device)  # fmt: skip
        pipe.step(x, y)
        worst = max(_rel(p.grad, ref[k]) for k, p in pipe.named_parameters() if p.grad is not None)
        ok = worst < (1e-5 if device.type == "cpu" else 1e-3)  # TF32/cuBLAS vs CPU on a GPU
        label = f"interleaved v={v} on {device.type} vs CPU"
        rows.append((label, "ok" if ok else "FAIL", f"max rel {worst:.1e}"))


def _time(fn: object, device: torch.device, n: int) -> float:
    assert callable(fn)
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def check_step_time(rows: list[tuple[str, str, str]], device: torch.device) -> None:
    big = device.type == "cuda"
    model, x, y = _model(big)
    plain = model.to(device)
    xd, yd = x.to(device), y.to(device)

    def plain_step() -> None:
        torch.autograd.backward(gpt_loss(plain(xd), yd))

    t_plain = _time(plain_step, device, 10 if big else 3)
    model, x, y = _model(big)
    pipe = Pipeline(model, _balance(len(model), 2), schedule="interleaved-1f1b", n_virtual=2,
                    n_microbatches=M, loss_fn=gpt_loss, device=device)  # fmt: skip
    t_pipe = _time(lambda: pipe.step(x, y), device, 10 if big else 3)
    rows.append((f"step time on {device.type}: pipeline (v=2, m={M}) / plain", "info",
                 f"{t_pipe * 1e3:.1f} ms / {t_plain * 1e3:.1f} ms = {t_pipe / t_plain:.2f}x"))  # fmt: skip


def main() -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}")
    rows: list[tuple[str, str, str]] = []
    check_streams(rows)
    check_interleaved(rows, device)
    check_step_time(rows, device)
    width = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<7}  {detail}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
