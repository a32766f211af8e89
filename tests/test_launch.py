from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.launch import RankError, init_distributed, launch
from tests.dist import run_ranks


def _rank_info(offset: int) -> tuple[int, int, int, str]:
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return dist.get_rank() + offset, dist.get_world_size(), int(total), os.environ["RANK"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(tmp_path: Path, world_size: int) -> None:
    results = run_ranks(tmp_path, _rank_info, world_size, 100)
    expected_sum = sum(range(world_size))
    assert results == [(100 + r, world_size, expected_sum, str(r)) for r in range(world_size)]


def _one_thread() -> int:
    return torch.get_num_threads()


def test_one_intra_op_thread_per_rank(tmp_path: Path) -> None:
    assert run_ranks(tmp_path, _one_thread, 2) == [1, 1]


def _tensor_result() -> torch.Tensor:
    return torch.arange(4) * dist.get_rank()


def test_tensors_outlive_their_rank(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, _tensor_result, 2)
    assert torch.equal(results[1], torch.tensor([0, 1, 2, 3]))


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("boom on the second rank")
    dist.barrier()  # the others block here until they are killed


def test_exception_names_rank_and_message(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed: KeyError: 'boom on the second rank'") as info:
        run_ranks(tmp_path, _raise_on_rank_one, 3, timeout=120.0)
    assert info.value.rank == 1
    assert "_raise_on_rank_one" in str(info.value)  # the remote traceback travels
    assert time.monotonic() - start < 30  # far below the collective timeout: nobody waited for it


def _die_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def test_dead_rank_is_reported(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 exited with code 7") as info:
        run_ranks(tmp_path, _die_on_rank_zero, 2, timeout=120.0)
    assert info.value.rank == 0
    assert time.monotonic() - start < 30


def test_no_orphans_after_failure(tmp_path: Path) -> None:
    import multiprocessing

    with pytest.raises(RankError):
        run_ranks(tmp_path, _raise_on_rank_one, 2)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1, got"):
        launch(_one_thread, world_size)  # type: ignore[arg-type]


def test_unpicklable_fn() -> None:
    with pytest.raises(ValueError, match=r"must be picklable.*define fn at module level"):
        launch(lambda: 0, 1)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'mpi'; use one of \('gloo', 'nccl'\)"):
        launch(_one_thread, 1, backend="mpi")


def test_nccl_without_gpus() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match=r"backend 'nccl' needs one GPU per rank"):
        launch(_one_thread, 2, backend="nccl")


def test_init_distributed_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match=r"run under torchrun"):
        init_distributed()


def _init_from_env() -> tuple[int, int, str]:
    dist.destroy_process_group()  # start as a torchrun worker would: only the environment
    info = init_distributed()
    return info.rank, info.world_size, info.device.type


def _torchrun_like(tmp_path: Path) -> list[tuple[int, int, str]]:
    return run_ranks(tmp_path, _init_from_env, 2)


def test_init_distributed_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:  # the OS picks a free port; nothing fixed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert _torchrun_like(tmp_path) == [(0, 2, "cpu"), (1, 2, "cpu")]
