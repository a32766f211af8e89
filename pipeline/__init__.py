"""stagewise's runtime: schedules as data, a simulator, and an executor across processes.

    pipeline/
      plan.py           Plan: what every rank of a run agrees on (balance, schedule, m, v, recompute)
      schedules/        the schedule IR, pure data (no processes, no torch.distributed): actions,
                        generators, schedule, validate, simulate, timeline, trace
      runtime/          what executes a plan: pipe (Pipeline), options, executor, program, stage,
                        p2p, metadata, stream, microbatch, recompute, grads, gather
      launch.py         start ranks: local processes, or join a torchrun job (startup.py: joining)
      checkpointing.py  save and load training state with torch.distributed.checkpoint
      reference/        reference models and data for the scripts, tests and examples (not the runtime)

Index letters, with these meanings in every module's comments (partitioner/ too):

    p   pipeline ranks (the devices of one pipeline); r a rank, q a peer rank
    v   stages per rank ("virtual" stages: 2 or more only for interleaved-1f1b)
    k   stages in all, k = p * v; s a stage, held by rank s % p (zb-v: the V, rank_of); c = s // p its chunk
    m   micro-batches per step; i a micro-batch
    n   layers of the model; l a layer
    t   a step of a rank's action list
    B, T, C, V   tensor shapes: batch, sequence, channels (width), vocabulary

``pipeline.schedule`` is the schedule factory; the IR's other names live in
``pipeline.schedules.<module>``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# first: NCCL_RUNTIME_CONNECT=0 unless set, before anything could make an NCCL communicator (nccl_env.py)
from pipeline.nccl_env import LazyConnectWarning
from pipeline.schedules.actions import Action, Kind, format_action, parse_action
from pipeline.schedules.schedule import SCHEDULES, Schedule, ScheduleError, forward_only, schedule
from pipeline.schedules.simulate import simulate
from pipeline.schedules.timeline import TimedAction, Timeline
from pipeline.schedules.trace import chrome_trace, render_grid, write_chrome_trace
from pipeline.schedules.validate import validate

if TYPE_CHECKING:
    from pipeline.launch import DistInfo, RankError, init_distributed, launch
    from pipeline.plan import Plan, StagePlan
    from pipeline.runtime.comm.p2p import PeerFailure, PipelineTimeout
    from pipeline.runtime.inputs.varlen import VarLen
    from pipeline.runtime.pipe import Pipeline
    from pipeline.runtime.step.recompute import CHECKPOINT_MODES, RECOMPUTE_MODES
    from pipeline.runtime.tensor.llama import parallelize_llama
    from pipeline.startup import StartupError

# The runtime (torch, processes) loads on first use, so that ``import pipeline.schedules`` is pure data.
_LAZY = {
    "DistInfo": "pipeline.launch",
    "RankError": "pipeline.launch",
    "init_distributed": "pipeline.launch",
    "launch": "pipeline.launch",
    "Plan": "pipeline.plan",
    "StagePlan": "pipeline.plan",
    "PeerFailure": "pipeline.runtime.comm.p2p",
    "StartupError": "pipeline.startup",
    "PipelineTimeout": "pipeline.runtime.comm.p2p",
    "Pipeline": "pipeline.runtime.pipe",
    "parallelize_llama": "pipeline.runtime.tensor.llama",
    "CHECKPOINT_MODES": "pipeline.runtime.step.recompute",
    "RECOMPUTE_MODES": "pipeline.runtime.step.recompute",
    "VarLen": "pipeline.runtime.inputs.varlen",
}


class _Package(types.ModuleType):
    """``pipeline.launch`` stays the function once the module ``pipeline/launch.py`` is imported too
    (the import system would set the package's attribute to the module, which ``from pipeline
    import launch`` would then return: the eager imports this package had before did the same)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "launch" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CHECKPOINT_MODES",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "Action",
    "DistInfo",
    "Kind",
    "LazyConnectWarning",
    "PeerFailure",
    "Pipeline",
    "PipelineTimeout",
    "Plan",
    "RankError",
    "Schedule",
    "ScheduleError",
    "StagePlan",
    "StartupError",
    "TimedAction",
    "Timeline",
    "VarLen",
    "chrome_trace",
    "format_action",
    "forward_only",
    "init_distributed",
    "launch",
    "parallelize_llama",
    "parse_action",
    "render_grid",
    "schedule",
    "simulate",
    "validate",
    "write_chrome_trace",
]
