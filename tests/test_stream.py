from __future__ import annotations

import pytest
import torch

from pipeline.runtime.comm import stream
from pipeline.runtime.comm.emulation import DEFAULT, EmuStream
from pipeline.runtime.comm.stream import CPUStream

cpu = torch.device("cpu")


def test_cpu_stand_in() -> None:
    assert stream.new_stream(cpu) is CPUStream
    assert stream.current_stream(cpu) is CPUStream
    assert stream.default_stream(cpu) is CPUStream
    assert not stream.is_cuda(CPUStream)
    with stream.use_stream(CPUStream):
        x = torch.ones(2) * 2
    stream.wait_stream(CPUStream, CPUStream)
    stream.record_stream(x, CPUStream)  # no-op on CPU
    assert stream.to_device(x, cpu, CPUStream, CPUStream) is x


def test_pin_only_for_a_cuda_target() -> None:
    x = torch.ones(3)
    assert stream.pin(x) is x and stream.pin(x, cpu) is x  # a CPU run never touches CUDA, GPU host or not
    if torch.cuda.is_available():
        assert stream.pin(x, torch.device("cuda")).is_pinned()


def test_emulated_streams_and_events() -> None:
    side = stream.new_stream(cpu, emulated=True, name="copy")
    assert isinstance(side, EmuStream) and not stream.is_cuda(side)
    assert stream.current_stream(cpu, emulated=True) is DEFAULT is stream.default_stream(cpu, True)
    with stream.use_stream(side):
        assert stream.current_stream(cpu, emulated=True) is side
    assert stream.current_stream(cpu, emulated=True) is DEFAULT
    event = stream.record_event(side)
    assert stream.event_done(event) and stream.event_done(stream.record_event(CPUStream))
    stream.wait_event(DEFAULT, event)  # ordering itself is tested in test_nccl_emulation.py


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.py runs this)")
def test_cuda_copy_is_ordered_before_compute() -> None:
    dev = torch.device("cuda")
    copy, compute = stream.new_stream(dev), stream.current_stream(dev)
    host = stream.pin(torch.arange(1 << 20, dtype=torch.float32))
    out = stream.to_device(host, dev, copy, compute)
    assert torch.equal(out.sum().cpu(), host.sum())
