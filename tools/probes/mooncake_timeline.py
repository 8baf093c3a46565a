"""Where a Mooncake write-back's and fetch's time goes: the bench's run with every step of the tier's calls timed.

Runs `kvfsm.bench.mooncake.run` with the client's store calls (`batch_*`), its registration check, the start of each
call on the I/O thread, each seal and check of the MAC and each garbage collection timestamped relative to the
`write_back` / `fetch` call that caused it (instrumented by wrapping, so the code measured is the library's own),
then prints the bench's shares and, per kind of call, the median start and end of each step over the repetitions
after the first two (in ms), in the order the steps start.

Usage (where Mooncake is installed; a GPU host for figures worth quoting):
`python tools/probes/mooncake_timeline.py [own|"segment host"]`, with `QUICK=1` for the bench's quick size and
`T=<n>` for the client's MAC threads (default 8).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Callable

import kvfsm.bench.mooncake as bench
from kvfsm.mooncake import io_thread
from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.value import ValueMac

events: list[tuple[int, str, float, float]] = []
"""(call index, step, start, end), times relative to the call."""
calls: list[str] = []
current: dict[str, Any] = {"call": None, "t0": 0.0}
lock = threading.Lock()


def record(step: str, start: float, end: float) -> None:
    with lock:
        if current["call"] is not None:
            events.append((current["call"], step, start - current["t0"], end - current["t0"]))


class TimedStore:
    """The client's store, each batch call timed."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not name.startswith("batch"):
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            answer = attribute(*args, **kwargs)
            record(f"{name}[{len(args[0])}]", start, time.perf_counter())
            return answer

        return timed


def timing(step: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        answer = function(*args, **kwargs)
        record(step, start, time.perf_counter())
        return answer

    return timed


def instrument() -> None:
    connect = MooncakeClient.connect

    def connected(self: MooncakeClient) -> None:
        connect(self)
        self._store = TimedStore(self._store)

    MooncakeClient.connect = connected  # type: ignore[method-assign]
    ValueMac.seal = timing("MAC", ValueMac.seal)  # type: ignore[method-assign]
    ValueMac.check = timing("MAC", ValueMac.check)  # type: ignore[method-assign]
    MooncakeClient._ensure_registered = timing("registered", MooncakeClient._ensure_registered)  # type: ignore
    call = io_thread.CancellableCall.__call__

    def called(self: io_thread.CancellableCall[Any]) -> Any:
        now = time.perf_counter()
        record("io-call-start", now, now)
        return call(self)

    io_thread.CancellableCall.__call__ = called  # type: ignore[method-assign]
    started: dict[str, float] = {}

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            record(f"GC gen{info['generation']}", started.get("t", time.perf_counter()), time.perf_counter())

    gc.callbacks.append(collected)
    for kind in ("write_back", "fetch"):
        original = getattr(MooncakeClient, kind)

        def traced(self: MooncakeClient, *args: Any, _original: Any = original, _kind: str = kind,
                   **kwargs: Any) -> Any:
            calls.append(_kind)
            current["call"], current["t0"] = len(calls) - 1, time.perf_counter()
            pending = _original(self, *args, **kwargs)
            wait = pending.wait

            def answered(timeout_s: float) -> Any:
                answer = wait(timeout_s)
                record("answer", current["t0"], time.perf_counter())
                current["call"] = None
                return answer

            pending.wait = answered
            return pending

        setattr(MooncakeClient, kind, traced)


def report(segment: str) -> None:
    steps: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
    for call, step, start, end in events:
        steps[call].append((step, start, end))
    for kind in ("write_back", "fetch"):
        runs = [steps[i] for i, k in enumerate(calls) if k == kind and steps[i]]
        runs = runs[2:] if len(runs) > 4 else runs  # the first two warm the caches
        rows: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for run in runs:
            seen: dict[str, int] = defaultdict(int)
            macs = [(s, e) for step, s, e in run if step == "MAC"]
            for step, start, end in run:
                if step != "MAC":
                    seen[step] += 1
                    rows[f"{step}#{seen[step]}"][0].append(start)
                    rows[f"{step}#{seen[step]}"][1].append(end)
            if macs:
                for name, pick in (("MAC first", min), ("MAC last", max)):
                    rows[name][0].append(pick(s for s, _ in macs))
                    rows[name][1].append(pick(e for _, e in macs))
        print(f"{segment} {kind}: median start / end (ms) over {len(runs)} repetitions")
        for name, (starts, ends) in sorted(rows.items(), key=lambda row: statistics.median(row[1][0])):
            print(f"  {name:36s} {statistics.median(starts) * 1e3:7.2f} {statistics.median(ends) * 1e3:7.2f}")


if __name__ == "__main__":
    segment = sys.argv[1] if len(sys.argv) > 1 else "own"
    instrument()
    result = bench.run(os.environ.get("QUICK") == "1", segment=segment, hash_threads=int(os.environ.get("T", "8")))
    print(f"{segment}: write-back {result['write_back_share_of_zero_copy']:.2f}, fetch "
          f"{result['fetch_share_of_zero_copy']:.2f} of the zero-copy calls; GB/s",
          {name: round(gbps, 2) for name, gbps in result["gbps"].items()})
    report(segment)
