"""Pretrained weights in safetensors files, read stage by stage: each rank reads its own tensors only.

    # r: rank, s: stage

A Hugging Face ``save_pretrained`` folder holds ``model.safetensors``, or shards with an index::

    model.safetensors.index.json      {"weight_map": {"model.layers.0.mlp.up_proj.weight":
                                                      "model-00001-of-00003.safetensors", ...}}
    model-0000k-of-0000n.safetensors  8 bytes: n (little-endian), n bytes of JSON: {key: {"dtype": "F32",
                                      "shape": [..], "data_offsets": [begin, end]}}, then the data

``load(path, tensors, model_keys)`` reads the JSON headers and then, per tensor this rank holds, only
its bytes: straight into the tensor's storage where it is a contiguous CPU tensor of the file's
dtype, else into one CPU buffer of its size, then copied (another float dtype is converted; a float
and an integer dtype are refused): a rank's memory while loading is its own stages, not the model.
Every copy of a tied weight is loaded from the file's one entry (its own name's, else an alias's).
A float tensor that holds NaN or inf as read (a DTensor: its local shard) is an error naming its key
and file: safetensors has no checksum, and corrupted bytes would otherwise load and train to NaN.

Sharded and split stages. A DTensor (FSDP's shard over "dp_shard", a parallel style's over "tp",
or both) is read as its local shard only: the box of the global tensor that this rank's shard
covers (``compute_local_shape_and_global_offset``, the box dcp gives it too), one contiguous run
of bytes per row of the box's leading dims, into the local tensor::

    (8, 6) F32, Shard(0) over 2 ranks   rank 1: rows 4..7, one run of 4 x 6 x 4 bytes
    (8, 6) F32, Shard(1) over 2 ranks   rank 1: columns 3..5, 8 runs of 3 x 4 bytes

so a rank reads its own part of its own stages: 1 / (shard x tp) of a split weight.

Names. The pipeline names tensors as the user's module does (``model.model.layers.0...`` for a
wrapper that holds the transformers model as ``self.model``); the file as the transformers model
does (``model.layers.0...``). ``prefix`` is what the module's names have in front of the file's
(found when not given: the one that maps the most names). A name the file lacks (no alias of the tensor
either) or a key of the file that names nothing in the model is an error naming it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["INDEX", "WEIGHTS", "find_prefix", "load", "shards"]

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_HEADER_LIMIT = 100 * 2**20  # a JSON header larger than this is not a safetensors file


def shards(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Every key of the checkpoint at ``path`` (a folder, a .safetensors file or an index) -> its file."""
    where = Path(path)
    if where.is_dir():
        if (where / INDEX).is_file():
            where = where / INDEX
        elif (where / WEIGHTS).is_file():
            where = where / WEIGHTS
        else:
            raise FileNotFoundError(
                f"{path} holds neither {WEIGHTS} nor {INDEX}; pass the folder save_pretrained wrote, "
                "or the .safetensors file itself"
            )
    if not where.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}: pass a save_pretrained folder or a .safetensors file"
        )
    if where.name.endswith(".json"):
        try:
            weight_map = json.loads(where.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{where} is not a safetensors index (no 'weight_map' of key -> file): {err}"
            ) from err
        return {key: where.parent / name for key, name in weight_map.items()}
    return dict.fromkeys(_header(where)[0], where)


def _header(file: Path) -> tuple[dict[str, dict[str, object]], int]:
    """(key -> {"dtype", "shape", "data_offsets"}, where the data begins) of one safetensors file."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is truncated ({len(head)} bytes): not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > _HEADER_LIMIT:
            raise ValueError(f"{file} announces a {size}-byte header: not a safetensors file")
        text = f.read(size)
    if len(text) < size:
        raise ValueError(f"{file} is truncated inside its header ({len(text)} of {size} bytes)")
    try:
        header = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{file}'s header is not JSON: {err}") from err
    header.pop("__metadata__", None)
    end = 8 + size + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if file.stat().st_size < end:
        raise ValueError(f"{file} is truncated: {file.stat().st_size} bytes where its header needs {end}")
    return header, 8 + size


def find_prefix(model_keys: Mapping[str, str], keys: Iterable[str]) -> str | None:
    """The prefix p with p + key = name for some name of the most tensors of the model (``model_keys``:
    name -> the tensor's first name); the shortest of those, None if no prefix maps any."""
    known = set(keys)
    mapped: dict[str, set[str]] = {}  # prefix -> the tensors (first names) it finds in the file
    for name, first in model_keys.items():
        parts = name.split(".")
        for j in range(len(parts)):
            if ".".join(parts[j:]) in known:
                mapped.setdefault(".".join(parts[:j]) + ("." if j else ""), set()).add(first)
    if not mapped:
        return None
    return min(mapped, key=lambda p: (-len(mapped[p]), len(p)))  # a key the file lacks: named by load


def load(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    model_keys: Mapping[str, str],
    prefix: str | None = None,
    strict: bool = True,
    transient: Iterable[str] = (),
) -> None:
    """Fill ``tensors`` (this rank's, by the pipeline's names) from ``path``.

    ``model_keys``: every name of the whole model's state -> the name the pipeline gives that tensor
    (an alias of a tied weight -> its first name). ``strict``: a key of the file that names nothing
    in the model is an error (else skipped); a key that names one of ``transient`` (the model's
    non-persistent buffers, such as a rotary ``inv_freq`` older checkpoints hold) is skipped.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors files are little-endian; this host is big-endian")
    files = shards(path)
    if prefix is None:
        prefix = find_prefix(model_keys, files)
        if prefix is None:
            raise ValueError(_unmatched(model_keys, files, path))
    skip = set(transient)
    wanted: dict[str, str] = {}  # our name -> the file's key
    for key in files:
        ours = model_keys.get(prefix + key)
        if prefix + key in skip:
            continue
        if ours is None:
            if strict:
                raise ValueError(
                    f"{path} has the key {key!r}, which names nothing in the model (as {prefix + key!r}); "
                    f"was it saved from another architecture or config? pass strict=False to skip such keys"
                )
            continue
        if ours not in wanted or prefix + key == ours:  # a tied weight: its own entry first, else an alias's
            wanted[ours] = key
    missing = [name for name in tensors if name not in wanted]
    if missing:
        raise ValueError(
            f"{path} lacks {', '.join(repr(m.removeprefix(prefix)) for m in missing[:5])}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''} (the model's "
            f"{missing[0]!r} with prefix {prefix!r}); load a checkpoint saved from this model's config"
        )
    headers: dict[Path, tuple[dict[str, dict[str, object]], int]] = {}
    for name, tensor in tensors.items():
        key = wanted[name]
        file = files[key]
        if file not in headers:
            headers[file] = _header(file)
        header, start = headers[file]
        if key not in header:
            raise ValueError(f"the index names {file.name} for {key!r}, but that file does not hold it")
        _read(file, start, key, header[key], tensor)


def _read(file: Path, start: int, key: str, entry: Mapping[str, object], tensor: torch.Tensor) -> None:
    """The bytes of ``key`` into ``tensor`` (a DTensor: into its local shard, from the part of the
    file that shard covers): straight into its storage where it is a contiguous CPU tensor of the
    file's dtype, else through a buffer of the file's dtype."""
    dtype = _DTYPES.get(str(entry["dtype"]))
    if dtype is None:
        raise ValueError(f"{file.name}: {key!r} has dtype {entry['dtype']}, which torch cannot hold")
    shape = tuple(int(d) for d in entry["shape"])  # type: ignore[attr-defined]
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{file.name}: {key!r} has shape {list(shape)} but the model's tensor is {list(tensor.shape)}; "
            "load a checkpoint saved from this model's config"
        )
    begin, end = (int(v) for v in entry["data_offsets"])  # type: ignore[attr-defined]
    if dtype.is_floating_point != tensor.dtype.is_floating_point:
        raise ValueError(
            f"{file.name}: {key!r} is {dtype} but the model's tensor is {tensor.dtype}; a float and an "
            "integer tensor are not converted into each other: load a checkpoint saved from this model"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != end - begin:
        raise ValueError(
            f"{file.name}: {key!r} holds {end - begin} bytes, its shape and dtype "
            f"{math.prod(shape) * itemsize}"
        )
    with torch.no_grad():
        local, box = _local_box(tensor, key)
        size = tuple(local.shape)
        direct = local.device.type == "cpu" and local.dtype == dtype and local.is_contiguous()
        target = local.detach() if direct else torch.empty(size, dtype=dtype)
        raw = target.reshape(-1).view(torch.uint8) if target.dim() else target.reshape(1).view(torch.uint8)
        into = raw.numpy().data
        at = 0
        with open(file, "rb") as f:
            for first, count in _runs(shape, box, size):
                f.seek(start + begin + first * itemsize)
                want = count * itemsize
                got = f.readinto(into[at : at + want])
                if got != want:
                    raise ValueError(f"{file.name} is truncated inside {key!r} ({got} of {want} bytes)")
                at += want
        if dtype.is_floating_point:
            _check_finite(file, key, target)
        if not direct:
            local.copy_(target)


def _check_finite(file: Path, key: str, data: torch.Tensor) -> None:
    """Refuse ``data`` (a tensor as read from ``file``, a DTensor's local shard) holding NaN or inf:
    safetensors has no checksum, so corrupted bytes would otherwise load and train to NaN."""
    if data.dtype == torch.float8_e4m3fn:  # no inf; NaN is every exponent and mantissa bit set
        bad = (data.view(torch.uint8) & 0x7F) == 0x7F
    elif bool(torch.isfinite(data).all()):
        return
    else:
        bad = ~torch.isfinite(data)
    count = int(bad.sum())
    if count:
        raise ValueError(
            f"{file}: {key!r} holds {count} non-finite value(s) (NaN or inf) of {data.numel()} as read; "
            "a checkpoint's weights are finite, so the file is corrupted (safetensors has no checksum): "
            "re-download or re-save it, and check the file (e.g. its sha256 against the source's)"
        )


def _local_box(tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank writes (a DTensor's local shard, else ``tensor``) and the offset in the
    global tensor of the box it covers."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), (0,) * tensor.dim()
    size, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local().detach()
    if tuple(local.shape) != tuple(size):
        raise ValueError(
            f"{key!r}: its local shard is {list(local.shape)} but its placements {tensor.placements} give "
            f"{list(size)}; load_pretrained reads shards that are one box of the tensor (Shard, "
            "Replicate): load the full weights before sharding, or shard it by such placements"
        )
    return local, tuple(int(o) for o in offset)


def _runs(shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> Iterable[tuple[int, int]]:
    """The box of ``size`` at ``offset`` in a row-major tensor of ``shape`` as contiguous runs of
    elements, (first element, count), in the box's own row-major order."""
    if any(n == 0 for n in size):
        return []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    partial = [d for d in range(len(shape)) if size[d] != shape[d]]
    if not partial:
        return [(0, math.prod(shape))]
    k = partial[-1]  # the dims after it are whole: one run per index of the dims before it
    count = size[k] * strides[k]
    rows = itertools.product(*(range(offset[d], offset[d] + size[d]) for d in range(k)))
    return ((sum(i * strides[d] for d, i in enumerate(row)) + offset[k] * strides[k], count) for row in rows)


def _unmatched(model_keys: Mapping[str, str], files: Mapping[str, Path], path: object) -> str:
    ours = next(iter(model_keys), "")
    theirs = next(iter(files), "")
    return (
        f"the names in {path} (such as {theirs!r}) and the model's (such as {ours!r}) match under no "
        "prefix: pass prefix= (what the model's names have in front of the file's, e.g. 'model.' for a "
        "wrapper that holds the transformers model as self.model), or load a checkpoint of this model"
    )
