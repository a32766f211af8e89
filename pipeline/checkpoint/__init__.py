"""The parts behind ``pipeline.checkpointing`` (the public API: save, load, latest).

state.py    what a checkpoint holds (model, optimizer, scheduler, scaler, RNG, extra), and back
optim.py    the optimizer per parameter name, so that param groups re-shard
folder.py   the folder: atomic writes, the ``latest`` pointer, ``keep``
ranks.py    this rank, and failures raised together on every rank
legacy.py   the first layout (``training_state``), deprecated
"""

__all__: list[str] = []
