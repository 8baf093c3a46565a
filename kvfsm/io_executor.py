"""Where blocking I/O runs: the one executor shape every lower tier and the Mooncake client accept.

A tier's reads and writes (a disk's `pwrite`, a Mooncake call that waits on the network) must never run on the
engine's thread, so each is handed to an executor and polled through its `Future`. Production passes threads (a
`concurrent.futures.ThreadPoolExecutor`, or the Mooncake client's own `IoThread`); tests pass a queue they run by
hand (`kvfsm.tiers.io.ManualIo`), so generated interleavings choose when each call happens. The protocol sits in
the bottom layer so the Mooncake client (below the tiers) and the tiers name the same one.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class IoExecutor(Protocol):
    """Runs each submitted call once, off the caller's thread (or when a test says), settling its future."""

    def submit(self, fn: Callable[[], T], /) -> Future[T]: ...

    def shutdown(self, wait: bool = True) -> None:
        """Take no more calls; with `wait`, return once every call submitted before returned."""
