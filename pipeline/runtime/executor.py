"""Run one rank's compiled program: direct comm, timed waits, measured timeline.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank, p: ranks

``Executor`` compiles the rank's lowered list once (program.py: messages and
bound instructions) and runs it at every step:

    step:  header + signatures (metadata.py, only when the input changes)
           -> post the first block's receives (lookahead)
           -> per instruction: compute (waiting for its input only now) | post a comm block
           -> wait for the sends still pending

A compute's busy time starts once its input is there: waiting for a receive is
not busy time. A receive's wait also reaps the sends it proves done (see
program.py); the rest are waited for at the step's end. A failed step drops its
tensors and works, so that the next step starts clean.

Lookahead posting of receives is on for gloo and off for NCCL: NCCL runs a
process group's transfers on one stream in post order, so a receive posted
early could hold back a send that the peer needs first.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pipeline.runtime import stream
from pipeline.runtime.metadata import derive_signatures, exchange_header, send_tensors, set_specs
from pipeline.runtime.microbatch import Batch, Signature, from_tuple
from pipeline.runtime.p2p import Comm
from pipeline.runtime.program import Msg, compile_rank
from pipeline.runtime.stage import StageRuntime
from pipeline.schedules.actions import Kind
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.timeline import TimedAction

__all__ = ["Executor"]


class Executor:
    """Interprets rank ``rank``'s part of ``sched`` over ``stages`` (this rank's, by stage index)."""

    def __init__(
        self,
        sched: Schedule,
        rank: int,
        stages: dict[int, StageRuntime],
        comm: Comm | None,
        device: torch.device,
        key_prefix: str,
    ) -> None:
        self.sched, self.rank, self.stages, self.comm, self.device = sched, rank, stages, comm, device
        self.key_prefix = key_prefix
        self.n_stages, self.p = sched.n_stages, sched.n_ranks
        self.lookahead = comm is not None and not comm.nccl
        self.compute_stream = stream.current_stream(device)
        self.comm_stream = stream.new_stream(device)
        self.copy_stream = stream.new_stream(device)
        # per-step state
        self.inputs: list[Batch] = []
        self.targets: list[Any] = []
        self._sent: list[Msg] = []  # sends posted this step, waited for by the step's end
        self._abandoned: list[list[Any]] = []  # works of a failed step
        # signatures, derived at the first step and when the input signature or autocast state changes
        self._input_key: tuple[Signature, int] | None = None
        self._version = 0
        self.in_sig: dict[int, Signature] = {}
        self.out_sig: dict[int, Signature] = {}
        # timing of the last step
        self.busy = 0.0
        self.events: list[TimedAction] = []
        self._record = False
        self._clock = 0.0  # wall time minus perf_counter, for timelines comparable across ranks
        self._compute_start = 0.0  # when the running compute action had its input
        compiled = compile_rank(sched, rank, stages, self, self.lookahead)
        self._program = compiled.program
        self._msgs = compiled.msgs
        self._local = compiled.local  # (receiving stage, i) -> hand-over on this rank
        self._first_recvs = compiled.first_recvs

    # ---- communication, called by the bound instructions

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None:
        """Post a comm block: ``sends`` (checked against their specs) and fresh buffers for ``recvs``."""
        assert self.comm is not None
        for m in sends:
            m.tensors = send_tensors(m)
        dev = self.device
        for m in recvs:
            m.tensors = [torch.empty(sh, dtype=dt, device=dev) for sh, dt in m.spec]
        if stream.is_cuda(self.comm_stream):
            stream.wait_stream(self.comm_stream, self.compute_stream)
            for m in sends:
                for t in m.tensors:
                    stream.record_stream(t, self.comm_stream)
        start = time.perf_counter()
        with stream.use_stream(self.comm_stream):
            works = self.comm.post(
                [(m.tensors, m.peer) for m in sends], [(m.tensors, m.peer) for m in recvs], what
            )
        if self._record and sends:
            end = time.perf_counter()
            self.events += [
                TimedAction(self.rank, m.action, start + self._clock, end + self._clock)  # type: ignore[arg-type]
                for m in sends
            ]
        for m, w in zip(sends, works, strict=False):
            m.works = w
        for m, w in zip(recvs, works[len(sends) :], strict=True):
            m.works = w
        self._sent += sends

    def take(self, m: Msg) -> Any:
        """A compute action's input: from the local hand-over, or the receive posted for it."""
        if m.action is None:
            value, m.value = m.value, None
            return value
        comm, works = self.comm, m.works
        assert comm is not None and works is not None
        start = time.perf_counter()
        comm.wait(works, m.what)
        m.works = None
        for done in m.reap:
            if done.works is not None:
                comm.wait(done.works, done.what)
                done.works, done.tensors = None, []
        # The compute that asked for this input starts now: waiting is not busy time.
        self._compute_start = end = time.perf_counter()
        if self._record:
            self.events.append(TimedAction(self.rank, m.action, start + self._clock, end + self._clock))
        buffers, m.tensors = m.tensors, []
        if m.action.kind is Kind.RECV_F:
            return from_tuple(buffers, m.like_tuple)
        it = iter(buffers)
        return tuple(next(it) if k else None for k in m.mask)

    # ---- metadata

    def _exchange_header(self) -> tuple[Signature, int]:
        key, sent = exchange_header(self.comm, self.rank, self.p, self.device, self.inputs)
        if sent is not None:
            self._sent.append(sent)
        return key

    def _setup(self, sig: Signature) -> None:
        """Every local stage's input and output signatures, in stage order; the messages' specs."""
        self._version += 1
        key = f"{self.key_prefix}/sig{self._version}"
        self.in_sig, self.out_sig = derive_signatures(sig, self.stages, self.sched, self.rank, self.comm, key)
        set_specs(self._msgs, self.in_sig, self.out_sig)

    # ---- the step

    def run(self, inputs: list[Batch], targets: list[Any], record: bool) -> None:
        """One step over prepared micro-batches (``inputs`` on stage 0's rank, ``targets`` on the last's)."""
        self.inputs, self.targets, self._record = inputs, targets, record
        self.events = []
        self._clock = time.time() - time.perf_counter()
        for st in self.stages.values():
            st.losses = []
            st.reset_peak()
        try:
            key = self._exchange_header()
            if key != self._input_key:  # the autocast state changes the dtypes between stages too
                self._setup(key[0])
                self._input_key = key
            if self._first_recvs:
                self.post([], self._first_recvs, self._first_recvs[0].what)
            busy = 0.0
            sync = record and self.device.type == "cuda"
            for a, fn in self._program:
                if a is None:
                    fn()
                    continue
                self._compute_start = time.perf_counter()
                fn()  # may wait for its input first, moving _compute_start past the wait
                if sync:
                    torch.cuda.synchronize(self.device)
                end = time.perf_counter()
                start = self._compute_start
                busy += end - start
                if record:
                    self.events.append(TimedAction(self.rank, a, start + self._clock, end + self._clock))
            self.busy = busy
            self._drain()
        except BaseException:
            self._reset()
            raise

    def _drain(self) -> None:
        unconsumed = [a for a, m in self._msgs.items() if a.kind.is_recv and m.works is not None]
        assert not unconsumed, f"receives left unconsumed: {unconsumed}"
        assert self.comm is not None or not self._sent
        for m in self._sent:
            if m.works is not None:
                self.comm.wait(m.works, m.what)  # type: ignore[union-attr]
                m.works, m.tensors = None, []
        self._sent = []

    def _reset(self) -> None:
        """After a failure: drop the step's tensors and works, so that the next step starts clean."""
        # works still pending stay referenced (with their tensors) until the next failure: gloo
        # completes them with an error once the failure has closed the group's connections
        msgs = (*self._msgs.values(), *self._local.values(), *self._sent)
        self._abandoned = [m.works for m in msgs if m.works is not None]
        for m in msgs:
            m.value, m.tensors, m.works = None, [], None
        self._sent = []
