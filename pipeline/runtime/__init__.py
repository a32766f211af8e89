"""What executes a plan, in rooms by concept; each room's ``__init__`` says what lives there.

    pipe.py, options.py    the facade: ``Pipeline`` builds the rooms' parts and runs the calls
        |
    step/        one rank's step: the program bound and run, stages' F/B/W, memory, the tail
        |
    replicas/    data parallelism: the mesh, replicas' gradient reduction, FSDP shards, gathers
        |
    tensor/      tensor parallelism inside a stage: a parallelize_fn, Llama's split
        |
    trace/       a model as stages: tracing, sizes and shapes, materialisation, tied weights
        |
    inputs/      a step's data and a model's weights: micro-batches, variable lengths, safetensors
        |
    comm/        ranks talking: transports, channels, collectives, streams, the emulation,
                 timeouts and failures

Imports go down only (``MAY_IMPORT``, which ``tests/test_imports.py`` checks): a room may import
those below it, never one above or beside it, so a change to one concept stays in its room. The
schedule IR (``pipeline.schedules``) is below every room.
"""

__all__ = ["MAY_IMPORT"]

# room -> the rooms it may import (besides itself); the facade (pipe.py, options.py) may import all
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "comm": (),
    "inputs": ("comm",),
    "trace": ("comm", "inputs"),
    "tensor": ("comm", "inputs", "trace"),
    "replicas": ("comm", "inputs", "trace", "tensor"),
    "step": ("comm", "inputs", "trace", "tensor", "replicas"),
}
