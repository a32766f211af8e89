"""The step header's encoding, the autocast word, the message specs and the send checks."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.comm.p2p import NCCL_DTYPES
from pipeline.runtime.step.metadata import (
    HEADER_LEN,
    autocast_mode,
    check_sendable,
    decode,
    encode,
    encode_words,
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
