"""Executors for a tier's blocking I/O (`kvfsm.io_executor.IoExecutor`): threads in production, a queue the test
chooses from in tests. `ManualIo` runs an operation on whichever thread calls `run_one`, `run_all` or `shutdown`."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def io_threads(count: int, tier: str) -> ThreadPoolExecutor:
    """The production executor: `count` threads named after the tier (file I/O and CRC release the GIL)."""
    return ThreadPoolExecutor(max_workers=count, thread_name_prefix=f"kvfsm-{tier}-io")


class ManualIo:
    """Queues each submitted operation until the test runs it, in the order the test chooses.

    Generated interleavings and the explorer use it to decide when a write lands or a read returns relative to
    engine steps, device streams and the tier's own eviction, exactly as they decide device operations.
    """

    def __init__(self) -> None:
        self.queue: list[tuple[Future, Callable[[], object]]] = []
        self.numbers: list[int] = []
        """The submission number of each queued operation (0 for the first ever submitted), in queue order: which
        operations are still pending, not just how many (an operation may submit another as it runs)."""
        self._submitted = 0

    def submit(self, fn: Callable[[], T], /) -> Future[T]:
        future: Future[T] = Future()
        self.queue.append((future, fn))  # type: ignore[arg-type]
        self.numbers.append(self._submitted)
        self._submitted += 1
        return future

    def run_one(self, index: int = 0) -> None:
        """Run the `index`-th queued operation (oldest first), settling its future with its result or error."""
        future, fn = self.queue.pop(index)
        self.numbers.pop(index)
        try:
            future.set_result(fn())
        except BaseException as error:  # an I/O error is the operation's outcome, delivered through its future
            future.set_exception(error)

    def run_all(self) -> None:
        while self.queue:
            self.run_one()

    def shutdown(self, wait: bool = True) -> None:
        if wait:
            self.run_all()
