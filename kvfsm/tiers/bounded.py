"""A blocking call waited for at most a bound: how a lookup asks a slow store without stalling the scheduling step.

A lookup runs on the engine's scheduling step, which must never wait on a slow or hung store for longer than a
configured bound (#40): past it, the lookup is a miss. So the call (a disk's `stat`s, say) runs on a thread of its
own and the caller waits at most `timeout_s` for its answer. A late call answers None; while it still runs no other
call is started (it would only queue behind the hung one), so every caller meanwhile gets None at once. Its answer,
when it finally comes, is dropped: the next call asks again.

Threads: `__call__` and `close` run on the caller's thread (the scheduler's); the calls on this object's daemon
thread (`kvfsm.mooncake.io_thread.IoThread`: a call hung for good never holds up the process's exit).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, wait
from typing import Any, Callable, TypeVar

from kvfsm.mooncake.io_thread import IoThread

log = logging.getLogger(__name__)

T = TypeVar("T")


class BoundedCall:
    """Runs one call at a time on its own thread; the caller waits for each at most `timeout_s`."""

    def __init__(self, name: str, timeout_s: float) -> None:
        """`name`: what the calls ask (`disk tier 'disk' lookup`), for the log and the thread's name."""
        self.name = name
        self.timeout_s = timeout_s
        self._thread = IoThread(f"kvfsm-{name}")
        self._running: Future[Any] | None = None

    def __call__(self, fn: Callable[[], T]) -> T | None:
        """`fn()`'s answer if it returned within the bound; None if it did not, or if an earlier call still runs."""
        if self._running is not None and not self._running.done():
            return None
        self._running = future = self._thread.submit(fn)
        if not wait((future,), timeout=self.timeout_s).done:
            log.warning("%s got no answer within %ss; counted as a miss", self.name, self.timeout_s)
            return None
        return future.result()

    def close(self) -> None:
        """Take no more calls; a call still running (hung) keeps only its daemon thread."""
        self._thread.shutdown(wait=False)
