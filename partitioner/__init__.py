"""stagewise partitioner: profile an ``nn.Sequential``, split it exactly, and plan the stages.

>>> plan = partition(model, 4, sample)        # sample: one micro-batch
>>> print(plan); stages = plan.split(model)
"""

from partitioner.baselines import equal_balance, torchgpipe_balance
from partitioner.graph import cut_bytes, layer_graph
from partitioner.memory import in_flight, layer_memory
from partitioner.partition import COSTS, layer_costs, partition, plan_for
from partitioner.plan import Plan, StagePlan
from partitioner.profile import LayerProfile, Profile, profile
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict

__all__ = [
    "COSTS",
    "LayerProfile",
    "Plan",
    "Profile",
    "StagePlan",
    "cut_bytes",
    "equal_balance",
    "in_flight",
    "layer_costs",
    "layer_graph",
    "layer_memory",
    "partition",
    "plan_for",
    "predict",
    "profile",
    "solve",
    "stage_costs",
    "stage_memory",
    "torchgpipe_balance",
]
