"""The failure board: one key in a store that says which rank failed first, and why.

    # r: this rank, q: a peer rank

Every rank of a run watches one key (a mesh's replicas share the world's: a failure anywhere
reaches every rank). The first failure published wins (``compare_set`` on an empty key), so
every rank names the root cause, not the lost connection it saw afterwards:

    rank q raises         -> publish_as(q, "ValueError: ...")    key: "q|ValueError: ..."
    rank r waits for q    -> first() -> (q, "ValueError: ...")   r raises PeerFailure naming q
    rank q is SIGKILLed   -> r finds q's process gone (liveness) and publishes in q's name

The board never raises: a store that is gone (its host died, or the launcher tears the job
down) is noted in ``liveness.store_gone`` and reads as "no failure published"; the transport
(transport.py) turns that into its own error. The transport owns the waits and the transfers;
this module only the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.runtime.comm.watchdog import Liveness, quiet_store

__all__ = ["FailureBoard"]


class FailureBoard:
    """The failure key of a group (``failure``: a (store, key) shared beyond it, or None for
    ``key_prefix/failed`` in ``store``) and its ranks' processes; ``names[q]``: how errors name
    group rank q."""

    def __init__(
        self, store: Any, failure: tuple[Any, str] | None, key_prefix: str, rank: int, names: Sequence[int]
    ) -> None:
        self.store, self.key = failure or (store, f"{key_prefix}/failed")
        self.names = list(names)
        self.liveness = Liveness(store, f"{key_prefix}/proc", rank, len(self.names))
        self.liveness.register()

    def usable(self) -> bool:
        """Whether the store can still be reached (its serving process lives)."""
        return not self.liveness.store_lost()

    def publish_as(self, name: int, message: str) -> None:
        """Record rank ``name``'s failure unless another came first."""
        if self.usable():
            try:
                with quiet_store():
                    self.store.compare_set(self.key, "", f"{name}|{message}")
            except Exception:
                self.liveness.store_gone = True

    def first(self) -> tuple[int, str] | None:
        """(rank, message) of the first failure published, if any."""
        if not self.usable():
            return None
        try:
            with quiet_store():
                if not self.store.check([self.key]):
                    return None
                rank, message = bytes(self.store.get(self.key)).decode().split("|", 1)
        except Exception:
            self.liveness.store_gone = True
            return None
        return int(rank), message

    def learn_peers(self) -> None:
        """Read the peers' processes from the store (once every rank has registered its own)."""
        if not self.liveness.store_gone:
            self.liveness.learn()

    def blame_dead(self) -> tuple[int, str] | None:
        """A peer on this host whose process is gone, published in its name; the first failure
        published, if another came first; None when every known peer lives."""
        if self.usable():
            self.liveness.learn()
        dead = self.liveness.dead()
        if not dead:
            return None
        q = dead[0]
        message = (
            f"rank {self.names[q]}'s process (pid {self.liveness.pids[q]}) is gone: it was killed or "
            "crashed without a Python error (SIGKILL, the OOM killer, a native crash)"
        )
        if q == self.liveness.store_host:
            message += "; the store it served went with it"
        self.publish_as(self.names[q], message)
        return self.first() or (self.names[q], message)
