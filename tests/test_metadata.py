"""The step header's encoding, its cost per call through the store, the autocast word, the message specs
and the send checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline.runtime.comm.p2p import NCCL_DTYPES
from pipeline.runtime.step.metadata import (
    HEADER_LEN,
    autocast_mode,
    begin_call,
    check_sendable,
    decode,
    encode,
    encode_words,
    exchange_header,
    send_tensors,
    set_specs,
)
from pipeline.runtime.step.program import Msg
from pipeline.schedules.actions import Action, Kind


def test_header_round_trip() -> None:
    sig = (((2, 3, 4), torch.float32), ((2,), torch.int64), ((), torch.bfloat16))
    header = encode(sig, 7)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert header[:4].tolist() == [7, 3, 0, 3]  # tag, n, then float32 with 3 dims
    assert decode(header) == (sig, 7)


def test_header_rejects_unknown_dtype_and_overflow() -> None:
    with pytest.raises(ValueError, match=r"cannot send tensors of dtype torch.complex64"):
        encode((((1,), torch.complex64),), 0)
    with pytest.raises(ValueError, match=r"needs 65 header words, more than 64"):
        encode(tuple(((1,), torch.float32) for _ in range(21)), 0)
    assert decode(encode(tuple(((1,), torch.float32) for _ in range(20)), 0))[0][-1] == ((1,), torch.float32)


def test_autocast_mode_word() -> None:
    cpu = torch.device("cpu")
    assert autocast_mode(cpu) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_mode(cpu) == 2  # 1 + index of bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_mode(cpu) == 1


def test_specs_carry_tensors_forward_and_float_grads_backward() -> None:
    boundary = (((4, 8), torch.float32), ((4,), torch.int64))
    send_f, send_b = Msg(Action(0, Kind.SEND_F, 1), 1), Msg(Action(1, Kind.SEND_B, 1), 0)
    msgs = {send_f.action: send_f, send_b.action: send_b}
    set_specs(msgs, {1: {4: boundary}}, {0: {4: boundary}}, [4, 4])  # type: ignore[dict-item]
    assert send_f.spec == boundary and send_f.mask == [True, True] and send_f.like_tuple
    assert send_b.spec == boundary[:1] and send_b.mask == [True, False]


def test_specs_take_their_micro_batchs_rows() -> None:
    """B = 7, m = 3: micro-batch 0 has 3 rows, 1 and 2 have 2: each message the signature of its size."""
    sigs = {n: (((n, 8), torch.float32),) for n in (3, 2)}
    msgs = {Action(0, Kind.SEND_F, i): Msg(Action(0, Kind.SEND_F, i), 1) for i in range(3)}
    set_specs(msgs, {}, {0: sigs}, [3, 2, 2])  # type: ignore[arg-type]
    assert [m.spec[0][0] for m in msgs.values()] == [(3, 8), (2, 8), (2, 8)]


def test_send_checks_name_stage_and_signatures() -> None:
    m = Msg(Action(0, Kind.SEND_F, 3), 1)
    m.spec = (((4, 8), torch.float32),)
    m.value = torch.zeros(4, 8)
    assert [t.shape for t in send_tensors(m)] == [(4, 8)] and m.value is None
    m.value = torch.zeros(4, 9)
    with pytest.raises(ValueError, match=r"stage 0 produced \[4, 9\] float32 for micro-batch 3, but stage 1 "
                       r"was set up for \[4, 8\] float32"):  # fmt: skip
        send_tensors(m)
    g = Msg(Action(1, Kind.SEND_B, 3), 0)
    g.spec = (((4, 8), torch.float32),)
    g.value = (torch.zeros(4, 8, dtype=torch.float64), None)
    want = r"stage 1 produced input gradients \[4, 8\] float64 for micro-batch 3, "
    want += r"but stage 0 expects \[4, 8\] float32"
    with pytest.raises(ValueError, match=want):
        send_tensors(g)


def test_header_is_made_on_the_given_device_and_decodes_from_words() -> None:
    sig = (((2, 3), torch.float32),)
    with torch.device("meta"):  # the NCCL emulation's default device: nothing here may rely on it
        assert encode(sig, 1).device == torch.device("cpu")
        assert encode(sig, 1, "meta").is_meta
        assert decode(encode_words(sig, 1)) == (sig, 1)


def test_unsendable_dtypes_are_named_by_boundary_on_both_ends() -> None:
    recv_b = Msg(Action(0, Kind.RECV_B, 2), 1)
    recv_b.spec = (((4,), torch.float32), ((4,), torch.int16))
    with pytest.raises(ValueError, match=r"^stage 1's input gradients for stage 0 include a int16 tensor, "
                       r"which NCCL cannot send; convert it"):  # fmt: skip
        check_sendable({recv_b.action: recv_b}, NCCL_DTYPES, "NCCL")  # type: ignore[dict-item]
    recv_b.spec = (((4,), torch.float32),)
    check_sendable({recv_b.action: recv_b}, NCCL_DTYPES, "NCCL")  # type: ignore[dict-item]


# ---- the step header through the store: what a call costs, and what a new shape costs


class _Group:
    """The store and the per-rank ``Comm`` stand-ins of one group (exchange_header's use of ``Comm``):
    every store call on a step header key is logged as (rank, op, key, bytes)."""

    def __init__(self, p: int) -> None:
        self.p, self.keys, self.log = p, {}, []  # type: ignore[var-annotated]
        self.comms = [_Comm(self, r) for r in range(p)]


class _Comm:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.me, self.key_prefix = group, rank, "pipe"
        self.call, self.header = (0, 0), None  # type: ignore[var-annotated]

    def name(self, q: int) -> int:
        return q

    def set_key(self, key: str, value: bytes) -> None:
        self.group.keys[key] = value
        self.group.log.append((self.me, "set", key, len(value)))

    def wait_key(self, key: str, what: str) -> bytes:
        value = self.group.keys[key]  # the setter ran first
        self.group.log.append((self.me, "get", key, len(value)))
        return value  # type: ignore[no-any-return]

    def add_key(self, key: str, amount: int) -> int:
        self.group.keys[key] = self.group.keys.get(key, 0) + amount
        self.group.log.append((self.me, "add", key, 8))
        return self.group.keys[key]  # type: ignore[no-any-return]

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            del self.group.keys[key]
            self.group.log.append((self.me, "delete", key, 0))


def _call(group: _Group, kind: str, micro: list[Any], extra: tuple[int, ...] = ()) -> list[Any]:
    """One call on every rank, rank 0 first: each rank's (signatures, autocast, extra words)."""
    for comm in group.comms:
        begin_call(comm, kind)  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    return [
        exchange_header(comm, r, group.p, cpu, micro if r == 0 else None, extra)  # type: ignore[arg-type]
        for r, comm in enumerate(group.comms)
    ]


def _sig(rows: int) -> Any:
    return (((rows, 4), torch.float32),)


@pytest.mark.parametrize("p", [2, 3])
def test_an_unchanged_header_is_one_message_of_16_bytes(p: int) -> None:
    group = _Group(p)
    first = _call(group, "step", [_sig(4), _sig(4)])
    full = next(n for r, op, _, n in group.log if op == "set")
    assert full > 16
    for step in range(2, 5):
        group.log.clear()
        kind = "evaluate" if step == 3 else "step"  # another executor, the same call sequence
        got = _call(group, kind, [_sig(4), _sig(4)])
        assert got == first  # every rank: the signatures, autocast off, no extra words
        key = f"pipe/header{step}"
        sets = [(r, n) for r, op, k, n in group.log if op == "set" and k == key]
        gets = [(r, n) for r, op, k, n in group.log if op == "get" and k == key]
        assert sets == [(0, 16)]  # one message from rank 0, two words
        assert sorted(gets) == [(r, 16) for r in range(1, p)]  # read once by every other rank
        ops = sorted(op for _, op, _, _ in group.log)
        if p == 2:  # the one reader deletes it: no counter
            assert ops == ["delete", "get", "set"]
        else:  # a counter names the last reader, which deletes the key and the counter
            assert ops == ["add", "add", "delete", "delete", "get", "get", "set"]
        assert not group.keys  # nothing left behind


def test_a_new_shape_or_new_words_send_the_full_header_again() -> None:
    group = _Group(3)
    _call(group, "step", [_sig(4), _sig(4)])
    for micro, extra in (([_sig(3), _sig(3)], ()), ([_sig(3), _sig(3)], (5, 6)), ([_sig(4), _sig(4)], ())):
        group.log.clear()
        got = _call(group, "step", micro, extra)
        assert all(g == (tuple(micro), 0, extra) for g in got)  # every rank sets up the new shape
        (sent,) = [n for _, op, _, n in group.log if op == "set"]
        assert sent > 16  # the full header
    group.log.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast rides in the first word
        got = _call(group, "step", [_sig(4), _sig(4)])
    assert [n for _, op, _, n in group.log if op == "set"] == [16]
    assert all(mode == 2 for _, mode, _ in got)


def test_a_repeated_header_names_what_rank_0_and_the_reader_hold() -> None:
    group = _Group(2)
    _call(group, "step", [_sig(4)])
    group.comms[1].header = None  # a reader that missed the full header (never, unless a bug)
    with pytest.raises(RuntimeError, match=r"rank 1 holds none step header but rank 0 repeats call 1's"):
        _call(group, "step", [_sig(4)])


def test_a_repeated_header_still_names_a_call_that_differs() -> None:
    group = _Group(2)
    _call(group, "step", [_sig(4)])
    begin_call(group.comms[0], "evaluate")  # type: ignore[arg-type]
    begin_call(group.comms[1], "step")  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    exchange_header(group.comms[0], 0, 2, cpu, [_sig(4)])  # type: ignore[arg-type]
    assert group.keys["pipe/header2"] and len(group.keys["pipe/header2"]) == 16
    with pytest.raises(
        ValueError, match=r"rank 1 is in step\(\) \(its call number 2 .* but rank 0 in evaluate"
    ):
        exchange_header(group.comms[1], 1, 2, cpu, None)  # type: ignore[arg-type]
