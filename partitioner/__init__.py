"""stagewise partitioner: profile an ``nn.Sequential``, split it exactly, and plan the stages.

    # p: ranks, v: stages per rank, k = p * v stages

>>> plan = partition(model, 4, sample)        # 4 ranks; sample: one micro-batch
>>> print(plan); stages = plan.split(model)

``Plan`` and ``StagePlan`` are ``pipeline.plan``'s (one definition, re-exported here): the
partitioner makes plans, the runtime runs them. Imports go one way, partitioner -> pipeline.
"""

from partitioner.baselines import equal_balance, torchgpipe_balance
from partitioner.figures import LayerProfile
from partitioner.graph import cut_bytes, layer_graph
from partitioner.memory import held, in_flight, layer_memory
from partitioner.partition import COSTS, layer_costs, partition, plan_for
from partitioner.profile import Profile, profile
from partitioner.solve import solve, stage_costs, stage_memory
from partitioner.timing import predict
from pipeline.plan import Plan, StagePlan

__all__ = [
    "COSTS",
    "LayerProfile",
    "Plan",
    "Profile",
    "StagePlan",
    "cut_bytes",
    "equal_balance",
    "held",
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
