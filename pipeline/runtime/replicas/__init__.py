"""Data parallelism across pipeline replicas: ``mesh`` (the ("dp", "pp") DeviceMesh), ``dp`` (the
bucketed gradient reduction, started as each stage's gradients are final), ``replicas`` (their
wiring to a rank's executor and the loss's global mean) and ``gather`` (the whole state dict on one
rank). May import ``comm``, ``inputs`` and ``trace``; it names the executor by what it needs of it.
"""
