"""Issue 46, cold planning: the fast paths a cold refusal takes give what the slow ones give.

- ``_late_receives`` answers most receives directly (one rank's order, or ranks that only Z's own
  rank joins) where the topological pass answered all: the same set, for every registered schedule
  over many (p, v, m) and for random compute orders, deadlocking ones included.
- ``_fit._reach`` skips its float steps when its first guess is exact: its answer is the definition's.
- ``_inputs._prefix_rows`` (``check_fit``'s sums, at numpy speed) is ``_prefix`` of each row, and
  names a bad row as ``_check_memory`` does.
- The exact smallest limit of a refusal at the static floor (n = 1000, p = 64, 1f1b, m = 64: the
  issue's case) is the number the slow paths give, bit for bit, and the number before this work.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch import nn

from partitioner import Profile, partition
from partitioner._inputs import _check_memory, _prefix, _prefix_rows
from partitioner._planning import _COEFS
from pipeline.schedules import program
from pipeline.schedules.actions import Action, Kind
from pipeline.schedules.registry import REGISTRY
from pipeline.schedules.schedule import Schedule, schedule_options, unchecked

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_partition as bench

fit_module = sys.modules["partitioner._fit"]
options_module = sys.modules["partitioner._options"]


def _cases() -> list[Schedule]:
    out = []
    for name, e in REGISTRY.items():
        for p in (1, 2, 3, 4, 5, 8):
            for v in [1] if e.max_virtual == 1 else [2, 3] if e.max_virtual is None else [2]:
                for m in (1, 2, 3, 4, 5, 7, 8, 12, 16):
                    try:
                        schedule_options(name, p, m, v)
                    except ValueError:
                        continue
                    out.append(unchecked(name, p, m, v))
    return out


def test_late_receives_answered_directly_are_the_passs() -> None:
    late = 0
    cases = _cases()
    for sched in cases:
        lowered = sched.lowered()
        fast = program._late_receives(sched, lowered)
        assert fast == program._late_receives(sched, lowered, direct=False), sched.name
        late += len(fast)
    assert len(cases) > 400 and late > 1000  # not vacuous: many receives are late


def _random_orders(rng: random.Random, p: int, v: int, m: int, placement: str) -> Schedule:
    """Each rank's F and B of its stages in a random order that keeps F before B: many deadlock."""
    k = p * v
    base = unchecked("1f1b" if v == 1 else "interleaved-1f1b" if placement == "loop" else "zb-v", p, m, v)
    compute = []
    for r in range(p):
        fs = [Action(s, Kind.F, i) for s in base.stages_of(r) for i in range(m)]
        rng.shuffle(fs)
        order: list[Action] = []
        pending: list[Action] = []
        for a in fs:
            order.append(a)
            pending.append(Action(a.stage, Kind.B, a.microbatch))
            while pending and rng.random() < 0.5:
                order.append(pending.pop(rng.randrange(len(pending))))
        rng.shuffle(pending)
        compute.append(tuple(order + pending))
    return Schedule("random", k, p, m, False, tuple(compute), placement)


def test_late_receives_of_random_orders_deadlocks_included_are_the_passs() -> None:
    rng = random.Random(0)
    late = stuck = 0
    for trial in range(300):
        v, placement = rng.choice([(1, "loop"), (2, "loop"), (2, "v")])
        p = rng.randint(2, 4)
        sched = _random_orders(rng, p, v, rng.randint(1, 4), placement)
        lowered = sched.lowered()
        fast = program._late_receives(sched, lowered)
        assert fast == program._late_receives(sched, lowered, direct=False), (trial, sched.to_text())
        late += len(fast)
        played = program.play(sched.programs())
        stuck += bool(played.stuck(sched.programs()))
    assert late > 50 and stuck > 50  # late receives and deadlocks both met


def _reach_by_definition(row: np.ndarray, limit: float) -> np.ndarray:
    """R[a]: the last b >= a with row[b] - row[a] <= limit (a - 1 when none): every pair compared."""
    at = np.arange(len(row))
    ok = (row[None, :] - row[:, None] <= limit) & (at[None, :] >= at[:, None])
    out: np.ndarray = np.maximum(np.where(ok, at[None, :], -1).max(axis=1), at - 1)
    return out


def test_reach_without_its_steps_is_the_definitions() -> None:
    rng = random.Random(1)
    for _ in range(400):
        n = rng.randint(1, 12)
        values = [rng.choice([0.0, 0.1, 0.2, 0.3, 1e-17, 1.0, 3.0, rng.random()]) for _ in range(n)]
        row = np.asarray(_prefix(values))
        a, b = sorted(rng.randrange(n + 1) for _ in range(2))
        # a difference of two sums: row[a] + it may round below row[b], which the float steps mend
        exact = float(row[b] - row[a])
        for limit in (0.0, 0.1, 0.3, 0.30000000000000004, rng.random() * 2, 1e-17, -1.0, exact):
            assert fit_module._reach(row, limit).tolist() == _reach_by_definition(row, limit).tolist(), (
                values,
                limit,
            )


def _draw(rng: random.Random, kind: str) -> float:
    if kind == "bytes":
        return float(rng.randint(0, 10**9))
    return float(rng.randint(0, 2**52)) if kind == "near 2**53" else rng.random() * 1e6


def test_prefix_rows_are_prefix_of_each_row_and_bad_rows_are_named() -> None:
    rng = random.Random(2)
    for _ in range(200):
        k, n = rng.randint(1, 5), rng.randint(1, 40)
        kind = rng.choice(["bytes", "near 2**53", "fractions"])
        rows = [[_draw(rng, kind) for _ in range(n)] for _ in range(k)]
        assert [row.tolist() for row in _prefix_rows(rows, k)] == [_prefix(row) for row in rows], kind
    for bad in ([[1.0, -1.0]], [[1.0, math.nan]], [[1.0, math.inf]], [[1e308, 1e308]], [[1.0], [1.0, 2.0]]):
        with pytest.raises(ValueError) as info:
            _prefix_rows(bad, len(bad))
        with pytest.raises(ValueError) as slow:
            _check_memory(bad, 0.0, len(bad[0]), len(bad))
        assert str(info.value) == str(slow.value)


def _issue_case() -> tuple[Profile, nn.Sequential, dict[str, Any]]:
    """``scripts/bench_partition.py``'s profile (Part 3 and 6): n = 1000 random layers."""
    prof, model = bench.headline_profile(random.Random(0))  # as its planning child builds it
    return prof, model, {"bandwidth": 5e10, "latency": 1e-5}


def _smallest_named(prof: Profile, model: nn.Sequential, opts: dict[str, Any], limit: float) -> str:
    _COEFS.clear()  # every call walks its own programs
    with pytest.raises(ValueError) as info:
        partition(model, 64, None, memory_limit=limit, profile=prof, **opts)
    text = str(info.value)
    assert "the smallest limit that fits is " in text, text
    return text.split("the smallest limit that fits is ")[1].split(";")[0]


def test_the_cold_refusals_smallest_limit_is_the_slow_paths_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prof, model, opts = _issue_case()
    at_floor = 570963280.0  # the static floor the refusal below it names (``bench_partition --planning``)
    fast = _smallest_named(prof, model, opts, at_floor)
    assert fast == "2460507933.0"  # what it named before this work (issue 46's BENCHMARKS line)
    late = program._late_receives
    monkeypatch.setattr(program, "_late_receives", lambda sched, lowered: late(sched, lowered, direct=False))

    monkeypatch.setattr(fit_module, "_reach", _reach_by_definition)  # every pair compared, no shortcut

    def slow_sums(rows: list[list[float]], k: int) -> list[np.ndarray]:
        sums, _ = _check_memory(rows, 0.0, len(rows[0]), k)
        assert sums is not None
        return [np.asarray(row) for row in sums]

    monkeypatch.setattr(options_module, "_prefix_rows", slow_sums)
    assert _smallest_named(prof, model, opts, at_floor) == fast


# ---- the cold refusal's derivation and walk, made cheaper (issue 46, evening): outputs unchanged

_MODES = ("never", "except_last", "always")


def _outputs_digest() -> tuple[str, int]:
    """A digest of every registered schedule's programs (dp 1 and 2, with and without ties),
    coefficients (each mode, and a per-stage mix) and rank peaks (random figures with views and kept
    input gradients; and per micro-batch figures) at p = 1..6, several v and m: (hex, outputs)."""
    from pipeline.schedules.peaks import PARTS, StageBytes, coefficients, rank_peaks

    rng = random.Random(46)
    digest, count = hashlib.sha256(), 0

    def add(value: object) -> None:
        nonlocal count
        digest.update(repr(value).encode())
        count += 1

    for name, e in REGISTRY.items():
        for p in range(1, 7):
            for v in [1] if e.max_virtual == 1 else [2, 3] if e.max_virtual is None else [2]:
                for m in (1, 2, 3, 5, 8):
                    try:
                        schedule_options(name, p, m, v)
                    except ValueError:
                        continue
                    sched = unchecked(name, p, m, v)
                    k = sched.n_stages
                    add((name, p, v, m))
                    for dp in (1, 2):
                        for ties in ((), ((0, k - 1), (1 % k, 0))):
                            add([prog.instructions for prog in sched.programs(dp=dp, ties=ties)])
                    mixed = [rng.choice(_MODES) for _ in range(k)]
                    for modes in (*_MODES, mixed):
                        add(coefficients(sched, modes))
                        stages = [
                            StageBytes(
                                **{f: float(rng.randint(0, 1000)) for f in PARTS},
                                static=float(rng.randint(0, 10**6)),
                                kept=float(rng.randint(0, 100)),
                                input_grad_kept=rng.random() < 0.4,
                                output_is_input=rng.random() < 0.3,
                            )
                            for _ in range(k)
                        ]
                        add(rank_peaks(sched, stages, modes))
                        own = [
                            {f: [float(rng.randint(0, 1000)) for _ in range(m)] for f in PARTS}
                            for _ in range(k)
                        ]
                        add(rank_peaks(sched, stages, modes, own))
    return digest.hexdigest(), count


# what the tree before the evening's work (2c5b904) gives: a rule of memory or of the programs that
# changes on purpose changes this (and the BENCHMARKS figure of the plans it moves), nothing else may
_BEFORE = ("be604fd4cb894d3efac89f2c5c53a2c09e12c6d91d11032bcdaafd43b62d169c", 4250)


def test_programs_coefficients_and_rank_peaks_are_the_ones_before_bit_for_bit() -> None:
    got = _outputs_digest()
    assert got == _BEFORE, (
        f"the programs, coefficients or rank peaks changed (digest {got}, was {_BEFORE}): a speed-up must "
        "change none of them; a rule changed on purpose sets _BEFORE to the new digest"
    )


def test_the_walk_asks_weigh_per_stage_what_it_asks_per_tensor() -> None:
    """``walk(by_stage=True)`` (coefficients', and rank peaks' of one figure per stage) gives what
    asking ``weigh`` for every tensor gives, and asks it once per (kind, stage)."""
    from pipeline.schedules.peaks import walk

    rng = random.Random(3)
    for sched in _cases()[::7]:
        k, width = sched.n_stages, 4
        modes = [rng.choice(_MODES) for _ in range(k)]
        gin_kept = [rng.random() < 0.5 for _ in range(k)]
        views = [rng.random() < 0.3 for _ in range(k)]
        figure = {
            (kind, s): (rng.randrange(width), float(rng.randint(1, 99))) for kind in _KINDS for s in range(k)
        }
        for r in range(sched.n_ranks):
            asked: list[tuple[str, int, int]] = []

            def weigh(
                key: tuple[str, int, int],
                asked: list[tuple[str, int, int]] = asked,
                table: dict[tuple[str, int], tuple[int, float]] = figure,
            ) -> tuple[int, float]:
                asked.append(key)
                return table[key[:2]]

            each = walk(sched, r, weigh, width, modes, gin_kept, views)
            per_tensor = len(asked)
            asked.clear()
            assert walk(sched, r, weigh, width, modes, gin_kept, views, by_stage=True) == each, sched.name
            assert len({key[:2] for key in asked}) == len(asked) <= per_tensor, sched.name


_KINDS = ("in", "gin", "out", "gout", "new", "set", "chain", "grads", "kept", "tf", "tfr", "tb", "tbi", "tw")


def test_post_wait_and_free_are_frozen_dataclasses_as_before() -> None:
    """Their own __init__ (the slots' setters): built by position or keyword, equal and hashed by
    their fields, frozen, printed, copied and pickled as the generated one made them."""
    import copy
    import dataclasses
    import pickle

    send, recv = Action(0, Kind.SEND_F, 1), Action(0, Kind.RECV_B, 0)
    post = program.Post((send,), (recv,))
    assert post == program.Post(sends=(send,), recvs=(recv,)) and hash(post) == hash(
        program.Post((send,), (recv,))
    )
    assert post != program.Post((send,), ()) and program.Wait(recv) == program.Wait(recv=recv)
    assert program.Free((send,)) == program.Free(sends=(send,)) != program.Post((send,), ())
    assert repr(post) == "Post(sends=(Action('0SEND_F1'),), recvs=(Action('0RECV_B0'),))"
    assert str(post) == "post 0SEND_F1 0RECV_B0" and str(program.Wait(recv)) == "wait 0RECV_B0"
    for x in (post, program.Wait(recv), program.Free((send,))):
        assert pickle.loads(pickle.dumps(x)) == x == copy.deepcopy(x) == dataclasses.replace(x)
        assert not hasattr(x, "__dict__")  # slotted
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(x, dataclasses.fields(x)[0].name, ())


def test_the_coefficients_cache_drops_the_least_recently_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # a search past the cache's size keeps the schedules it asks again (it once cleared them all)
    import partitioner._planning as planning

    monkeypatch.setattr(planning, "COEFS_SIZE", 3)
    walked: list[int] = []
    real = planning.coefficients

    def counted(sched: Schedule, modes: Any) -> Any:
        walked.append(sched.n_microbatches)
        return real(sched, modes)

    monkeypatch.setattr(planning, "coefficients", counted)
    _COEFS.clear()
    scheds = {m: unchecked("1f1b", 2, m, 1) for m in (1, 2, 3, 4)}
    modes = ("never", "never")
    for m in (1, 2, 3, 1, 4, 1, 3):  # 4 past the size drops 2, the least recently asked
        assert planning._coefficients(scheds[m], modes) == real(scheds[m], modes)
    assert walked == [1, 2, 3, 4]
    planning._coefficients(scheds[2], modes)  # dropped: walked again
    assert walked == [1, 2, 3, 4, 2]
    _COEFS.clear()
