"""Actions: the atoms of a schedule, and their compact text form.

    # s: stage, i: micro-batch, r: rank, p: ranks

An action is one thing one rank does for one micro-batch on one of its stages.
Its text form is ``{stage}{kind}{microbatch}``::

    2F0        forward of micro-batch 0 on stage 2
    0B3        backward (the whole backward, or only the input-gradient part
               when the schedule splits it) of micro-batch 3 on stage 0
    1W5        weight-gradient part of micro-batch 5's backward on stage 1
    1SEND_F2   stage 1 sends micro-batch 2's activation to stage 2
    2RECV_F2   stage 2 receives micro-batch 2's activation from stage 1
    2SEND_B2   stage 2 sends micro-batch 2's input gradient to stage 1
    1RECV_B2   stage 1 receives micro-batch 2's gradient from stage 2

Communication actions name the stage that runs them; the peer stage follows
from the kind (activations flow s -> s+1, gradients s -> s-1), so an action
needs no extra fields. Stage s lives on rank ``Schedule.rank_of(s)`` (s % p, or the V of zb-v).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Action", "Kind", "format_action", "parse_action"]


class Kind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # members are singletons, equal only to themselves: identity hashes them (Enum's own hashes the
    # name in Python, and planning hashes millions of actions)
    __hash__ = object.__hash__

    def __init__(self, value: str) -> None:
        # plain attributes, not properties: planning asks them millions of times
        self.is_compute: bool = value in ("F", "B", "W")
        self.is_send: bool = value in ("SEND_F", "SEND_B")
        self.is_recv: bool = value in ("RECV_F", "RECV_B")


@dataclass(frozen=True, order=True, init=False)
class Action:
    stage: int
    kind: Kind
    microbatch: int

    def __init__(self, stage: int, kind: Kind, microbatch: int) -> None:
        # the instance dict written directly, not a frozen field's setattr each: planning makes tens
        # of thousands; and hashed once: planning keys dicts by millions of actions
        d = self.__dict__
        d["stage"], d["kind"], d["microbatch"] = stage, kind, microbatch
        d["_hash"] = hash((stage, kind, microbatch))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __reduce__(self) -> tuple[type[Action], tuple[int, Kind, int]]:
        return (Action, (self.stage, self.kind, self.microbatch))  # the hash is this process's own

    def __str__(self) -> str:
        return format_action(self)

    def __repr__(self) -> str:
        return f"Action({format_action(self)!r})"

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a send or receive."""
        if self.kind in (Kind.SEND_F, Kind.RECV_B):
            return self.stage + 1
        if self.kind in (Kind.SEND_B, Kind.RECV_F):
            return self.stage - 1
        raise ValueError(f"{self} is a compute action; only send and receive actions have a peer")

    @property
    def needs(self) -> tuple[Action, ...]:
        """The compute actions whose results this compute action takes: F(s, i) the forward of
        stage s - 1, B(s, i) its own forward and the backward of stage s + 1, W(s, i) its B (the
        stages past either end do not exist: a caller looks up only what its schedule holds)."""
        s, i = self.stage, self.microbatch
        if self.kind is Kind.F:
            return (Action(s - 1, Kind.F, i),)
        if self.kind is Kind.B:
            return (Action(s, Kind.F, i), Action(s + 1, Kind.B, i))
        if self.kind is Kind.W:
            return (Action(s, Kind.B, i),)
        raise ValueError(f"{self} is a send or receive; only compute actions need others' results")


# Longest kinds first so that "SEND_F" is not read as "S" + ...
_KINDS = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS})(\d+)$")


def format_action(action: Action) -> str:
    return f"{action.stage}{action.kind.value}{action.microbatch}"


def parse_action(text: str) -> Action:
    match = _ACTION_RE.match(text.strip())
    if match is None:
        kinds = ", ".join(k.value for k in Kind)
        raise ValueError(
            f"cannot parse action {text!r}: expected '{{stage}}{{kind}}{{microbatch}}' "
            f"such as '2F0' or '0SEND_B3', with kind one of {kinds}"
        )
    stage, kind, microbatch = match.groups()
    return Action(int(stage), Kind(kind), int(microbatch))
