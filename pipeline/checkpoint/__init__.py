"""The parts behind ``pipeline.checkpointing`` (the public API: save, load, resume, latest).

state.py    what a checkpoint holds (model, optimizer, scheduler, scaler, RNG, extra), and back
optim.py    the optimizer per parameter name, so that param groups re-shard
folder.py   the folder: atomic writes, the ``latest`` pointer, ``keep`` per run
manifest.py each checkpoint's files with their sizes and CRC-32, its run and config, written last
choose.py   which checkpoint to load: verified, the same on every rank, falling back past damage
runs.py     a run's id and configuration, and what may differ on resume
ranks.py    this rank, and failures raised together on every rank
legacy.py   the first layout (``training_state``), deprecated
"""

__all__: list[str] = []
