"""``pretrained.load`` refuses a float tensor holding NaN or inf as read: safetensors has no checksum,
so corrupted bytes would otherwise load silently and train to NaN.

A file with a NaN saved into one tensor, and one whose bytes were flipped into +inf after saving, are
refused with errors naming the key, the file and how many values are non-finite; a clean file loads.
A DTensor is checked as its local shard: over 2 ranks, only the rank whose rows hold the NaN refuses.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.runtime.inputs import pretrained
from tests.dist import job

_NAMES = {"a": "a", "b": "b"}


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def _clean() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}


def test_a_clean_file_loads(tmp_path: Path) -> None:
    path = _save(tmp_path / "clean.safetensors", _clean())
    got = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}  # b: bf16 in the file, converted
    pretrained.load(path, got, _NAMES)
    assert torch.equal(got["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(got["b"], torch.ones(4))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float64])  # read in place / via a buffer
def test_a_nan_is_named_with_its_key_file_and_count(tmp_path: Path, model_dtype: torch.dtype) -> None:
    tensors = _clean()
    tensors["a"][1, 2] = float("nan")
    path = _save(tmp_path / "nan.safetensors", tensors)
    with pytest.raises(ValueError) as info:
        pretrained.load(path, {"a": torch.zeros(2, 3, dtype=model_dtype), "b": torch.zeros(4)}, _NAMES)
    message = str(info.value)
    assert "'a'" in message and str(path) in message
    assert "1 non-finite value(s)" in message and "re-download" in message
    pretrained.load(path, {"b": torch.zeros(4)}, _NAMES)  # the other tensor alone still loads


def _flip_to_inf(path: Path, key: str, index: int) -> None:
    """Overwrite element ``index`` of the F32 tensor ``key`` with +inf's bytes, in place."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", bytes(data[:8]))
    entry = json.loads(bytes(data[8 : 8 + size]))[key]
    assert entry["dtype"] == "F32"
    at = 8 + size + int(entry["data_offsets"][0]) + 4 * index
    data[at : at + 4] = struct.pack("<f", float("inf"))
    path.write_bytes(bytes(data))


def test_flipped_bytes_that_make_an_inf_are_named(tmp_path: Path) -> None:
    path = _save(tmp_path / "inf.safetensors", _clean())
    _flip_to_inf(path, "a", 0)
    _flip_to_inf(path, "a", 4)
    with pytest.raises(ValueError, match=r"inf\.safetensors: 'a' holds 2 non-finite value\(s\)"):
        pretrained.load(path, {"a": torch.zeros(2, 3)}, _NAMES)


def test_a_non_finite_bf16_value_is_named(tmp_path: Path) -> None:
    tensors = _clean()
    tensors["b"][3] = float("-inf")
    path = _save(tmp_path / "bf16.safetensors", tensors)
    with pytest.raises(ValueError, match=r"bf16\.safetensors: 'b' holds 1 non-finite"):
        pretrained.load(path, {"b": torch.zeros(4)}, _NAMES)


def _sharded(path: Path) -> str:
    """Load ``w`` (8, 6), Shard(0) over 2 ranks, from ``path``: rank 1 (rows 4..7) holds the NaN."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    w = DTensor.from_local(torch.zeros(4, 6), mesh, [Shard(0)], run_check=False)
    try:
        pretrained.load(path, {"w": w}, {"w": "w"})
    except ValueError as err:
        return str(err)
    return "ok"


def _nan_in_row_6(factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    w = torch.arange(48.0).reshape(8, 6)
    w[6, 1] = float("nan")
    return (_save(factory.mktemp("finite") / "w.safetensors", {"w": w}),)


_SHARDED = job(2, _sharded, make_args=_nan_in_row_6, timeout=60.0, batch="finite")


def test_a_dtensor_is_checked_as_its_local_shard(tmp_path_factory: pytest.TempPathFactory) -> None:
    first, second = _SHARDED.results(tmp_path_factory)
    assert first == "ok"  # rows 0..3: finite, whatever the rest of the file holds
    assert "'w' holds 1 non-finite value(s)" in second and "w.safetensors" in second
    assert "of 24 as read" in second  # counted on the local shard, not the whole tensor
