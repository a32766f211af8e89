"""The model's outputs for the whole batch, from the last stage's rank to every rank or to one.

    # r: a rank, q: the last stage's rank, m: micro-batches, i: a micro-batch

In a forward-only pass (``Pipeline.predict``, ``evaluate(return_outputs=True)``)
the last stage keeps each micro-batch's output; its rank q concatenates them
in micro-batch order along dim 0, the batch's own row order (micro-batch i
holds the i-th slice of rows), and shares them:

    dst None:  q: broadcast a header (the outputs' signature), then each tensor
               r: receive the header, allocate, receive each tensor
    dst d:     q -> d only: the header, then the tensors (point to point);
               every other rank gets None and moves nothing

The header is metadata.py's encoding (one (HEADER_LEN,) int64 tensor, its tag
saying whether the output is a tuple). Everything travels through ``Comm``:
on the communication device, with the pipeline's timeout and failure watch.
"""

from __future__ import annotations

import torch

from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.inputs.microbatch import Batch, as_tuple, concat, from_tuple, signature
from pipeline.runtime.step.metadata import HEADER_LEN, decode, encode_words

__all__ = ["check_dst", "share_outputs"]


def check_dst(dst: object, world: int) -> int | None:
    """``dst`` as a rank of the pipeline's group, or None (every rank); ValueError otherwise."""
    if dst is None:
        return None
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world:
        raise ValueError(
            f"dst ({dst!r}) must be a rank of the pipeline's group, 0 to {world - 1}, or None for the "
            "outputs on every rank"
        )
    return dst


def share_outputs(
    kept: dict[int, Batch] | None, comm: Comm | None, src: int, dst: int | None, what: str
) -> Batch | None:
    """The outputs of every micro-batch, concatenated, on ``dst`` (None: every rank); None elsewhere.

    ``kept``: the last stage's outputs by micro-batch on rank ``src`` (None on the
    others). Call on every rank.
    """
    rank = comm.rank if comm is not None else 0
    outputs = concat([kept[i] for i in sorted(kept)]) if kept is not None else None
    if comm is None or comm.world_size == 1:
        return outputs if dst in (None, rank) else None
    if dst is not None and (rank not in (src, dst) or src == dst):
        return outputs if rank == dst else None
    label = f"the outputs from rank {comm.name(src)} ({what})"
    if rank == src:
        assert outputs is not None
        tensors = [t.to(comm.device).contiguous() for t in as_tuple(outputs)]
        header = comm.tensor(encode_words(signature(outputs), int(isinstance(outputs, tuple))), torch.int64)
        _send(comm, [header], [t for t in tensors if t.numel() > 0], src, dst, label)
        return from_tuple(tensors, isinstance(outputs, tuple)) if dst is None else None
    header = comm.empty((HEADER_LEN,), torch.int64)
    _recv(comm, [header], src, dst, label + ": its header")
    sig, like_tuple = decode(header)
    tensors = [comm.empty(shape, dtype) for shape, dtype in sig]
    _recv(comm, [t for t in tensors if t.numel() > 0], src, dst, label)
    return from_tuple(tensors, bool(like_tuple))


def _send(
    comm: Comm, header: list[torch.Tensor], tensors: list[torch.Tensor], src: int, dst: int | None, what: str
) -> None:
    if dst is None:
        for t in header + tensors:
            comm.broadcast(t, src, what)
        return
    works = comm.post([(header, dst), (tensors, dst)] if tensors else [(header, dst)], [], what)
    for w in works:
        comm.wait(w, what)


def _recv(comm: Comm, tensors: list[torch.Tensor], src: int, dst: int | None, what: str) -> None:
    if not tensors:
        return
    if dst is None:
        for t in tensors:
            comm.broadcast(t, src, what)
        return
    (works,) = comm.post([], [(tensors, src)], what)
    comm.wait(works, what)
