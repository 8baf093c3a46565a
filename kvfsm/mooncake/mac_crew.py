"""The Mooncake client's MAC threads, and the crew of them one call's seals or checks run on.

Every byte a client moves is sealed or checked on its MAC threads while the I/O thread moves bytes
(`kvfsm.mooncake.client`). A call hands them its values as they become ready (all at once for a write-back's seals,
run by run as a fetch's gets land), and the time between a value becoming ready and a MAC thread starting on it is
time the call may wait at its end. So a call does not submit one task per value (each a future, a work item and
a wake-up, made on the I/O thread between two store calls): it starts one long task per MAC thread (`Crew`), and
each takes the next value from one queue, so a value handed over costs the I/O thread one queue put, and a thread
that finishes early takes more values instead of idling while another works through a fixed share.

Threads: a `Crew` is made, fed and closed on the I/O thread; its tasks run on the MAC threads and only pull from its
queue and write their own results. `MacThreads` runs nothing else, and since the I/O thread runs one call at a
time, at most one crew and the task that publishes its seals (`MacThreads.submit`) hold its threads.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


class MacThreads:
    """The client's MAC threads (`count` of them, named for kvfsm)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool = ThreadPoolExecutor(count, thread_name_prefix="kvfsm-mooncake-mac")

    def crew(self, work: Callable[[int], T]) -> Crew[T]:
        """A crew of every MAC thread running `work` on each value index handed to it."""
        return Crew(self._pool, self.count, work)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """One task on a MAC thread, after every crew task submitted before it started."""
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


class Crew(Generic[T]):
    """One task per MAC thread, each running `work` on the next value index handed over until the crew is closed.

    Used as a context manager: leaving closes the crew and waits for its tasks, however the call ends, so a call's
    answer means no MAC thread still reads its memory (a crew never closed would keep its threads waiting)."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int, work: Callable[[int], T]) -> None:
        self._work = work
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.tasks = [pool.submit(self._drain) for _ in range(threads)]

    def _drain(self) -> dict[int, T]:
        done: dict[int, T] = {}
        while (index := self._queue.get()) is not None:
            done[index] = self._work(index)
        return done

    def hand(self, indices: Iterable[int]) -> None:
        """Values ready for the MAC threads."""
        for index in indices:
            self._queue.put(index)

    def close(self) -> None:
        """No more values: each task ends once the queue is empty (closing again leaves markers nothing reads)."""
        for _ in self.tasks:
            self._queue.put(None)

    def join(self) -> dict[int, T]:
        """Close the crew, work through what is still queued on the calling thread beside the MAC threads, and answer
        `results`. A caller that would otherwise only wait (a fetch's I/O thread once its last get returned) starts
        on the last values at once, instead of leaving them to MAC threads that wake one after another."""
        self.close()
        self._queue.put(None)  # the caller's own end marker, behind every task's
        mine = self._drain()
        return self.results() | mine

    def results(self) -> dict[int, T]:
        """Per value handed over, what `work` answered (once the crew is closed); re-raises what `work` raised."""
        done: dict[int, T] = {}
        for task in self.tasks:
            done.update(task.result())
        return done

    def __enter__(self) -> Crew[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
        wait(self.tasks)
