"""One rank's communication in the pipeline's group: the one object the runtime holds.

    # r: this rank, q: a peer rank, p: ranks

``Comm`` is made once per group (a pipeline's, its replicas', a tie's) and
delegates each concern to the module that owns it:

    Comm ------------- the group, its ranks and their names, the store's keys
     |-- transport     transport.py: the communication device and its tensor
     |                 checks, posting (gloo, NCCL, or its emulation, chosen
     |                 once here), ordering on a stream, waits that never hang
     |                 (timeout, failure watch, the error that names the cause)
     |-- collectives   collectives.py: broadcast / all-reduce on the group, and
     |                 every communicator made here, at construction
     '-- board         board.py: the failure key (first failure wins)

The store helpers (``wait_key``, ``set_key``, ``add_key``, ``delete_keys``)
are the group's small values that travel through the store rather than the
backend (the step header, signatures, configurations); ``wait_key`` waits with
the transport's timeout and failure watch, and a store that is gone is named
as such. ``publish`` records this rank's failure on the board and aborts the
transport, so that every rank learns of it and transfers in flight stop.

In a mesh of pipeline replicas (mesh.py) each rank has two: the pipeline's
("pp", point to point) and its replicas' ("dp", collectives only), which watch
one failure key in the world's store, so that a failure anywhere in the mesh
reaches every rank; errors then name global ranks.

Sends are not waited for inside the step: the caller orders each one where it
is known to be done (see program.py) or at the step's end. Metadata (tensor
signatures and when they travel) is metadata.py's.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.runtime.comm.board import FailureBoard
from pipeline.runtime.comm.channels import Channels, channels_for
from pipeline.runtime.comm.collectives import Collectives
from pipeline.runtime.comm.stream import from_host
from pipeline.runtime.comm.transport import NCCL_DTYPES, Transport, backend_timeout, transport_class
from pipeline.runtime.comm.watchdog import PeerFailure, PipelineTimeout, quiet_store

__all__ = ["NCCL_DTYPES", "Comm", "PeerFailure", "PipelineTimeout", "world_store"]


def _group_store(group: Any) -> Any:
    from torch.distributed import distributed_c10d as c10d

    entry = c10d._world.pg_map.get(group if group is not None else c10d._get_default_group())
    return entry[1] if entry is not None else c10d._get_default_store()


def world_store() -> Any:
    """The default process group's store: where a mesh's ranks share their failure key."""
    return _group_store(None)


class Comm:
    """One rank's point-to-point and collectives in ``group``, with timeouts and a shared failure key.

    Its parts' methods are its own attributes, bound at construction:

        transport.py     check, post, order, wait, poll, abort, close
        collectives.py   broadcast, all_reduce, start_all_reduce, finish
    """

    def __init__(
        self,
        group: Any,
        key_prefix: str,
        timeout: float,
        *,
        failure: tuple[Any, str] | None = None,
        pipelines: list[list[int]] | None = None,
        p2p: bool = True,
        global_names: bool = False,
    ) -> None:
        """``failure``: the (store, key) of the failure key when it is shared beyond ``group`` (a
        mesh's replicas watch one key); ``pipelines``: every pipeline's global ranks when ``group``
        is one of several (the channels of all are made together); ``p2p=False``: no channels
        (collectives; its few messages, the world's first ones, go on the group itself);
        ``global_names``: errors name global ranks (in a mesh, where a group rank is ambiguous)."""
        self.group = group
        self.key_prefix = key_prefix  # this pipeline's keys in the store (every executor's)
        self.rank = dist.get_rank(group)
        self.world_size = n = dist.get_world_size(group)
        backend = dist.get_backend(group)
        path = transport_class(backend)  # the posting path, once: no method below asks again
        self.emulated, self.nccl = path.emulated, path.nccl  # nccl: the NCCL code path (emulated too)
        self.device = path.device_for()
        self.requested_timeout, self.pg_timeout = timeout, backend_timeout(group, self.device)
        self.store = _group_store(group)
        self._global = [dist.get_global_rank(group, q) if group is not None else q for q in range(n)]
        self._names = self._global if global_names else list(range(n))
        self.me = self._names[self.rank]  # this rank as errors name it
        self.channels: Channels | None = None
        if path.channel_backend is not None and n > 1 and p2p:
            td = datetime.timedelta(seconds=self.pg_timeout or 1800.0)
            self.channels = channels_for(group, self.rank, self._global, path.channel_backend, td, pipelines)
        self.board = FailureBoard(self.store, failure, key_prefix, self.rank, self._names)
        self.liveness = self.board.liveness
        self.transport: Transport = path(
            group, self.rank, self.me, self.device, self.board, self.channels, timeout, self.pg_timeout
        )
        self.backend = self.transport.backend  # as errors name it: "gloo", "nccl" or "nccl-emulated"
        self.collectives = c = Collectives(self.transport, self.rank, self._global, self._names)
        # the parts' own methods, bound rather than wrapped: a traceback ends where the wait was, no
        # deeper than when they were Comm's
        t = self.transport
        self.check, self.post, self.order, self.wait, self.poll = t.check, t.post, t.order, t.wait, t.poll
        self.abort, self.close = t.abort, t.close
        self.broadcast, self.all_reduce = c.broadcast, c.all_reduce
        self.start_all_reduce, self.finish = c.start_all_reduce, c.finish
        c.make_communicators()
        # (kind, number) of the Pipeline call in progress; the step header carries it (metadata.py)
        self.call = (0, 0)
        # the last full step header set or read: (its call number, its content); a header that
        # repeats it travels as its number alone (metadata.py)
        self.header: tuple[int, Any] | None = None

    def name(self, q: int) -> int:
        """How errors name group rank ``q``: its global rank in a mesh, else ``q``."""
        return self._names[q]

    @property
    def timeout(self) -> float:
        """Every wait's bound in seconds: the requested one, clamped below the process group's."""
        return self.transport.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.transport.timeout = seconds

    # ---- tensors on the communication device

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def tensor(self, data: Any, dtype: torch.dtype) -> torch.Tensor:
        return from_host(data, dtype, self.device)  # no host synchronisation on CUDA

    # ---- the store

    def wait_key(self, key: str, what: str) -> bytes:
        """A store value another rank sets, with the same timeout and failure watch."""
        start, pause = time.monotonic(), 0.0002  # short at first: the step header is read each step
        try:
            while True:
                if not self.board.usable():
                    raise RuntimeError("the process that served the store is gone")
                with quiet_store():
                    if self.store.check([key]):
                        return bytes(self.store.get(key))
                    failed = self.board.store.check([self.board.key])
                if failed or time.monotonic() - start > self.timeout:
                    raise self.transport.error(what) from None
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
        except (PeerFailure, PipelineTimeout):
            raise
        except Exception as exc:  # the store is gone
            self.liveness.store_gone = True
            self.transport.fail(what, exc)

    def add_key(self, key: str, amount: int) -> int:
        """The store's counter ``key`` after adding ``amount`` (atomic across ranks)."""
        try:
            with quiet_store():
                return int(self.store.add(key, amount))
        except Exception as exc:
            self.liveness.store_gone = True
            self.transport.fail(f"the store to count {key}", exc)

    def delete_keys(self, keys: Sequence[str]) -> None:
        try:
            with quiet_store():
                for key in keys:
                    self.store.delete_key(key)
        except Exception as exc:
            self.liveness.store_gone = True
            self.transport.fail(f"the store to delete {', '.join(keys)}", exc)

    def set_key(self, key: str, value: bytes) -> None:
        try:
            if not self.board.usable():
                raise RuntimeError("the process that served the store is gone")
            with quiet_store():
                self.store.set(key, value)
        except Exception as exc:
            self.liveness.store_gone = True
            self.transport.fail(f"the store to set {key}", exc)

    # ---- failure signalling (the board's)

    def publish(self, message: str) -> None:
        """Record this rank's failure unless another rank's came first; stop transfers in flight."""
        self.board.publish_as(self.me, message)
        self.abort()
