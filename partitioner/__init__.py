"""stagewise partitioner: profile a model, split it exactly, and plan the stages.

    # p: ranks, v: stages per rank, k = p * v stages

>>> plan = partition(model, 4, sample)        # 4 ranks; sample: one micro-batch
>>> plan = partition(model, 4, sample, autocast=torch.bfloat16, loss_fn=loss, target=y)
>>> print(plan); stages = plan.split(model)   # an nn.Sequential's stages
>>> plan = partition(model, 4, sample, schedule="auto", batch_size=64, memory_limit=8e9)
>>> print(plan.candidates_table())            # schedule, m, v, recompute per stage: the runners-up

``model`` is an ``nn.Sequential`` (its children are the layers) or any module ``torch.export``
(or ``torch.fx.symbolic_trace``) can trace: its layers are then groups of its traced calls, one
per submodule such as a transformer block (``pipeline.runtime.trace.tracing``), and a cut costs every
tensor live across it (``graph_profile``, ``graph``). Tied weights are in ``plan.ties``.

``Plan``, ``StagePlan`` and ``DeviceMemory`` (what a device holds beyond the tensors the plan
counts, ``partitioner.device_memory``) are ``pipeline.plan``'s (one definition, re-exported here):
the partitioner makes plans, the runtime runs them. Imports go one way, partitioner -> pipeline.
"""

from partitioner.baselines import equal_balance, torchgpipe_balance
from partitioner.costs import COSTS, cut_groups, layer_costs
from partitioner.device_memory import measure_device_memory
from partitioner.figures import LayerProfile
from partitioner.flops import FlopCount
from partitioner.graph import cut_bytes, layer_graph
from partitioner.graph_profile import profile_graph
from partitioner.links import Links, measure_links
from partitioner.memory import held, in_flight, layer_memory
from partitioner.noise import NoisyProfileWarning
from partitioner.overhead import DEFAULT_RUNTIME, RuntimeCosts, measure_runtime
from partitioner.partition import partition, plan_for
from partitioner.profile import Profile, profile
from partitioner.scaling import batch_rows, scale_profile
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict
from pipeline.plan import DeviceMemory, Plan, StagePlan
from pipeline.runtime.step.live import LiveBytes

__all__ = [
    "COSTS",
    "DEFAULT_RUNTIME",
    "DeviceMemory",
    "FlopCount",
    "LayerProfile",
    "Links",
    "LiveBytes",
    "NoisyProfileWarning",
    "Plan",
    "Profile",
    "RuntimeCosts",
    "StagePlan",
    "batch_rows",
    "cut_bytes",
    "cut_groups",
    "equal_balance",
    "held",
    "in_flight",
    "layer_costs",
    "layer_graph",
    "layer_memory",
    "measure_device_memory",
    "measure_links",
    "measure_runtime",
    "partition",
    "plan_for",
    "predict",
    "profile",
    "profile_graph",
    "scale_profile",
    "solve",
    "stage_costs",
    "stage_memory",
    "torchgpipe_balance",
]
