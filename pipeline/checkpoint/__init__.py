"""What ``pipeline.checkpointing`` writes: the state of a training loop as flat named entries.

    state.py    the entries (model, optimizer, scheduler, scaler, RNG, extra) and their rules
    optim.py    the optimizer per parameter name, so that param groups re-shard
    legacy.py   the first layout (``training_state``), deprecated

``pipeline.checkpointing`` owns the folder (atomic writes, ``latest``, ``keep``)
and the reading and writing; these modules only build and apply the entries.
"""

__all__: list[str] = []
