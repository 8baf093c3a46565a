"""When a fetch issues each of its gets: a little before the one before it should end, on a second thread.

A fetch gets its values in runs, so that the MAC checks of one run overlap the transfer of the next
(`kvfsm.mooncake.pipeline`). Each get opens with a master round trip before its bytes move; issued only once the
get before it returned, that round trip is time nothing moves, once per run. Issued a little before the previous get
should end, the round trip overlaps that transfer, and the bytes move back to back. Two gets then share the store's
bandwidth for a moment, which costs no throughput: four gets started at once took as long as one get of all their
values (docs/mooncake.md, session 27). Issued too early, the next get shares bandwidth for longer, and the previous
run lands later; its checks then overlap less. So the next get is issued `lead_s` before the previous one's expected
end, from the rate at which this client's gets moved bytes (`GetPace`). On one-H200 hosts a fetch of 128 values of
2 MiB into local memory rose from 0.87 to 0.91 of the zero-copy get to 0.92 to 0.96 (four paired runs at a 3 ms
lead), and the bench read 0.91 to 0.98 each way at the default 8 ms (docs/mooncake.md, session 28).

Threads: `GetLanes.run` runs on the client's I/O thread, which issues each get, hands every run that landed on, and
returns only once every get it issued returned, so no get of a fetch outlives the fetch's call. The gets run on the
client's two get lanes (`kvfsm.mooncake.io_thread.IoThread` each), taken in turn, so at most two are ever in flight.
`GetPace` is written by the I/O thread alone.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable, Sequence, TypeVar

from kvfsm.mooncake.io_thread import IoThread

T = TypeVar("T")


class GetPace:
    """How fast this client's gets move bytes, learnt from the first get of each fetch: it starts while no other get
    of the client is in flight (its master round trip counted in, so the rate errs low and the next get is issued
    late rather than early). Unknown until a fetch's first get returned."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None

    def learn(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bytes_per_s = nbytes / seconds

    def seconds(self, nbytes: int) -> float | None:
        """How long a get of `nbytes` should take, or None while the rate is unknown."""
        return None if self.bytes_per_s is None else nbytes / self.bytes_per_s


class GetLanes:
    """The client's two get lanes, and the pace its gets moved at."""

    def __init__(self, lead_s: float) -> None:
        self.lead_s = lead_s
        self.pace = GetPace()
        self._lanes = [IoThread("kvfsm-mooncake-get") for _ in range(2)]

    def shutdown(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=False)

    def run(self, runs: Sequence[range], sizes: Sequence[int], get: Callable[[range], T],
            landed: Callable[[range, T], None]) -> None:
        """Issue `get(run)` for each run in order, on the lanes in turn, and call `landed(run, answer)` on this
        thread as each returns. A run's get is issued `lead_s` before the previous one should end by the pace (at
        once if that time passed or nothing is in flight), or once the previous one returned while the pace is
        unknown. `sizes[k]` is the bytes run `k` moves. What a get raised is raised here once every get issued
        returned, and no later get is issued after it."""
        pace = self.pace
        issued: dict[Future[tuple[T, float]], int] = {}
        failure: BaseException | None = None

        def settle(timeout_s: float | None) -> None:
            nonlocal failure
            done, _ = wait(issued, timeout=timeout_s, return_when=FIRST_COMPLETED)
            for future in done:
                k = issued.pop(future)
                try:
                    answer, seconds = future.result()
                except BaseException as error:  # noqa: BLE001 - raised once the gets in flight returned
                    failure = failure or error
                    continue
                if k == 0:
                    pace.learn(sizes[0], seconds)
                landed(runs[k], answer)

        def timed(run: range) -> tuple[T, float]:
            start = time.perf_counter()
            answer = get(run)
            return answer, time.perf_counter() - start

        due = expected_end = 0.0
        for k, run in enumerate(runs):
            while issued and failure is None and (pace.bytes_per_s is None or time.perf_counter() < due):
                settle(None if pace.bytes_per_s is None else due - time.perf_counter())
            if failure is not None:
                break
            issued[self._lanes[k % len(self._lanes)].submit(functools.partial(timed, run))] = k
            took = pace.seconds(sizes[k])
            if took is not None:
                expected_end = max(expected_end, time.perf_counter()) + took
                due = expected_end - self.lead_s
        while issued:
            settle(None)
        if failure is not None:
            raise failure
