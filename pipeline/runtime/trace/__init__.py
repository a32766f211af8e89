"""A model as stages: ``tracing`` and ``traced`` (any ``torch.export``-traceable module cut into
stage modules), ``untraceable``, ``layers``, ``sizes``, ``shape_memo`` and ``shape_rules`` (what each
stage makes and returns, at any shape), ``modes`` (training and evaluation in a traced stage),
``materialize`` (a meta-device model's stages made real, each rank its own), ``graph_stages``
(stages from a plan's traced graph) and ``ties`` (weights tied across stages, their gradients
summed). May import ``comm`` and ``inputs``.
"""
