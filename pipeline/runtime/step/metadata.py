"""The metadata protocol: shapes and dtypes between stages, agreed once per input signature.

    # s: stage, i: micro-batch, r: this rank, p: ranks

At every step, the rank of stage 0 sets an int64 header in the store with
each micro-batch's signature (each distinct one once) and its autocast state
(off, or on with a dtype, for the pipeline's device type), and any words a
step adds (a varlen step: its sequences' lengths, varlen.py); every other rank
reads it there, and the last to read it deletes it:

    header:  [autocast, m, d, d x (n, (dtype, ndim, *shape) per tensor), m x index, e, e x word]
    rank 0 --set key header<n>--> store --get--> ranks 1 .. p-1

A header whose content (all but its first word) is that of the last full header
(a run of fixed shapes: every step but the first) goes as two words, 16 bytes:

    same:    [autocast, the call number of that full header]

Every rank reads every header in call order, so each holds the last full one
(``Comm.header``); a reader that does not hold the one named fails at once. Rank 0
still takes every micro-batch's signature at every step and compares: a new shape
sends the full header, which every rank sets up before it posts a receive.

One store write of 16 bytes and p - 1 reads per step (with 2 ranks the one reader
deletes the key; with more, a counter names the last), made while rank 0 computes
its first forward, so they are off the critical path. The header is host bytes: no rank
reads a device tensor for it, so a step on CUDA never waits on the device for
its signature (a header sent on the GPU had to be copied to the host, a sync).
Every rank must run the step under the same autocast state (it decides the dtypes between
stages), and one that does not fails at once. The header's first word also
says which call it belongs to, (kind, n): the n-th ``step`` / ``evaluate`` /
``predict`` of this Pipeline (``begin_call``), so that ranks that call
different methods, or one call more, fail at once, naming both calls, at no
cost (no extra message), rather than wait out the timeout on keys that the
other call never sets:

    word 0:  autocast | kind << 8 | n << 10

For each micro-batch signature it has not seen before (under this autocast state), every
rank derives its stages' input and output signatures in stage order, with fake tensors (no
compute, under the step's autocast; once per process for a stage of the same structure, as a
sweep's Pipelines have: shape_memo.py), passing them on through the store; each message then
takes its micro-batch's. A batch split evenly (microbatch.py) has at most two micro-batch
signatures (B = 30, m = 4: 8, 8, 7 and 7 rows), set up at the first step; a varlen step
(varlen.py) one per distinct (rows, length), each set up once for the run:

    header B=30, m=4 -> rows [8, 8, 7, 7] -> signatures per stage for 8 and for 7 rows
                     -> F(s, i=2)'s buffers: stage s's input signature for 7 rows

Receive buffers are then
allocated from these signatures without further messages; a stage output or
input gradient that does not match them fails before it is sent (gloo fills
a larger buffer silently and aborts the process on a smaller one).

The store carries the header and the signatures as plain bytes. On the NCCL
path a dtype NCCL cannot send is refused at the first step's setup, naming the
stage boundary (``check_sendable``).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Collection, Sequence

import torch

from pipeline.runtime.comm.p2p import Comm
from pipeline.runtime.comm.stream import from_host
from pipeline.runtime.inputs.microbatch import Signature, as_tuple, signature
from pipeline.runtime.step.program import Msg
from pipeline.runtime.step.stage import StageRuntime
from pipeline.runtime.trace.shape_rules import ShapeRule, apply_chain, trace_rule
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.schedule import Schedule

__all__ = [
    "CALLS",
    "HEADER_LEN",
    "Signatures",
    "autocast_mode",
    "begin_call",
    "check_sendable",
    "decode",
    "derive_signatures",
    "encode",
    "encode_words",
    "exchange_header",
    "exchange_rules",
    "send_tensors",
    "set_specs",
]

HEADER_LEN = 64
_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
# autocast state as one header word: 0 off, else 1 + the index of its dtype here
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CALLS = ("step", "evaluate", "predict")  # the Pipeline calls that run a schedule, as the header numbers them
_KIND_SHIFT, _COUNT_SHIFT = 8, 10
_SAME_LEN = 2  # words of a header that repeats the last full one (a full one has at least 6)


# ---- the header


def encode(sig: Signature, tag: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``encode_words`` as a (HEADER_LEN,) int64 tensor on ``device``."""
    return from_host(encode_words(sig, tag), torch.int64, torch.device(device))


def encode_words(sig: Signature, tag: int) -> list[int]:
    """``[tag, n, (dtype, ndim, *shape) per tensor, 0 ...]``: HEADER_LEN words.

    ``tag`` is one word for the caller (an output header says whether the outputs are a tuple).
    """
    words = [tag, *_sig_words(sig)]
    if len(words) > HEADER_LEN:
        raise ValueError(
            f"stage input signature {sig} needs {len(words)} header words, more than {HEADER_LEN}; "
            "pass fewer or lower-dimensional tensors between stages"
        )
    return words + [0] * (HEADER_LEN - len(words))


def decode(header: torch.Tensor | Sequence[int]) -> tuple[Signature, int]:
    """Inverse of ``encode`` (or of ``encode_words``): (signature, tag)."""
    words = header.tolist() if isinstance(header, torch.Tensor) else list(header)
    return _read_sig(words, 1)[0], words[0]


def autocast_mode(device: torch.device) -> int:
    """The autocast state on ``device``'s type as one header word."""
    if not torch.is_autocast_enabled(device.type):
        return 0
    dtype = torch.get_autocast_dtype(device.type)
    return 1 + (_AUTOCAST_DTYPES.index(dtype) if dtype in _AUTOCAST_DTYPES else len(_AUTOCAST_DTYPES))


def begin_call(comm: Comm | None, kind: str) -> None:
    """A Pipeline call that runs a schedule starts: count it on ``comm`` for the step header."""
    if comm is not None:
        comm.call = (CALLS.index(kind), comm.call[1] + 1)


def _call_word(mode: int, call: tuple[int, int]) -> int:
    return mode | call[0] << _KIND_SHIFT | call[1] << _COUNT_SHIFT


def _split_word(word: int) -> tuple[int, tuple[int, int]]:
    """(autocast mode, (call kind, call number)) of a header's first word."""
    return word & 0xFF, ((word >> _KIND_SHIFT) & 3, word >> _COUNT_SHIFT)


def _fmt_call(call: tuple[int, int]) -> str:
    kind, n = call
    name = CALLS[kind] if kind < len(CALLS) else f"call kind {kind}"
    return f"{name}() (its call number {n} on this Pipeline)"


def exchange_header(
    comm: Comm | None,
    rank: int,
    p: int,
    device: torch.device,
    micro: Sequence[Signature] | None,
    extra: Sequence[int] = (),
) -> tuple[tuple[Signature, ...], int, tuple[int, ...]]:
    """(each micro-batch's signature, the autocast state, the extra words) of the step, through the
    store: one key per call of the Pipeline, whichever executor runs it (a step's or an evaluation's).

    Rank 0 passes its micro-batches' signatures as ``micro`` (and ``extra``) and sets the header; the
    others (None) read it and check that they run the same call under the same autocast state. A
    header that repeats the last full one goes as two words (the module docstring). The last reader
    deletes it (with more than one reader, a counter in the store names it), so the store does not
    grow with the steps.
    """
    mode = autocast_mode(device)
    if rank == 0:
        assert micro is not None
        sigs, words = tuple(micro), tuple(extra)
    if comm is None or p == 1:
        return sigs, mode, words
    n = comm.call[1]
    at = f"{comm.key_prefix}/header{n}"  # a rank one call ahead reads another key
    if rank == 0:
        tag = _call_word(mode, comm.call)
        if comm.header is not None and comm.header[1] == (sigs, words):
            comm.set_key(at, struct.pack("<2q", tag, comm.header[0]))  # the same again
        else:
            header = _header_words(sigs, words, tag)
            comm.set_key(at, struct.pack(f"<{len(header)}q", *header))
            comm.header = (n, (sigs, words))
        return sigs, mode, words
    raw = comm.wait_key(at, f"the step's input signature header from rank {comm.name(0)}")
    values = struct.unpack(f"<{len(raw) // 8}q", raw)
    if len(values) == _SAME_LEN:
        word, since = values
        if comm.header is None or comm.header[0] != since:
            held = "none" if comm.header is None else f"call {comm.header[0]}'s"
            raise RuntimeError(
                f"rank {comm.me} holds {held} step header but rank {comm.name(0)} repeats call {since}'s; "
                "every rank reads every header in call order, so this is a bug, please report it"
            )
        sigs, words = comm.header[1]
    else:
        sigs, words, word = _read_header(values)
        comm.header = (n, (sigs, words))
    if p == 2:  # the one reader
        comm.delete_keys([at])
    elif comm.add_key(f"{at}/read", 1) == p - 1:  # the last of the p - 1 readers
        comm.delete_keys([at, f"{at}/read"])
    theirs, call = _split_word(word)
    if call != comm.call:
        raise ValueError(
            f"rank {comm.me} is in {_fmt_call(comm.call)} but rank {comm.name(0)} in "
            f"{_fmt_call(call)}; every rank must call step, evaluate and predict on the Pipeline "
            "in the same order, as many times"
        )
    if theirs != mode:
        raise ValueError(
            f"rank {comm.me} runs the step with {_fmt_mode(mode, device)} but rank {comm.name(0)} with "
            f"{_fmt_mode(theirs, device)}; wrap the step in the same torch.autocast (or none) "
            "on every rank"
        )
    return sigs, mode, words


def _header_words(micro: Sequence[Signature], extra: Sequence[int], tag: int) -> list[int]:
    """The step header (see the module docstring): each distinct signature once, then each
    micro-batch's index into them, then the extra words."""
    index = {sig: j for j, sig in enumerate(dict.fromkeys(micro))}  # each distinct one, in order
    words = [tag, len(micro), len(index)]
    for sig in index:
        words += _sig_words(sig)
    words += [index[sig] for sig in micro]
    return [*words, len(extra), *extra]


def _read_header(words: Sequence[int]) -> tuple[tuple[Signature, ...], tuple[int, ...], int]:
    """Inverse of ``_header_words``: (micro-batch signatures, extra words, tag)."""
    tag, m, d, k = words[0], words[1], words[2], 3
    distinct = []
    for _ in range(d):
        sig, k = _read_sig(words, k)
        distinct.append(sig)
    micro = tuple(distinct[words[k + i]] for i in range(m))
    k += m
    return micro, tuple(words[k + 1 : k + 1 + words[k]]), tag


def _sig_words(sig: Signature) -> list[int]:
    words = [len(sig)]
    for shape, dtype in sig:
        if dtype not in _DTYPES:
            raise ValueError(f"cannot send tensors of dtype {dtype} between stages; use one of {_DTYPES}")
        words += [_DTYPES.index(dtype), len(shape), *shape]
    return words


def _read_sig(words: Sequence[int], k: int) -> tuple[Signature, int]:
    """The signature that starts at ``words[k]``, and where the words after it start."""
    n, k = words[k], k + 1
    sig = []
    for _ in range(n):
        dtype, ndim = _DTYPES[words[k]], words[k + 1]
        sig.append((tuple(words[k + 2 : k + 2 + ndim]), dtype))
        k += 2 + ndim
    return tuple(sig), k


# ---- the signatures


# per local stage: its signature for each micro-batch signature (stage 0's input) seen so far
Signatures = dict[int, dict[Signature, Signature]]


def derive_signatures(
    micro: Sequence[Signature],
    stages: dict[int, StageRuntime],
    sched: Schedule,
    rank: int,
    comm: Comm | None,
    key: str,
    in_sig: Signatures,
    out_sig: Signatures,
    rules: dict[int, ShapeRule] | None = None,
) -> int:
    """Add every local stage's (input, output) signatures to ``in_sig`` and ``out_sig`` for each
    micro-batch signature of ``micro`` they do not hold yet (every rank sees the same headers, so
    they all miss the same ones).

    Per such signature, in stage order: an output that a stage on another rank takes is set in
    the store under ``key``; an input from another rank is waited for there. With ``rules`` (every
    stage's but the last, shape_rules.py) a signature they cover is computed here, with no message.
    Returns how many signatures were derived stage by stage (fake tensors, or their memo), not by rules.
    """
    for s in stages:
        in_sig.setdefault(s, {})
        if s < sched.n_stages - 1:
            out_sig.setdefault(s, {})
    new = [sig for sig in dict.fromkeys(micro) if not any(sig in d for d in in_sig.values())]
    if not stages:
        return 0
    last, derived = sched.n_stages - 1, 0
    for j, sig in enumerate(new):
        chain = apply_chain(rules, sig, sched.n_stages) if rules else None
        if chain is not None:  # every rank holds the same rules: all of them take this branch
            for s in stages:
                in_sig[s][sig] = chain[s]
                if s < last:
                    out_sig[s][sig] = chain[s + 1]
            continue
        ins, outs = _derive(sig, stages, sched, rank, comm, f"{key}/{j}")
        derived += 1
        for s, x in ins.items():
            in_sig[s][sig] = x
        for s, x in outs.items():
            out_sig[s][sig] = x
    return derived


def _derive(
    sig: Signature, stages: dict[int, StageRuntime], sched: Schedule, rank: int, comm: Comm | None, key: str
) -> tuple[dict[int, Signature], dict[int, Signature]]:
    """``derive_signatures`` for one micro-batch size, whose input signature is ``sig``."""
    in_sig: dict[int, Signature] = {}
    out_sig: dict[int, Signature] = {}
    for s in sorted(stages):
        if s == 0:
            in_sig[s] = sig
        elif s - 1 in out_sig:
            in_sig[s] = out_sig[s - 1]
        else:
            assert comm is not None
            raw = comm.wait_key(f"{key}/{s - 1}", f"stage {s - 1}'s output signature")
            in_sig[s], _ = decode(struct.unpack(f"<{HEADER_LEN}q", raw))
        if s < sched.n_stages - 1:
            out_sig[s] = stages[s].infer(in_sig[s])
            if sched.rank_of(s + 1) != rank:
                assert comm is not None
                comm.set_key(f"{key}/{s}", struct.pack(f"<{HEADER_LEN}q", *encode_words(out_sig[s], 0)))
    return in_sig, out_sig


def set_specs(
    msgs: dict[Action, Msg], in_sig: Signatures, out_sig: Signatures, micro: Sequence[Signature]
) -> None:
    """Each message's expected (shape, dtype)s, gradient mask and tuple form, from the signatures
    of its micro-batch (``micro[i]``: micro-batch i's signature at stage 0's input)."""
    for a, m in msgs.items():
        # forward messages carry the stage boundary's tensors, backward ones its float grads
        sigs = in_sig[a.stage] if a.kind in (Kind.RECV_F, Kind.SEND_B) else out_sig[a.stage]
        boundary = sigs[micro[a.microbatch]]
        forward = a.kind in (Kind.RECV_F, Kind.SEND_F)
        m.mask = [forward or dt.is_floating_point for _, dt in boundary]
        m.spec = tuple(x for x, k in zip(boundary, m.mask, strict=True) if k)
        m.like_tuple = len(boundary) > 1


def exchange_rules(
    micro: Sequence[Signature],
    in_sig: Signatures,
    stages: dict[int, StageRuntime],
    sched: Schedule,
    comm: Comm | None,
    key: str,
    one_row: bool = False,
) -> dict[int, ShapeRule] | None:
    """Every stage's shape rule but the last's (shape_rules.py), traced where the stage lives at the
    first micro-batch signature of ``micro`` (set up already, in the same order on every rank: they
    read the same headers) whose rows and length are at least 2, and shared through the store under
    ``key``; ``one_row`` (every micro-batch is one row for good: rows of documents, varlen.py), at
    the first whose length is at least 2, a rule for one row (tracing fixes the 1; elsewhere such a
    rule would leave later rows of many to fake tensors for good). None when none qualifies yet
    (ask again at a later step); empty when some stage has no rule (signatures are then derived
    per shape, for good).
    """
    small = 1 if one_row else 0  # the first dim a signature must have at least 2 of
    usable = [sig for sig in micro if all(n >= 2 for shape, _ in sig for n in shape[small:2])]
    if not usable:
        return None
    sig0, last = usable[0], sched.n_stages - 1
    rules: dict[int, ShapeRule | None] = {}
    for s in sorted(stages):
        if s < last:
            st = stages[s]
            rules[s] = trace_rule(st.module, in_sig[s][sig0], st.device)
            if comm is not None:
                comm.set_key(f"{key}/{s}", pickle.dumps(rules[s]))
    for s in range(last):
        if s not in rules:
            assert comm is not None
            rules[s] = pickle.loads(comm.wait_key(f"{key}/{s}", f"stage {s}'s shape rule"))
    if any(rule is None for rule in rules.values()):
        return {}
    return {s: rule for s, rule in rules.items() if rule is not None}


# ---- the checks


def check_sendable(msgs: dict[Action, Msg], dtypes: Collection[torch.dtype], backend: str) -> None:
    """Refuse, before any transfer, a stage boundary that carries a dtype ``backend`` cannot send."""
    for a in sorted(msgs, key=lambda a: (a.stage, a.microbatch, a.kind.value)):
        bad = [dt for _, dt in msgs[a].spec if dt not in dtypes]
        if bad:  # named from the sending stage, on both ends
            src = a.stage if a.kind.is_send else a.peer_stage
            dst = a.peer_stage if a.kind.is_send else a.stage
            what = "outputs" if dst > src else "input gradients"
            raise ValueError(
                f"stage {src}'s {what} for stage {dst} include a {str(bad[0]).replace('torch.', '')} "
                f"tensor, which {backend} cannot send; convert it in the model (e.g. .to(torch.int32)) "
                f"to one of {sorted(str(d).replace('torch.', '') for d in dtypes)}"
            )


def send_tensors(m: Msg) -> list[torch.Tensor]:
    """The tensors send ``m`` posts, taken from its value, once checked against its spec."""
    a, out = m.action, m.value
    assert a is not None
    m.value = None
    if a.kind is Kind.SEND_F:
        got = signature(out)
        if got != m.spec:
            raise ValueError(
                f"stage {a.stage} produced {_fmt(got)} for micro-batch {a.microbatch}, but stage "
                f"{a.stage + 1} was set up for {_fmt(m.spec)}; a stage's output shape and dtype "
                "must depend only on its input's (Pipelines of the same stages built in one process "
                "share their derived shapes: if the shapes depend on a global that changed since, call "
                "pipeline.runtime.trace.shape_memo.clear() before building this Pipeline)"
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


def _fmt(sig: Signature) -> str:
    parts = [f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in sig]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _fmt_mode(mode: int, device: torch.device) -> str:
    if mode == 0:
        return f"autocast off on {device.type}"
    dtype = _AUTOCAST_DTYPES[mode - 1] if mode <= len(_AUTOCAST_DTYPES) else "another dtype"
    return f"autocast({str(dtype).replace('torch.', '')}) on {device.type}"
