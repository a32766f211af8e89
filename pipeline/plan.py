"""``Plan``: the contract between the partitioner and the runtime.

    # letters: see pipeline/__init__.py (p ranks, v stages per rank, m micro-batches, s stage, l layer)

A plan holds everything every rank of a run must agree on: the balance (layers
per stage, stage s on rank ``rank_of(s)``: s % p, or the V for zb-v), the schedule's name, m, v, the
recomputation mode and ``dp``, the number of pipeline replicas that train on
different data (the world is dp x p ranks, see ``pipeline.runtime.replicas.mesh``), plus
what the partitioner predicted for one pipeline (per-stage times, memory and
bytes sent, the step time and bubble). ``partition`` makes one,
``Pipeline(model, plan, loss_fn=...)`` runs it, ``to_json`` / ``from_json`` carry it
between processes. A plan without predictions (``Plan(balance=[3, 4])``) is
valid too: that is what ``Pipeline`` builds from a plain balance list. What the
partitioner found besides (each rank's predicted peak, tied weights, a traced
model's graph and cuts, the auto search's runners-up) is in typed fields too. ``DeviceMemory``
is what a rank's device needs beyond the tensors the walk counts (workspaces, the allocator's
rounding) and the share of the limit kept free: the rule the memory limit is checked by, read by
the partitioner and by a variable-length run alike.

    stage  layers       fwd ms   bwd ms    cost ms  memory MB  sent MB
        0  0-2            1.20     2.40      3.600      12.50     0.52
        1  3-6            1.10     2.60      3.700      11.00     0.00
    balance [3, 4]  bottleneck 3.700  step 30.00 ms  bubble 0.200  [1f1b, m=4, v=1, recompute never]
"""

from __future__ import annotations

import functools
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from pipeline.runtime.step.recompute import Recompute, check_recompute, mode_of
from pipeline.schedules.peaks import StageBytes
from pipeline.schedules.program import Program
from pipeline.schedules.registry import entry
from pipeline.schedules.schedule import Schedule, default_n_virtual, rank_of, schedule, schedule_options

# what every rank of a replicated or sharded pipeline (dp x shard > 1) holds through a step beside its
# stages: the replicas' row count and this replica's share of the batch (runtime/replicas/dp.py),
# one tensor of REPLICA_DTYPE each; the partitioner counts them (Composition.replica_bytes)
REPLICA_DTYPE = torch.float64
REPLICA_BYTES = 2 * REPLICA_DTYPE.itemsize


def replica_bytes(dp: int, shard: int) -> float:
    """What each rank holds beside its stages' layers when another rank holds a copy or a shard of
    them (dp x shard > 1): the replicas' scalars (``REPLICA_BYTES``); 0 otherwise."""
    return float(REPLICA_BYTES) if dp * shard > 1 else 0.0


__all__ = ["Candidate", "DeviceMemory", "Plan", "SearchStats", "StagePlan", "TracedGraph"]

_UNITS = {
    "time": ("cost ms", 1e3),
    "flops": ("GFLOP", 1e-9),
    "params": ("params MB", 1e-6),
    "uniform": ("layers", 1.0),
}


@dataclass(frozen=True)
class StagePlan:
    """One stage's prediction: layers [start, stop), times (s), memory and the bytes it sends forward.

    ``backward_time`` is the whole backward; ``weight_time`` the part of it that is the
    weight gradient (what a split-backward schedule such as zb-h1 runs as W), 0 if unknown.

    For micro-batches of other shapes (``pipeline.runtime.inputs.varlen``): ``*_squared``, the share of
    each time that grows as rows x length² at fixed tokens (attention), the rest growing as the
    tokens, from the profile's flops (``partitioner.lengths``; 0: all as the tokens); ``held``,
    the figures of one micro-batch that the memory walk holds (``pipeline.schedules.peaks``),
    each with its own share; None for a plan made without them.
    """

    start: int
    stop: int
    names: list[str]
    forward_time: float
    backward_time: float
    cost: float  # what the balance minimised the max of, in the plan's cost unit
    memory_bytes: float
    sent_bytes: int
    weight_time: float = 0.0
    forward_squared: float = 0.0
    backward_squared: float = 0.0
    weight_squared: float = 0.0
    held: StageBytes | None = None

    def __post_init__(self) -> None:
        if isinstance(self.held, dict):  # JSON gives the record as a dict
            object.__setattr__(self, "held", StageBytes(**_known(StageBytes, self.held)))


@dataclass(frozen=True, kw_only=True)
class TracedGraph:
    """How ``partition`` traced a model that is not an ``nn.Sequential``: what every rank traces again,
    and checks its model against, to build its stages (``pipeline.runtime.trace.graph_stages``)."""

    method: str  # "export" or "symbolic_trace"
    fingerprint: str  # identifies the graph: its layers, their calls, the sample's signature
    sample: list[tuple[list[int], str]]  # per input of the sample: its shape and dtype name
    layers: list[str] = field(default_factory=list)  # the layers' names in order, to name a difference
    stages: int = 2  # the stages its layers were grouped for (trace.layers: which modules are opened)

    def __post_init__(self) -> None:  # JSON gives lists: the same values either way, so equal plans
        object.__setattr__(self, "sample", [(list(shape), str(dtype)) for shape, dtype in self.sample])
        object.__setattr__(self, "layers", list(self.layers))


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A configuration the auto search ranked, with its predicted step (s), bubble and peak bytes per rank."""

    schedule: str
    n_microbatches: int
    n_virtual: int
    recompute: Recompute  # one mode, or one per stage
    balance: list[int]
    step_time: float
    bubble: float
    peak_bytes: list[float]

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, str):  # JSON has no tuples: one mode per stage
            object.__setattr__(self, "recompute", tuple(self.recompute))
        object.__setattr__(self, "balance", list(self.balance))
        object.__setattr__(self, "peak_bytes", [float(x) for x in self.peak_bytes])


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    """What the auto search did: configurations in its grid, simulated, skipped by each bound; seconds."""

    grid: int = 0
    simulated: int = 0
    pruned_group: int = 0  # skipped with their (schedule, v, m) group
    pruned_fit: int = 0  # no balance fits the memory limit
    pruned_balance: int = 0  # their balance's bound reached the best step found
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """What a rank's device holds beyond the tensors the plan counts (``Plan.rank_peaks``, the walk),
    and how much of its memory limit is kept free; measured once by the profile on its device
    (``partitioner.device_memory``). The default is a CPU's: nothing beyond the tensors.

    A rank fits its limit L when (one rule: ``usable``; ``need`` and ``limit_for`` are its inverses)::

        need(peak) = peak * (1 + rounding) + workspace_bytes  <=  L * (1 - headroom)

    ``workspace_bytes``: the BLAS workspaces (cuBLAS, cuBLASLt) that a step's matrix products
    allocate and keep, one per (thread, stream): the forward's and autograd's backward's, once per
    rank whatever its stages. ``block_bytes``: the allocator rounds each allocation up to a
    multiple of it (CUDA's caching allocator: 512; 1: no rounding). ``rounding``: the fraction that
    rounding adds to the bytes the walk counts. ``headroom``: the fraction of the limit left free,
    so that a plan at its limit does not make a failed cudaMalloc free the allocator's cache and
    synchronise the device in the middle of a step (``partition(..., memory_headroom=...)``).
    """

    device: str = "cpu"  # where it was measured
    workspace_bytes: float = 0.0
    block_bytes: int = 1
    rounding: float = 0.0
    headroom: float = 0.0

    def __post_init__(self) -> None:
        for name in ("workspace_bytes", "rounding"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x >= 0):
                raise ValueError(
                    f"DeviceMemory.{name} ({x!r}) must be a finite number >= 0; measure it with "
                    "partitioner.device_memory.measure_device_memory"
                )
        block = self.block_bytes
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"DeviceMemory.block_bytes ({block!r}) must be an integer >= 1 (1: no rounding)")
        check_headroom(self.headroom, "DeviceMemory.headroom")

    def usable(self, limit: float) -> float:
        """The most bytes the walk (``Plan.rank_peaks``) may hold on a rank whose limit is ``limit``."""
        return (limit * (1.0 - self.headroom) - self.workspace_bytes) / (1.0 + self.rounding)

    def need(self, peak: float) -> float:
        """The device bytes a rank whose walked peak is ``peak`` holds: with workspaces and rounding."""
        return peak * (1.0 + self.rounding) + self.workspace_bytes

    def limit_for(self, peak: float) -> float:
        """The least limit whose ``usable`` bytes hold a walked peak of ``peak``."""
        return self.need(peak) / (1.0 - self.headroom)

    @property
    def reserves(self) -> bool:
        """Whether anything is reserved beyond the walk (False: a limit is the walk's own, as on CPU)."""
        return bool(self.workspace_bytes or self.rounding or self.headroom)

    def describe(self) -> str:
        """What a limit keeps beyond the walk, and how to change each part (for messages)."""
        return (
            f"each rank's limit keeps {self.workspace_bytes / 2**20:.2f} MiB for the matrix products' "
            f"workspaces on {self.device} (torch.backends.cuda.cublas_workspace_size, "
            f"CUBLAS_WORKSPACE_CONFIG), {self.rounding:.2%} of the counted bytes for the allocator's "
            f"rounding to {self.block_bytes} B, and {self.headroom:.0%} of itself free "
            "(memory_headroom=)"
        )


def check_headroom(value: object, name: str = "memory_headroom") -> None:
    """ValueError unless ``value`` is a fraction in [0, 1): the share of a memory limit kept free."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{name} ({value!r}) must be a fraction in [0, 1): the share of each rank's memory limit kept "
            "free for the allocator (0.1 keeps 10 %)"
        )


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Balance, schedule, m, v, recomputation and predictions; checked when made (see ``schedule_options``).

    ``n_microbatches`` and ``n_virtual`` default as everywhere: m = p, v = 2 for
    interleaved-1f1b and 1 otherwise, with p = len(balance) / v ranks.
    """

    balance: list[int]
    schedule: str = "1f1b"
    n_microbatches: int = 0  # 0: the default, m = p (filled in when the plan is made)
    n_virtual: int = 0  # 0: the default for the schedule
    recompute: Recompute = "never"  # one mode, or a tuple of one per stage (see recompute_of)
    dp: int = 1  # pipeline replicas (data parallelism): the world is dp x shard x n_ranks x tp
    shard: int = 1  # FSDP2 per stage: each stage's parameters, gradients and optimizer state in shard parts
    tp: int = 1  # tensor parallelism: each stage's layers split over tp ranks (a parallelize_fn)
    zero: int = 2  # with shard > 1: 2 keeps parameters gathered through a step, 3 reshards after use
    # predictions; empty for a plan that was not predicted
    stages: list[StagePlan] = field(default_factory=list)
    bottleneck: float = 0.0
    step_time: float = 0.0  # seconds for one step of n_microbatches
    bubble: float = 0.0
    cost: str = "time"  # the unit of StagePlan.cost and bottleneck
    prediction: str = "none"  # "simulator" when predicted
    # what the partitioner found besides; empty for a plan it did not make
    rank_peaks: list[float] = field(default_factory=list)  # per rank, peak bytes: its program walked
    ties: dict[str, list[int]] = field(default_factory=dict)  # tied parameter name -> the stages holding it
    cuts: list[str] = field(default_factory=list)  # a traced model: the layer each stage but the first begins
    problems: list[str] = field(default_factory=list)  # (plan_for) impossible cuts, stages without parameters
    graph: TracedGraph | None = None  # a traced model: how, to trace it again on every rank
    autocast: str | None = None  # the dtype the profile ran under (None: fp32)
    loss_profiled: bool = False  # the last stage's predictions include the loss
    # the auto search (partition(..., schedule="auto")) only
    candidates: list[Candidate] = field(default_factory=list)  # the configs within reach, fastest first
    search: SearchStats | None = None  # how much of the grid it simulated and pruned, and its seconds
    batch_size: int = 0  # rows of one step (one replica's)
    micro_batch_rows: int = 0  # batch_size // n_microbatches
    # the micro-batch every per-micro-batch prediction is for: (rows, length), the profiled
    # sample's two leading sizes (the auto search's rows); empty: unknown
    micro_batch_shape: list[int] = field(default_factory=list)
    memory_limit: list[float] = field(default_factory=list)  # per rank, what partition was given; empty: none
    # what each rank's device needs beyond rank_peaks, and the limit's share kept free (the profile's)
    device_memory: DeviceMemory = field(default_factory=DeviceMemory)

    def __post_init__(self) -> None:
        balance = self.balance
        if (
            isinstance(balance, str | bytes)
            or not hasattr(balance, "__len__")
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in balance)
        ):
            raise TypeError(f"balance must be a list of layer counts per stage, got {balance!r}")
        if not balance or any(b < 1 for b in balance):
            raise ValueError(f"balance {list(balance)} must hold at least one stage, each of >= 1 layers")
        object.__setattr__(self, "balance", list(balance))
        v_given = self.n_virtual or None
        v = v_given if v_given is not None else default_n_virtual(self.schedule)
        if isinstance(v, int) and v >= 1 and len(balance) % v != 0:
            raise ValueError(
                f"balance has {len(balance)} stages, not a multiple of n_virtual ({v}) stages per rank; "
                f"give {v} x (number of ranks) layer counts or change n_virtual"
            )
        n_ranks = len(balance) // v if isinstance(v, int) and v >= 1 else len(balance)
        v, m = schedule_options(self.schedule, n_ranks, self.n_microbatches or None, v_given)
        object.__setattr__(self, "n_virtual", v)
        object.__setattr__(self, "n_microbatches", m)
        object.__setattr__(self, "recompute", check_recompute(self.recompute, len(balance)))
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(
                f"dp ({self.dp!r}) must be an integer >= 1: the number of pipeline replicas (1: no data "
                "parallelism)"
            )
        for name, what in (("shard", "FSDP parts of each stage (1: no sharding)"),
                           ("tp", "tensor-parallel ranks per stage (1: none)")):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1: the number of {what}")
        if self.zero not in (2, 3) or isinstance(self.zero, bool):
            raise ValueError(
                f"zero ({self.zero!r}) must be 2 (parameters gathered once per step and kept through it) "
                "or 3 (resharded after each forward and backward: less memory, more all-gathers)"
            )
        if self.stages and len(self.stages) != len(balance):
            raise ValueError(f"plan has {len(self.stages)} stage predictions for {len(balance)} stages")
        self._check_found()

    def _check_found(self) -> None:
        """The partitioner's findings, typed: a plain dict where a record belongs (the old ``extra``'s
        form) or a lone string for a list is refused, naming the field; lists are copied as lists."""
        if not isinstance(self.device_memory, DeviceMemory):
            raise TypeError(
                f"device_memory must be a DeviceMemory, got {type(self.device_memory).__name__} "
                f"{self.device_memory!r}; build one (DeviceMemory(...)), or read a recorded plan with "
                "Plan.from_json"
            )
        for name, kind in (("graph", TracedGraph), ("search", SearchStats)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(
                    f"{name} must be a {kind.__name__} or None, got {type(value).__name__} {value!r}; build "
                    f"one ({kind.__name__}(...)), or read a recorded plan with Plan.from_json"
                )
        peaks = _listed(self.rank_peaks, "rank_peaks", (int, float), "peak bytes, one per rank")
        object.__setattr__(self, "rank_peaks", [float(x) for x in peaks])
        object.__setattr__(self, "cuts", _listed(self.cuts, "cuts", str, "layer names"))
        object.__setattr__(self, "problems", _listed(self.problems, "problems", str, "messages"))
        object.__setattr__(self, "candidates", _listed(self.candidates, "candidates", Candidate, "Candidate"))
        if not isinstance(self.ties, dict) or not all(isinstance(k, str) for k in self.ties):
            raise TypeError(
                f"ties must be a dict of parameter name -> the stages holding it (e.g. {{'wte.weight': "
                f"[0, 3]}}), got {type(self.ties).__name__} {self.ties!r}"
            )
        ties = {name: _listed(at, f"ties[{name!r}]", int, "stage indices") for name, at in self.ties.items()}
        object.__setattr__(self, "ties", ties)
        for name in ("batch_size", "micro_batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 0 (0: not searched)")
        shape = _listed(self.micro_batch_shape, "micro_batch_shape", int, "sizes: [rows, length]")
        if shape and (len(shape) != 2 or min(shape) < 1):
            raise ValueError(
                f"micro_batch_shape ({shape!r}) must be [rows, length], both >= 1, or empty (unknown)"
            )
        object.__setattr__(self, "micro_batch_shape", shape)
        limits = _listed(self.memory_limit, "memory_limit", (int, float), "bytes, one per rank")
        if limits and len(limits) != self.n_ranks:
            raise ValueError(
                f"memory_limit has {len(limits)} entries for {self.n_ranks} ranks; give one per rank, or none"
            )
        object.__setattr__(self, "memory_limit", [float(x) for x in limits])

    # ---- shape

    @property
    def n_ranks(self) -> int:
        """p: the pipeline's ranks (devices)."""
        return len(self.balance) // self.n_virtual

    @property
    def n_stages(self) -> int:
        """All stages, p * v."""
        return len(self.balance)

    @property
    def world_size(self) -> int:
        """All ranks of a run of this plan: dp replicas of ``shard`` x p x ``tp`` ranks."""
        return self.dp * self.shard * self.n_ranks * self.tp

    @property
    def n_layers(self) -> int:
        return sum(self.balance)

    def recompute_of(self, stage: int) -> str:
        """Stage ``stage``'s recomputation mode (``recompute`` is one mode, or one per stage)."""
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} is not one of the plan's stages 0..{self.n_stages - 1}")
        return mode_of(self.recompute, stage)

    def build_schedule(self) -> Schedule:
        """The plan's ``Schedule`` (built once per plan, validated)."""
        return _build(self.schedule, self.n_ranks, self.n_microbatches, self.n_virtual)

    def program(self, rank: int) -> Program:
        """Rank ``rank``'s step as data, one instruction per line when printed (``Schedule.program``),
        with the plan's ``dp`` replicas and tied weights."""
        return self.build_schedule().program(rank, dp=self.dp, ties=list(self.ties.values()))

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes`` applied and checked again (predictions are kept as they are)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Plan(**values)

    # ---- the model

    def split(self, model: nn.Sequential) -> list[nn.Sequential]:
        """The model's own layers in one ``nn.Sequential`` per stage, keyed by their names in the
        model, so stage parameter names are ``"{layer name}.{name}"`` as in the model."""
        n = self.n_layers
        if not isinstance(model, nn.Sequential) or len(model) != n:
            got = f"{len(model)} layers" if isinstance(model, nn.Sequential) else type(model).__name__
            raise ValueError(
                f"this plan splits an nn.Sequential of {n} layers, got {got}; plan it again for this model"
            )
        keys = list(model._modules)
        out, start = [], 0
        for size in self.balance:
            out.append(nn.Sequential(OrderedDict((keys[k], model[k]) for k in range(start, start + size))))
            start += size
        return out

    @property
    def rank_needs(self) -> list[float]:
        """Per rank, the device bytes its predicted peak takes: ``rank_peaks`` with the workspaces and
        the allocator's rounding (``DeviceMemory.need``); the same as ``rank_peaks`` on CPU."""
        return [self.device_memory.need(peak) for peak in self.rank_peaks]

    def usable_limits(self, limits: list[float] | None = None) -> list[float]:
        """Per rank, the most bytes the walk may hold within ``limits`` (default: ``memory_limit``),
        the device's reserve taken off (``DeviceMemory.usable``); empty when there is no limit."""
        given = self.memory_limit if limits is None else limits
        return [self.device_memory.usable(limit) for limit in given]

    def predicted_busy(self) -> list[float]:
        """Per rank, the predicted compute seconds of one step: m x (forward + backward) of its stages."""
        p, placement = self.n_ranks, entry(self.schedule).placement
        per_stage = [self.n_microbatches * (st.forward_time + st.backward_time) for st in self.stages]
        return [sum(x for s, x in enumerate(per_stage) if rank_of(placement, p, s) == r) for r in range(p)]

    # ---- text

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan ``to_json`` wrote; also one written before the typed fields, whose findings were in
        an ``"extra"`` object (its known keys are read into their fields, any others dropped)."""
        data = json.loads(text)
        old = data.pop("extra", None) or {}
        for key, value in old.items():
            name = _OLD_KEYS.get(key, key)
            if name in _FOUND and name not in data:
                data[name] = value
        data["stages"] = [StagePlan(**s) for s in data.get("stages", [])]
        if isinstance(data.get("recompute"), list):  # JSON has no tuples: one mode per stage
            data["recompute"] = tuple(data["recompute"])
        if data.get("graph") is not None:
            data["graph"] = TracedGraph(**_known(TracedGraph, data["graph"]))
        if data.get("search") is not None:
            data["search"] = SearchStats(**_known(SearchStats, data["search"]))
        if isinstance(data.get("device_memory"), dict):
            data["device_memory"] = DeviceMemory(**_known(DeviceMemory, data["device_memory"]))
        data["candidates"] = [Candidate(**_known(Candidate, c)) for c in data.get("candidates", [])]
        return cls(**data)

    def summary(self) -> str:
        """The configuration in one line: ``[1f1b, m=4, v=1, recompute never]``, with ``, dp=2``,
        ``, shard=2, zero=2`` and ``, tp=2`` where those dimensions are used."""
        dp = "".join(f", {k}={getattr(self, k)}" for k in ("dp", "shard", "tp") if getattr(self, k) > 1)
        dp += f", zero={self.zero}" if self.shard > 1 else ""
        mode = self.recompute if isinstance(self.recompute, str) else f"({', '.join(self.recompute)})"
        return f"[{self.schedule}, m={self.n_microbatches}, v={self.n_virtual}, recompute {mode}{dp}]"

    def table(self, title: str = "", reference: float | None = None) -> str:
        """The stage table; with ``reference`` (another plan's bottleneck) adds the ratio to it."""
        unit, scale = _UNITS.get(self.cost, ("cost", 1.0))
        lines = [title] if title else []
        if self.stages:
            cols = ("fwd ms", "bwd ms", unit, "memory MB", "sent MB")
            widths = (8, 8, 10, 10, 8)
            cells = (f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
            lines.append(f"{'stage':>5}  {'layers':<9} " + " ".join(cells))
            for s, st in enumerate(self.stages):
                rng = f"{st.start}-{st.stop - 1}" if st.stop - st.start > 1 else f"{st.start}"
                lines.append(
                    f"{s:>5}  {rng:<9} {st.forward_time * 1e3:>8.2f} {st.backward_time * 1e3:>8.2f} "
                    f"{st.cost * scale:>10.3f} {st.memory_bytes / 1e6:>10.2f} {st.sent_bytes / 1e6:>8.2f}"
                )
            rel = "" if reference is None or reference == 0 else f" ({self.bottleneck / reference:.3f}x ours)"
            lines.append(
                f"balance {self.balance}  bottleneck {self.bottleneck * scale:.3f}{rel}  "
                f"step {self.step_time * 1e3:.2f} ms  bubble {self.bubble:.3f}  {self.summary()}"
            )
        else:
            lines.append(f"balance {self.balance}  {self.summary()} (no predictions)")
        dm = self.device_memory
        if dm.reserves and self.rank_peaks:
            needs = ", ".join(f"{x / 1e6:.2f}" for x in self.rank_needs)
            lines.append(
                f"device memory per rank: peak + {dm.workspace_bytes / 1e6:.2f} MB workspaces + "
                f"{dm.rounding:.2%} rounding = {needs} MB on {dm.device}; {dm.headroom:.0%} of the limit "
                "kept free"
            )
        if self.cuts:
            lines.append("cuts before " + ", ".join(self.cuts))
        if self.ties:
            ties = "; ".join(f"{name}: stages {stages}" for name, stages in self.ties.items())
            lines.append(f"tied weights {ties}")
        if self.candidates:
            lines.append("candidates (auto search, fastest first):")
            lines.append(self.candidates_table())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def candidates_table(self) -> str:
        """``candidates`` as a printable table, one configuration per line."""
        rows = self.candidates
        if not rows:
            return "no candidates (the plan was not made by the auto search)"
        lines = [
            f"{'#':>2}  {'schedule':<16} {'m':>4} {'v':>3}  {'step ms':>9} {'bubble':>7} "
            f"{'peak MB (max)':>13}  recompute / balance"
        ]
        for at, c in enumerate(rows):
            mode = c.recompute if isinstance(c.recompute, str) else ",".join(c.recompute)
            lines.append(
                f"{at:>2}  {c.schedule:<16} {c.n_microbatches:>4} {c.n_virtual:>3}  "
                f"{c.step_time * 1e3:>9.2f} {c.bubble:>7.3f} {max(c.peak_bytes) / 1e6:>13.2f}  "
                f"{mode} / {c.balance}"
            )
        return "\n".join(lines)


# the findings a plan written before the typed fields kept in "extra" (each under its field's name
# but "loss"); any other key there (a script's note) has no field and is dropped
_FOUND = ("rank_peaks", "ties", "cuts", "problems", "graph", "autocast", "loss_profiled", "candidates",
          "search", "batch_size", "micro_batch_rows")  # fmt: skip
_OLD_KEYS = {"loss": "loss_profiled"}


def _listed(value: Any, name: str, kind: type | tuple[type, ...], what: str) -> list[Any]:
    """``value`` as a list, or a TypeError naming ``name`` when it is no sequence of ``kind``."""
    items = None if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__") else list(value)
    if items is None or not all(isinstance(x, kind) and not isinstance(x, bool) for x in items):
        raise TypeError(
            f"{name} must be a list of {what}, got {type(value).__name__} {value!r}; pass a list, or leave "
            "it out (the partitioner fills it in)"
        )
    return items


def _known(cls: type, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without the keys that are no field of ``cls`` (an older or newer writer's)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in record.items() if k in names}


@functools.lru_cache(maxsize=64)
def _build(name: str, n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    return schedule(name, n_ranks, n_microbatches, n_virtual=n_virtual)
