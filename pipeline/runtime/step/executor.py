"""Run one rank's compiled program: one code path for gloo, NCCL and the emulation.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank, p: ranks, k: compute index

``Executor`` binds the rank's program once (``Schedule.program``, the step as
data; runtime/program.py: messages and bound instructions) and runs it at every step:

    step:  (the micro-batches prepared, described and placed: prepare.py's four moves; this is run)
           per instruction: post a comm block (the first: receives only) | compute (its
              input ordered before it only now, then the sends that input proves delivered)
           | free the sends that no receive proved delivered (at the end)
           -> order what is still pending

Every receive is consumed through ``Comm.order(works, compute stream)``: on
gloo the host waits; on NCCL the compute stream waits for the transfer on the
device and the host goes on; under the emulation the data becomes visible only
through it. Receive buffers come from ``Comm.empty`` (the communication device)
and are posted with the compute stream current, so the channel's stream is
ordered after their allocation and after the compute that produced a send
(NCCL keeps the tensors alive until their work is waited for, which every
receive and send here is). Receives are posted one block ahead on every
backend where that is safe (program.py): each NCCL channel is a FIFO of one
direction (channels.py), so an early receive holds nothing back.

On a GPU the host never waits for a transfer, so it could run arbitrarily far
ahead, allocating buffers for transfers the device has not reached. Before
compute k it waits (polling, with the timeout and failure watch) until the
device has finished compute k - 2: in-flight buffers stay within the plan, and
a dead peer is noticed within the timeout, naming the receive that never came.

A device-wide synchronisation while the host queues a compute (the allocator's
retry, a kernel's first launch) must not hang the step: the program never posts a
receive ahead of what its sender needs from this rank (program.py), and
``STAGEWISE_DRAIN_AT`` (drain.py) forces such a sync to prove it.

A compute's busy time starts once its input is there (clock.py: host times on
CPU, CUDA events on a GPU). A receive also reaps the sends it proves done (see
program.py); the rest are ordered at the step's end. A failed step drops its
tensors and works, so that the next step starts clean.

Memory: the rank's ``ActivationMeter`` (memory.py), shared with its stages, also counts each
receive buffer from its posting to the end of the compute that takes it, and each sent tensor
until its reap; a training step resets its peak at the start and keeps it at the end
(``meter.last_peak``), the step's inputs, targets, parameters and buffers excepted. A step that
does not measure memory pays nothing of this: no list of what to skip, no token per message.

Per compute action the loop does only what that action needs, decided before the step: its hooks
are bound into the program (``hook``), the clock is two host times on CPU (events on a GPU), an
end event is kept only where the run-ahead or a forced drain reads it (scripts/bench_overhead.py
measures each part's host time per action).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from pipeline.runtime.comm import emulation, stream
from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.inputs.microbatch import Batch, from_tuple
from pipeline.runtime.step.clock import StepClock
from pipeline.runtime.step.describe import Described
from pipeline.runtime.step.drain import ENV as _DRAIN_ENV
from pipeline.runtime.step.drain import drain_at
from pipeline.runtime.step.memory import ActivationMeter
from pipeline.runtime.step.metadata import send_tensors
from pipeline.runtime.step.place import Placed
from pipeline.runtime.step.program import Msg, compile_rank
from pipeline.runtime.step.stage import StageRuntime
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule
from pipeline.schedules.timeline import TimedAction

__all__ = ["RUN_AHEAD", "Executor"]

RUN_AHEAD = 2  # compute actions the host may queue past the last one the device finished
_Hooks = tuple[Callable[[], None], Callable[[], None]]  # what runs just before a compute, and just after


def _normal(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
        if comm is not None and self.p > 1 and _normal(device) != comm.device:
            raise ValueError(
                f"rank {rank}'s stages are on {device} but its {comm.backend} communication runs on "
                f"{comm.device}; put the stages on {comm.device} (device=...), or use "
                f"{'gloo' if comm.device.type == 'cuda' else 'nccl'} for stages on {device.type}"
            )
        self.nccl = comm is not None and comm.nccl
        self.emulated = comm is not None and comm.emulated
        self.compute_stream = stream.current_stream(device, self.emulated)
        self.clock = StepClock(device, self.compute_stream, rank)
        # one meter per rank, shared by its stages (a hand-over between them is one storage) and by
        # the evaluation executor, which runs on the same stages but keeps no step's peak
        self.training = any(a.kind is not Kind.F for actions in sched.compute for a in actions)
        first = next(iter(stages.values()), None)
        self.meter: ActivationMeter = first.meter if first is not None else ActivationMeter()
        for st in stages.values():
            st.meter = self.meter
        self._metering = False  # this step counts memory (the meter's tokens per message, Msg.held)
        self._consumed: list[Any] = []  # receive buffers' tokens, held until their compute ends
        # per-step state
        self.inputs: list[Batch] = []
        self.targets: list[Any] = []
        self._sent: list[Msg] = []  # sends posted this step, ordered by the step's end
        self._abandoned: list[list[Any]] = []  # works of a failed step
        self._ends: deque[tuple[Action, stream.Event]] = deque(maxlen=RUN_AHEAD)
        # recent receives, for the stuck report: their transfers only (ordered ones hold no tensors)
        self._ordered: deque[tuple[str, list[Any]]] = deque(maxlen=4 * RUN_AHEAD)
        self.units: list[int] = []  # what this step's micro-batches weigh (Described.units)
        # the bound instructions call back through a weak proxy: holding this executor itself would
        # make a cycle, and a Pipeline in a cycle lives until a garbage collection, with its process
        # groups (a gloo worker still finishing a collective when the interpreter finalizes aborts it)
        compiled = compile_rank(sched, rank, stages, weakref.proxy(self), comm.name if comm else None)
        # per compute action: what runs just before it and just after it (the data-parallel reduction)
        self._hooks: dict[Action, _Hooks] = {}
        # data parallelism: told the step's rows, gives the replica's share of the global batch (B_d / B)
        self.on_rows: Callable[[list[int]], Callable[[], torch.Tensor]] | None = None
        self._program = compiled.program
        self._waits = compiled.waits  # computes that take a receive: their busy time starts in ``take``
        self._bound = self._bind_hooks()  # the program with each compute's hooks: (action, fn, waits, hooks)
        self.msgs = compiled.msgs  # by comm action; the describer gives them their specs (describe.py)
        self._local = compiled.local  # (receiving stage, i) -> hand-over on this rank
        # a device-wide sync forced after chosen computes (drain.py; none unless the environment asks)
        computes = [len(actions) for actions in sched.compute]
        self._drain_at = drain_at(rank, computes, training=self.training) if self.p > 1 else None
        self._steps = 0  # steps run: what a drawn drain point depends on

    # ---- measurements of the last step

    @property
    def busy(self) -> float:
        return self.clock.busy

    @property
    def events(self) -> list[TimedAction]:
        return self.clock.events

    def hook(self, a: Action, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Run ``before()`` just before compute action ``a`` and ``after()`` just after it, at every
        step (outside its busy time): the data-parallel reduction arms and launches there."""
        if a not in {b for b, _ in self._program if b is not None}:
            raise ValueError(f"rank {self.rank} runs no {a} in this schedule")
        self._hooks[a] = (before, after)
        self._bound = self._bind_hooks()

    def _bind_hooks(self) -> list[tuple[Action | None, Callable[[], None], bool, _Hooks | None]]:
        """The program with what each compute action needs beside it (whether it waits for a receive,
        its hooks): the step looks nothing up."""
        return [
            (a, fn, a in self._waits, self._hooks.get(a) if a is not None else None)
            for a, fn in self._program
        ]

    def follow_current_stream(self) -> None:
        """Compute runs on the caller's current stream, read at every step (not only at construction):
        a step under ``torch.cuda.stream(s)`` runs its stages on s, so receives must order s, not the
        stream that was current when the Pipeline was built."""
        current = stream.current_stream(self.device, self.emulated)
        self.compute_stream = self.clock.compute = current

    # ---- communication, called by the bound instructions

    def post(self, sends: list[Msg], recvs: list[Msg], what: str) -> None:
        """Post a comm block: ``sends`` (checked against their specs) and fresh buffers for ``recvs``."""
        comm = self.comm
        assert comm is not None
        for m in sends:
            m.tensors = send_tensors(m)
        for m in recvs:
            m.tensors = [comm.empty(sh, dt) for sh, dt in m.spec]
        if self._metering:
            for m in (*sends, *recvs):
                m.held = self.meter.hold(m.tensors)
        start = time.perf_counter() if self.clock.record else 0.0
        works = comm.post([(m.tensors, m.peer) for m in sends], [(m.tensors, m.peer) for m in recvs], what)
        if sends and self.clock.record:
            self.clock.posted([m.action for m in sends if m.action is not None], start)
        for m, w in zip(sends, works, strict=False):
            m.works = w
        for m, w in zip(recvs, works[len(sends) :], strict=True):
            m.works = w
        self._sent += sends

    def release(self, sends: list[Msg]) -> None:
        """The program's ``free``: ``sends`` are delivered; order them (a no-op wait by now) and drop
        their tensors."""
        for m in sends:
            if m.works is not None:
                self.comm.order(m.works, self.compute_stream, m.what)  # type: ignore[union-attr]
                m.works, m.tensors, m.held = None, [], None

    def take(self, m: Msg) -> Any:
        """A compute action's input: from the local hand-over, or the receive posted for it."""
        if m.action is None:
            value, m.value = m.value, None
            return value
        comm, works = self.comm, m.works
        assert comm is not None and works is not None
        start = time.perf_counter()
        comm.order(works, self.compute_stream, m.what)
        if self.nccl:
            self._ordered.append((m.what, works))
        m.works = None
        if m.held is not None:
            self._consumed.append(m.held)
            m.held = None
        self.release(m.reap)
        # The compute that asked for this input starts now: waiting is not busy time.
        self.clock.input_ready(m.action, start)
        buffers, m.tensors = m.tensors, []
        if m.action.kind is Kind.RECV_F:
            return from_tuple(buffers, m.like_tuple)
        it = iter(buffers)
        return tuple(next(it) if k else None for k in m.mask)

    # ---- the step

    def run(self, placed: Placed, described: Described, record: bool) -> None:
        """One step over micro-batches already described (every rank agreed on their signatures, the
        messages have their specs) and placed (on the device: ``inputs`` on stage 0's rank,
        ``targets`` on the last's): the program, and nothing else."""
        inputs, targets = placed.xs, placed.ys
        self.inputs, self.targets = inputs, targets
        self.follow_current_stream()
        clock = self.clock
        clock.begin_step(record)
        for st in self.stages.values():
            st.losses = []
            st.reset_peak()
        self._metering = self.training and self.meter.enabled
        if self._metering:  # parameters, buffers and the step's data are not activations
            self.meter.begin_step(
                self.meter.owned([st.module for st in self.stages.values()], (*inputs, *targets))
            )
        try:
            with emulation.strict_devices(self.emulated):
                self.units = described.units
                share = self.on_rows(self.units) if self.on_rows is not None else None
                for st in self.stages.values():  # every step: another executor shares the stages
                    st.set_rows(self.units, share)
                bound, drain, k, steps = self.nccl, self._drain_at, 0, self._steps
                ends = self._ends if bound or drain is not None else None  # what reads the end events
                begin, end, consumed = clock.begin, clock.end, self._consumed
                for a, fn, waits, hooks in self._bound:
                    if a is None:
                        fn()
                        continue
                    if bound and len(self._ends) == RUN_AHEAD:
                        self._run_ahead_wait()
                    if hooks is not None:
                        hooks[0]()
                    begin(waits)
                    fn()  # may wait for its input first (clock.input_ready)
                    event = end(a)
                    if ends is not None:
                        ends.append((a, event))
                        if drain is not None and drain(steps, k):
                            self._device_sync(a)
                    k += 1
                    if consumed:
                        consumed.clear()
                    if hooks is not None:
                        hooks[1]()
                self._drain()
            self._steps += 1
            if self.training:
                self.meter.end_step()
        except BaseException:
            self._reset()
            raise
        finally:
            self._ends.clear()
            self._ordered.clear()

    def _run_ahead_wait(self) -> None:
        """Wait until the device has finished the compute ``RUN_AHEAD`` actions back (see the docstring)."""
        a, event = self._ends[0]
        if stream.event_done(event):
            return
        assert self.comm is not None
        self.comm.poll(lambda: stream.event_done(event), lambda: self._stuck_on(a))

    def _device_sync(self, a: Action) -> None:
        """What a device-wide synchronisation does while the host queues ``a`` (drain.py): the host
        waits until ``a`` and every transfer this rank has posted are done, posting nothing."""
        assert self.comm is not None
        transport, held = self.comm.transport, f"the device-wide sync forced at {a} ({_DRAIN_ENV})"
        event = self._ends[-1][1]
        if not stream.event_done(event):
            self.comm.poll(lambda: stream.event_done(event), lambda: f"{a} to finish, in {held}")
        posted = {id(m): m for m in (*self.msgs.values(), *self._sent) if m.works}
        for m in posted.values():
            assert m.works is not None
            transport.drain(m.works, f"{m.what}, posted before {held}")

    def _stuck_on(self, a: Action) -> str:
        """What the device is most likely waiting for when ``a`` does not finish: the oldest open receive."""
        for what, works in self._ordered:
            if not all(w.is_completed() for w in works):
                return what
        return f"the device to finish {a}"

    def _drain(self) -> None:
        # the program waited for every receive and freed every send; what is left is the header's
        open_ = [a for a, m in self.msgs.items() if m.works is not None]
        assert not open_, f"rank {self.rank}'s program left messages open: {open_}"
        assert self.comm is not None or not self._sent
        for m in self._sent:
            if m.works is not None:
                self.comm.order(m.works, self.compute_stream, m.what)  # type: ignore[union-attr]
                m.works, m.tensors, m.held = None, [], None
        self._sent = []

    def _reset(self) -> None:
        """After a failure: drop the step's tensors and works, so that the next step starts clean."""
        # works still pending stay referenced (with their tensors) until the next failure: gloo
        # completes them with an error once the failure has closed the group's connections
        msgs = (*self.msgs.values(), *self._local.values(), *self._sent)
        self._abandoned = [m.works for m in msgs if m.works is not None]
        for m in msgs:
            m.value, m.tensors, m.works, m.held = None, [], None, None
        self._sent = []
        self._consumed.clear()
