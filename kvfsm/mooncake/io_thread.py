"""The Mooncake client's I/O thread and the pending answers of the calls it runs.

Mooncake's calls block (on the network, on a master that may be dead or stalled), so none may run on the engine's
thread. This module holds what runs them elsewhere and what the engine polls instead: `IoThread` runs submitted calls
in order on one daemon thread, `CancellableCall` lets a call still queued be dropped before it starts (and never
after), and `Pending` is a call's answer-to-be with its deadline, answering `None` until the call returned or was
cancelled. What a deadline means for the store (refusing calls for a while) is the client's business, not this one's.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class IoThread:
    """One daemon thread running calls in submission order (daemon: a hung call never holds up process exit); an
    `kvfsm.io_executor.IoExecutor`."""

    def __init__(self, name: str = "kvfsm-mooncake-io") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the poller, never lost
                future.set_exception(error)

    def submit(self, fn: Callable[[], T], /) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((fn, future))  # type: ignore[arg-type]
        return future

    def shutdown(self, wait: bool = True) -> None:
        self._calls.put(None)
        if wait:
            self._thread.join()


class CancellableCall(Generic[T]):
    """A submitted call that can be cancelled until it starts, and only then."""

    def __init__(self, fn: Callable[[], T], on_cancelled: Callable[[], T]) -> None:
        self._fn = fn
        self._on_cancelled = on_cancelled
        self._lock = threading.Lock()
        self.started = False
        self.cancelled = False

    def __call__(self) -> T:
        with self._lock:
            self.started = not self.cancelled
        if not self.started:
            return self._on_cancelled()
        return self._fn()

    def cancel(self) -> bool:
        with self._lock:
            if not self.started:
                self.cancelled = True
            return self.cancelled


class Pending(Generic[T]):
    """One call on the I/O executor and its deadline."""

    def __init__(self, future: Future[T], call: CancellableCall[T] | None, deadline: float,
                 on_late: Callable[[], None], timed_out: T) -> None:
        self._future = future
        self._call = call
        self._deadline = deadline
        self._on_late = on_late
        self._timed_out = timed_out
        self._late = False

    @classmethod
    def answered(cls, result: T) -> Pending[T]:
        future: Future[T] = Future()
        future.set_result(result)
        return cls(future, None, 0.0, lambda: None, result)

    @property
    def deadline(self) -> float:
        """When a call still queued is cancelled, and one still running is reported late (it may still touch its
        memory until it returns)."""
        return self._deadline

    @property
    def settled(self) -> bool:
        """The call returned or will never run: the memory it was handed is no longer touched."""
        return self._future.done() or (self._call is not None and self._call.cancelled)

    def poll(self, now: float | None = None) -> T | None:
        """The call's answer once it returned, its timeout answer once it was cancelled, else `None`."""
        if self._call is not None and self._call.cancelled:
            return self._timed_out
        if self._future.done():
            return self._future.result()
        if (time.monotonic() if now is None else now) < self._deadline:
            return None
        if not self._late:
            self._late = True
            self._on_late()
        return self._timed_out if self._call is not None and self._call.cancel() else None

    def wait(self, timeout_s: float) -> T | None:
        """Poll until answered or `timeout_s` passed: for tests, the benchmark and start-up, never an engine step."""
        end = time.monotonic() + timeout_s
        while (answer := self.poll()) is None and time.monotonic() < end:
            try:
                self._future.exception(timeout=min(0.01, max(end - time.monotonic(), 0.0)))
            except TimeoutError:
                pass
        return answer
