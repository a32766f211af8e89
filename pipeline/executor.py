"""Run one rank's lowered action list: bound instructions, batched comm, measured timeline.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank, p: ranks

At construction the rank's lowered list is compiled once into bound callables:

    lowered:   0F1 | 0SEND_F1 0RECV_B0 | 0B0 | 0SEND_B0 ... | ...
    program:   [F(0,1)] [block: post sends + receives, and the next block's
                         receives ahead of need] [B(0,0)] ...

Each compute instruction takes its input from a mailbox, filled either locally
(the neighbour stage is on this rank: no copy, no comm) or by a receive that it
waits for only now (posted one block earlier when the backend allows it, so
the transfer overlaps the compute in between). Sends are never waited for
inside the step; their works and tensors are reaped when complete and drained
at the step's end.

Metadata (shapes and dtypes between stages). At every step, the rank of stage 0
sends a (64,) int64 header with the input micro-batch's signature and its
autocast state (off, or on with a dtype, for the pipeline's device type) down
the chain of ranks 0 -> 1 -> ... -> p-1, before any other message on each link:
one tiny one-way message per link per step, which arrives while the previous
rank computes its first forward, so it is off the critical path. Every rank
must run the step under the same autocast state (it decides the dtypes between
stages), and one that does not fails at once. When the header differs from the
previous step's (or at the first step), every rank derives its stages' input
and output signatures in stage order, with fake tensors (no compute, under the
step's autocast), passing them on through the store. Receive buffers are then
allocated from these signatures without further messages; a stage output or
input gradient that does not match them fails before it is sent (gloo fills
a larger buffer silently and aborts the process on a smaller one).

Lookahead posting of receives is on for gloo and off for NCCL: NCCL runs a
process group's transfers on one stream in post order, so a receive posted
early could hold back a send that the peer needs first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pipeline import stream
from pipeline.actions import Action, Kind
from pipeline.microbatch import Batch, Signature, as_tuple, from_tuple, signature
from pipeline.p2p import HEADER_LEN, Comm, Job, decode, encode
from pipeline.schedule import Schedule
from pipeline.simulate import TimedAction
from pipeline.stage import Grads, StageRuntime

__all__ = ["Executor"]


class _Recv:
    """A posted receive: its buffers and works; float_mask marks which tensors arrive (grads)."""

    __slots__ = ("buffers", "job", "like_tuple", "mask")

    def __init__(self, buffers: list[torch.Tensor], mask: list[bool], like_tuple: bool) -> None:
        self.buffers, self.mask, self.like_tuple = buffers, mask, like_tuple
        self.job: Job | None = None


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
        self._acts: dict[tuple[int, int], Batch] = {}
        self._grads: dict[tuple[int, int], Grads] = {}
        self._out_f: dict[tuple[int, int], Batch] = {}
        self._out_b: dict[tuple[int, int], Grads] = {}
        self._posted: dict[Action, _Recv] = {}
        self._inflight: list[tuple[Job, str]] = []
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
        self._program = self._compile(sched.lowered()[rank])

    # ---- compile

    def _compile(self, lowered: tuple[Action, ...]) -> list[tuple[Action | None, Callable[[], None]]]:
        """(action, callable) per instruction; a comm block's action is None."""
        blocks: list[list[Action]] = []
        program: list[tuple[Action | None, Any]] = []
        for act in lowered:
            if act.kind.is_compute:
                program.append((act, self._bind(act)))
            elif program and program[-1][0] is None:
                program[-1][1].append(act)
            else:
                blocks.append([act])
                program.append((None, blocks[-1]))
        # receives of block k+1 are posted with block k (lookahead), the first block's at step start
        recvs = [[a for a in b if a.kind.is_recv] for b in blocks]
        self._first_recvs = recvs[0] if recvs and self.lookahead else []
        out: list[tuple[Action | None, Callable[[], None]]] = []
        k = 0
        for a, item in program:
            if a is not None:
                out.append((a, item))
                continue
            ahead = recvs[k + 1] if self.lookahead and k + 1 < len(blocks) else []
            own = [] if self.lookahead else recvs[k]
            sends = [b for b in blocks[k] if b.kind.is_send]
            out.append((None, self._bind_block(sends, own + ahead)))
            k += 1
        return out

    def _bind(self, a: Action) -> Callable[[], None]:
        s, i, stage = a.stage, a.microbatch, self.stages[a.stage]
        first, last = s == 0, s == self.n_stages - 1
        next_local = not last and self.sched.rank_of(s + 1) == self.rank
        prev_local = not first and self.sched.rank_of(s - 1) == self.rank
        if a.kind is Kind.F:

            def forward() -> None:
                x = self.inputs[i] if first else self._take(self._acts, (s, i), Action(s, Kind.RECV_F, i))
                out = stage.forward(i, x, self.targets[i] if last else None)
                if next_local:
                    self._acts[(s + 1, i)] = out  # type: ignore[assignment]
                elif not last:
                    self._out_f[(s, i)] = out  # type: ignore[assignment]

            return forward
        if a.kind is Kind.B:

            def backward() -> None:
                g = None if last else self._take(self._grads, (s, i), Action(s, Kind.RECV_B, i))
                gin = stage.backward(i, g)  # type: ignore[arg-type]
                if prev_local:
                    self._grads[(s - 1, i)] = gin  # type: ignore[assignment]
                elif not first:
                    self._out_b[(s, i)] = gin  # type: ignore[assignment]

            return backward

        def weight() -> None:
            stage.weight(i)

        return weight

    def _bind_block(self, sends: list[Action], recvs: list[Action]) -> Callable[[], None]:
        def block() -> None:
            self._post(sends, recvs)

        return block

    # ---- communication

    def _peer(self, a: Action) -> int:
        return self.sched.rank_of(a.peer_stage)

    def _what(self, a: Action) -> str:
        return f"{a} {'to' if a.kind.is_send else 'from'} rank {self._peer(a)}"

    def _post(self, sends: list[Action], recvs: list[Action]) -> None:
        if not sends and not recvs:  # a block whose receives were posted ahead
            return
        assert self.comm is not None
        comm, ops, kept = self.comm, [], []
        for a in sends:
            tensors = self._send_tensors(a)
            kept += tensors
            ops += [comm.op(True, t, self._peer(a)) for t in tensors]
        new: list[_Recv] = []
        for a in recvs:
            r = self._alloc(a)
            self._posted[a] = r
            new.append(r)
            ops += [comm.op(False, t, self._peer(a)) for t in r.buffers]
        if stream.is_cuda(self.comm_stream):
            stream.wait_stream(self.comm_stream, self.compute_stream)
            for t in kept:
                stream.record_stream(t, self.comm_stream)
        start = time.perf_counter()
        with stream.use_stream(self.comm_stream):
            works = comm.post(ops, self._what((sends or recvs)[0]))
        if self._record:
            end = time.perf_counter()
            self.events += [TimedAction(self.rank, a, start + self._clock, end + self._clock) for a in sends]
        n_send = len(ops) - sum(len(r.buffers) for r in new)
        if n_send:  # the waiter drops the sent tensors once they are out
            self._inflight = [(j, w) for j, w in self._inflight if not j.done.is_set()]
            self._inflight.append((comm.watch(works[:n_send], kept), self._what(sends[0])))
        k = n_send
        for r in new:
            r.job, k = comm.watch(works[k : k + len(r.buffers)]), k + len(r.buffers)

    def _send_tensors(self, a: Action) -> list[torch.Tensor]:
        key = (a.stage, a.microbatch)
        if a.kind is Kind.SEND_F:
            out = self._out_f.pop(key)
            got, expected = signature(out), self.out_sig[a.stage]
            if got != expected:
                raise ValueError(
                    f"stage {a.stage} produced {_fmt(got)} for micro-batch {a.microbatch}, but stage "
                    f"{a.stage + 1} was set up for {_fmt(expected)}; a stage's output shape and dtype "
                    "must depend only on its input's"
                )
            return [t.detach().contiguous() for t in as_tuple(out)]
        grads = [g.contiguous() for g in self._out_b.pop(key) if g is not None]
        expected = tuple((sh, dt) for sh, dt in self.in_sig[a.stage] if dt.is_floating_point)
        got = signature(tuple(grads))
        if got != expected:
            raise ValueError(
                f"stage {a.stage} produced input gradients {_fmt(got)} for micro-batch {a.microbatch}, but "
                f"stage {a.stage - 1} expects {_fmt(expected)} (its floating-point outputs); this is a bug "
                "in the stage's backward, please report it"
            )
        return grads

    def _alloc(self, a: Action) -> _Recv:
        if a.kind is Kind.RECV_F:
            sig = self.in_sig[a.stage]
            mask = [True] * len(sig)
        else:
            sig = self.out_sig[a.stage]
            mask = [dtype.is_floating_point for _, dtype in sig]
        dev = self.device
        buffers = [torch.empty(sh, dtype=dt, device=dev) for (sh, dt), m in zip(sig, mask, strict=True) if m]
        return _Recv(buffers, mask, len(sig) > 1)

    def _take(self, box: dict[tuple[int, int], Any], key: tuple[int, int], a: Action) -> Any:
        """A compute action's input: from the local mailbox, or the receive posted for it."""
        if key in box:
            return box.pop(key)
        r = self._posted.pop(a)
        assert self.comm is not None and r.job is not None
        start = time.perf_counter()
        self.comm.wait(r.job, self._what(a))
        if self._record:
            end = time.perf_counter()
            self.events.append(TimedAction(self.rank, a, start + self._clock, end + self._clock))
        if a.kind is Kind.RECV_F:
            return from_tuple(r.buffers, r.like_tuple)
        it = iter(r.buffers)
        return tuple(next(it) if m else None for m in r.mask)

    # ---- metadata

    def _exchange_header(self) -> tuple[Signature, int]:
        """Pass the input signature and autocast state down the ranks; see the module docstring."""
        mode = _autocast_mode(self.device)
        if self.rank == 0:
            sig = signature(self.inputs[0])
        if self.comm is None or self.p == 1:
            return sig, mode
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        if self.rank > 0:
            what = f"the step's input signature header from rank {self.rank - 1}"
            works = self.comm.post([self.comm.op(False, header, self.rank - 1)], what)
            self.comm.wait(self.comm.watch(works), what)
            sig, theirs = decode(header)
            if theirs != mode:
                raise ValueError(
                    f"rank {self.rank} runs the step with {_fmt_mode(mode, self.device)} but rank 0 with "
                    f"{_fmt_mode(theirs, self.device)}; wrap the step in the same torch.autocast (or none) "
                    "on every rank"
                )
        if self.rank < self.p - 1:
            out, what = encode(sig, mode), f"the input signature header to rank {self.rank + 1}"
            works = self.comm.post([self.comm.op(True, out, self.rank + 1)], what)
            self._inflight.append((self.comm.watch(works, [out]), what))
        return sig, mode

    def _setup(self, sig: Signature) -> None:
        """Every local stage's input and output signatures, in stage order."""
        self._version += 1
        key = f"{self.key_prefix}/sig{self._version}"
        for s in sorted(self.stages):
            if s == 0:
                in_sig = sig
            elif s - 1 in self.out_sig:
                in_sig = self.out_sig[s - 1]
            else:
                assert self.comm is not None
                raw = self.comm.wait_key(f"{key}/{s - 1}", f"stage {s - 1}'s output signature")
                in_sig, _ = decode(torch.frombuffer(bytearray(raw), dtype=torch.int64))
            self.in_sig[s] = in_sig
            if s < self.n_stages - 1:
                self.out_sig[s] = self.stages[s].infer(in_sig)
                if self.sched.rank_of(s + 1) != self.rank:
                    assert self.comm is not None
                    self.comm.set_key(f"{key}/{s}", encode(self.out_sig[s], 0).numpy().tobytes())

    # ---- the step

    def run(self, inputs: list[Batch], targets: list[Any], record: bool) -> None:
        """One step over prepared micro-batches (``inputs`` on stage 0's rank, ``targets`` on the last's)."""
        self.inputs, self.targets, self._record = inputs, targets, record
        self.events = []
        self._clock = time.time() - time.perf_counter()
        for st in self.stages.values():
            st.losses = []
            st.reset_peak()
        key = self._exchange_header()
        if key != self._input_key:  # the autocast state changes the dtypes between stages too
            self._setup(key[0])
            self._input_key = key
        if self._first_recvs:
            self._post([], self._first_recvs)
        busy = 0.0
        sync = record and self.device.type == "cuda"
        for a, fn in self._program:
            if a is None:
                fn()
                continue
            start = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize(self.device)
            end = time.perf_counter()
            busy += end - start
            if record:
                self.events.append(TimedAction(self.rank, a, start + self._clock, end + self._clock))
        self.busy = busy
        self._drain()

    def _drain(self) -> None:
        assert not self._posted, f"receives left unconsumed: {list(self._posted)}"
        for job, what in self._inflight:
            assert self.comm is not None
            self.comm.wait(job, what)
        self._inflight = []


def _fmt(sig: Signature) -> str:
    parts = [f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in sig]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


# autocast state as one header word: 0 off, else 1 + the index of its dtype here
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _autocast_mode(device: torch.device) -> int:
    if not torch.is_autocast_enabled(device.type):
        return 0
    dtype = torch.get_autocast_dtype(device.type)
    return 1 + (_AUTOCAST_DTYPES.index(dtype) if dtype in _AUTOCAST_DTYPES else len(_AUTOCAST_DTYPES))


def _fmt_mode(mode: int, device: torch.device) -> str:
    if mode == 0:
        return f"autocast off on {device.type}"
    dtype = _AUTOCAST_DTYPES[mode - 1] if mode <= len(_AUTOCAST_DTYPES) else "another dtype"
    return f"autocast({str(dtype).replace('torch.', '')}) on {device.type}"
