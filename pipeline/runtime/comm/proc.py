"""Whether a process lives, and the creation watch: a process that ends its parent stuck in NCCL.

This module imports nothing but the standard library, so that it runs as a script of its own,
started in milliseconds (``python -S proc.py``), as the creation watch of arrival.py::

    parent (a rank)                         watch (this file as __main__, no torch)
    ---------------                         ---------------------------------------
    Popen(watch, peers)  ------------------> reads its stdin, polls the peers' pids
    b"arm <what>\\n"  (a creation starts) --> armed
    inside ncclCommSplit, holding the GIL     a peer's pid is gone ... grace ... still armed
    (no thread of the parent can run)         -> one line on stderr -> SIGKILL the parent
    b"disarm\\n" (the creation returned)  --> disarmed
    stdin closed (or the parent died)    --> exits

A thread of the rank itself cannot do this where NCCL's call holds the interpreter's lock (torch's
binding of ``perform_nocolor_split``, which every rank outside a new group runs once the device is
bound, releases no GIL), so the watch is a process.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie that its parent has not reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def _watch(parent: int, rank: int, grace: float, poll: float, peers: list[tuple[int, int]]) -> None:
    """The watch's loop (see the module's docstring); ``peers``: (global rank, pid) on this host."""
    armed: str | None = None  # what the parent is making, while it is inside a creation
    seen: tuple[float, int, int] | None = None  # (when, rank, pid) of the first peer seen gone
    pending = b""
    while process_alive(parent):
        ready, _, _ = select.select([sys.stdin.buffer], [], [], poll)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:  # the parent closed the pipe: its construction is over
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                armed = line[4:].decode() if line.startswith(b"arm ") else None
        if seen is None:
            gone = [(q, pid) for q, pid in peers if not process_alive(pid)]
            if gone:
                seen = (time.monotonic(), *gone[0])
        if armed is not None and seen is not None and time.monotonic() - seen[0] >= grace:
            sys.stderr.write(
                f"stagewise: rank {rank}'s creation watch is ending it (SIGKILL): rank {seen[1]}'s process "
                f"(pid {seen[2]}) is gone while NCCL made {armed}, a call that holds the interpreter and "
                "cannot be aborted\n"
            )
            sys.stderr.flush()
            os.kill(parent, signal.SIGKILL)
            return


if __name__ == "__main__":  # python -S proc.py PARENT RANK GRACE POLL [RANK:PID ...]
    _parent, _rank, _grace, _poll, *_peers = sys.argv[1:]
    _watch(int(_parent), int(_rank), float(_grace), float(_poll),
           [(int(q), int(pid)) for q, pid in (p.split(":") for p in _peers)])  # fmt: skip
