"""Run one rank's lowered action list: bound instructions, direct comm, measured timeline.

    # s: stage, i: micro-batch, r: this rank, q: a peer rank, p: ranks

At construction the rank's lowered list is compiled once into bound callables:

    lowered:   0F1 | 0SEND_F1 0RECV_B0 | 0B0 | 0SEND_B0 ... | ...
    program:   [F(0,1)] [block: post sends + receives, and the next block's
                         receives ahead of need] [B(0,0)] ...

Each compute instruction takes its input from a mailbox, filled either locally
(the neighbour stage is on this rank: no copy, no comm) or by a receive that it
waits for only now (posted one block earlier when the backend allows it, so
the transfer overlaps the compute in between). Every message of the step is a
``_Msg`` made at compile time, bound into the instructions that fill, post and
consume it, with its peer and its description for errors: the step itself does
no lookups and formats no strings.

Sends are never waited for inside the step except where they are known to be
done. A send X to rank q is done once q has waited for it; so if q, after the
compute that consumes X, sends some Y back, X is done by the time Y arrives
here. At compile time each send is attached to the first such receive (read off
q's lowered list), and waited for (a no-op that frees its tensors) just after it:

    rank r:  SEND_F(s,i) ......................... RECV_B(s,i) -> reap SEND_F(s,i)
    rank q:       RECV_F(s+1,i) -> F(s+1,i) ... B(s+1,i) -> SEND_B(s+1,i)

Sends with no such receive (the last ones of the step) are waited for at the
step's end.

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
from pipeline.p2p import HEADER_LEN, Comm, decode, encode
from pipeline.schedule import Schedule
from pipeline.simulate import TimedAction
from pipeline.stage import StageRuntime

__all__ = ["Executor"]


class _Msg:
    """One message of the step (or a local hand-over, with ``action`` None), made at compile time.

    ``value``: what the producing compute left (a batch or grads); ``tensors``: what
    was posted (sent tensors or receive buffers); ``works``: their works until
    waited for; ``spec``: the (shape, dtype) expected or allocated, set at setup;
    ``mask``: for gradients, which tensors of the batch take one; ``reap``: sends
    known to be done once this receive is.
    """

    __slots__ = ("action", "like_tuple", "mask", "peer", "reap", "spec", "tensors", "value", "what", "works")

    def __init__(self, action: Action | None, peer: int) -> None:
        self.action, self.peer = action, peer
        self.what = ""
        if action is not None:
            self.what = f"{action} {'to' if action.kind.is_send else 'from'} rank {peer}"
        self.value: Any = None
        self.tensors: list[torch.Tensor] = []
        self.works: list[Any] | None = None
        self.spec: Signature = ()
        self.mask: list[bool] = []
        self.like_tuple = False
        self.reap: list[_Msg] = []


def _consumer(a: Action) -> Action:
    """The compute action on the peer that takes what send ``a`` carries."""
    if a.kind is Kind.SEND_F:
        return Action(a.stage + 1, Kind.F, a.microbatch)
    return Action(a.stage - 1, Kind.B, a.microbatch)


def _receiver(a: Action) -> Action:
    """The receive that matches send ``a``, on the peer."""
    if a.kind is Kind.SEND_F:
        return Action(a.stage + 1, Kind.RECV_F, a.microbatch)
    return Action(a.stage - 1, Kind.RECV_B, a.microbatch)


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
        self._sent: list[_Msg] = []  # sends posted this step, waited for by the step's end
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
        self._msgs: dict[Action, _Msg] = {}
        self._local: dict[tuple[int, int], _Msg] = {}  # (receiving stage, i) -> hand-over on this rank
        self._program = self._compile(sched.lowered())

    # ---- compile

    def _msg(self, a: Action) -> _Msg:
        if a not in self._msgs:
            self._msgs[a] = _Msg(a, self.sched.rank_of(a.peer_stage))
        return self._msgs[a]

    def _box(self, s: int, i: int) -> _Msg:
        if (s, i) not in self._local:
            self._local[(s, i)] = _Msg(None, self.rank)
        return self._local[(s, i)]

    def _compile(
        self, lowered: tuple[tuple[Action, ...], ...]
    ) -> list[tuple[Action | None, Callable[[], None]]]:
        """(action, callable) per instruction; a comm block's action is None."""
        mine = lowered[self.rank]
        blocks: list[list[Action]] = []
        program: list[tuple[Action | None, Any]] = []
        for act in mine:
            if act.kind.is_compute:
                program.append((act, self._bind(act)))
            elif program and program[-1][0] is None:
                program[-1][1].append(act)
            else:
                blocks.append([act])
                program.append((None, blocks[-1]))
        self._attach_reaps(mine, lowered)
        # receives of block k+1 are posted with block k (lookahead), the first block's at step start
        recvs = [[self._msg(a) for a in b if a.kind.is_recv] for b in blocks]
        self._first_recvs = recvs[0] if recvs and self.lookahead else []
        out: list[tuple[Action | None, Callable[[], None]]] = []
        k = 0
        for a, item in program:
            if a is not None:
                out.append((a, item))
                continue
            ahead = recvs[k + 1] if self.lookahead and k + 1 < len(blocks) else []
            own = [] if self.lookahead else recvs[k]
            sends = [self._msg(b) for b in blocks[k] if b.kind.is_send]
            if sends or own or ahead:
                out.append((None, self._bind_block(sends, own + ahead)))
            k += 1
        return out

    def _attach_reaps(self, mine: tuple[Action, ...], lowered: tuple[tuple[Action, ...], ...]) -> None:
        """Attach each send to the first receive here that proves it done (see the module docstring)."""
        for a in mine:
            if not a.kind.is_send:
                continue
            q = self.sched.rank_of(a.peer_stage)
            theirs = lowered[q]
            consumer = _consumer(a)
            if consumer not in theirs:
                continue
            for b in theirs[theirs.index(consumer) + 1 :]:
                if b.kind.is_send and self.sched.rank_of(b.peer_stage) == self.rank:
                    back = _receiver(b)
                    if back in mine:
                        self._msg(back).reap.append(self._msg(a))
                    break

    def _bind(self, a: Action) -> Callable[[], None]:
        s, i, stage = a.stage, a.microbatch, self.stages[a.stage]
        first, last = s == 0, s == self.n_stages - 1
        next_local = not last and self.sched.rank_of(s + 1) == self.rank
        prev_local = not first and self.sched.rank_of(s - 1) == self.rank
        if a.kind is Kind.F:
            src = None if first else self._box(s, i) if prev_local else self._msg(Action(s, Kind.RECV_F, i))
            dst = (
                None if last else self._box(s + 1, i) if next_local else self._msg(Action(s, Kind.SEND_F, i))
            )

            def forward() -> None:
                x = self.inputs[i] if src is None else self._take(src)
                out = stage.forward(i, x, self.targets[i] if last else None)
                if dst is not None:
                    dst.value = out

            return forward
        if a.kind is Kind.B:
            gsrc = None if last else self._box(s, i) if next_local else self._msg(Action(s, Kind.RECV_B, i))
            gdst = (
                None if first else self._box(s - 1, i) if prev_local else self._msg(Action(s, Kind.SEND_B, i))
            )

            def backward() -> None:
                g = None if gsrc is None else self._take(gsrc)
                gin = stage.backward(i, g)
                if gdst is not None:
                    gdst.value = gin

            return backward

        def weight() -> None:
            stage.weight(i)

        return weight

    def _bind_block(self, sends: list[_Msg], recvs: list[_Msg]) -> Callable[[], None]:
        what = (sends or recvs)[0].what

        def block() -> None:
            self._post(sends, recvs, what)

        return block

    # ---- communication

    def _post(self, sends: list[_Msg], recvs: list[_Msg], what: str) -> None:
        assert self.comm is not None
        for m in sends:
            m.tensors = self._send_tensors(m)
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

    def _send_tensors(self, m: _Msg) -> list[torch.Tensor]:
        a, out = m.action, m.value
        assert a is not None
        m.value = None
        if a.kind is Kind.SEND_F:
            got = signature(out)
            if got != m.spec:
                raise ValueError(
                    f"stage {a.stage} produced {_fmt(got)} for micro-batch {a.microbatch}, but stage "
                    f"{a.stage + 1} was set up for {_fmt(m.spec)}; a stage's output shape and dtype "
                    "must depend only on its input's"
                )
            return [t.detach().contiguous() for t in as_tuple(out)]
        grads = [g.contiguous() for g in out if g is not None]
        got = signature(tuple(grads))
        if got != m.spec:
            raise ValueError(
                f"stage {a.stage} produced input gradients {_fmt(got)} for micro-batch {a.microbatch}, but "
                f"stage {a.stage - 1} expects {_fmt(m.spec)} (its floating-point outputs); this is a bug "
                "in the stage's backward, please report it"
            )
        return grads

    def _take(self, m: _Msg) -> Any:
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
        """Pass the input signature and autocast state down the ranks; see the module docstring."""
        mode = _autocast_mode(self.device)
        if self.rank == 0:
            sig = signature(self.inputs[0])
        if self.comm is None or self.p == 1:
            return sig, mode
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        if self.rank > 0:
            what = f"the step's input signature header from rank {self.rank - 1}"
            (works,) = self.comm.post([], [([header], self.rank - 1)], what)
            self.comm.wait(works, what)
            sig, theirs = decode(header)
            if theirs != mode:
                raise ValueError(
                    f"rank {self.rank} runs the step with {_fmt_mode(mode, self.device)} but rank 0 with "
                    f"{_fmt_mode(theirs, self.device)}; wrap the step in the same torch.autocast (or none) "
                    "on every rank"
                )
        if self.rank < self.p - 1:
            m = _Msg(None, self.rank + 1)
            m.what, m.tensors = f"the input signature header to rank {self.rank + 1}", [encode(sig, mode)]
            (m.works,) = self.comm.post([(m.tensors, m.peer)], [], m.what)
            self._sent.append(m)
        return sig, mode

    def _setup(self, sig: Signature) -> None:
        """Every local stage's input and output signatures, in stage order; the messages' specs."""
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
        for a, m in self._msgs.items():
            # forward messages carry the stage boundary's tensors, backward ones its float grads
            boundary = self.in_sig[a.stage] if a.kind in (Kind.RECV_F, Kind.SEND_B) else self.out_sig[a.stage]
            forward = a.kind in (Kind.RECV_F, Kind.SEND_F)
            m.mask = [forward or dt.is_floating_point for _, dt in boundary]
            m.spec = tuple(x for x, k in zip(boundary, m.mask, strict=True) if k)
            m.like_tuple = len(boundary) > 1

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
                self._post([], self._first_recvs, self._first_recvs[0].what)
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
