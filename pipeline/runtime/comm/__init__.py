"""Ranks talking: everything that crosses a process boundary, and its failures.

``p2p.Comm`` is the one object the rest holds per group; behind it ``transport`` (gloo, NCCL or
the strict NCCL ``emulation``: posting, ordering on a ``stream``, waits with a timeout),
``channels`` (NCCL's two-rank lanes), ``collectives``, ``board`` (the failure key), ``watchdog``
(timeouts, liveness of peers), ``arrival`` (every rank present before NCCL makes a communicator),
``proc``, ``agree`` (ranks agreeing on a configuration) and ``world`` (the world group's
communicator and pairs, made at construction for checkpoints) and ``state`` (modules' tensors as one
flat tensor per kind, for a broadcast). Imports no other room.
"""
