"""How a batch is cut into Mooncake calls so that the MAC pass hides behind the transfer.

Every value is sealed (write-back) or checked (fetch) with the tenant's MAC, a pass over every byte on the client's
MAC threads, while the I/O thread moves bytes. Measured on an engine host (32 cores, Mooncake 0.3.13, 2 MiB values,
docs/mooncake.md): one core MACs about 3.6 GB/s and threads scale it (8: 24 GB/s), a batch call moves 2.8 GB/s over
TCP and 5 GB/s into local memory, and an extra call costs little (a master round trip, well under a millisecond).
So what the MAC pass adds to a batch is what the transfer cannot overlap: on a write-back the wait for the first
values' seals, on a fetch the checks of the last values read. Both are cut to one round of the MAC threads (one value
each, or `pipeline_bytes` if that is more), and what lies between overlaps:

- a write-back puts as soon as one round is sealed, and each put carries every value sealed by the time it starts
  (`sealed_run`): fast MAC threads leave two or three puts per batch, slow ones more, smaller puts that keep pace;
- a fetch gets the batch in runs that shrink toward its end (`fetch_runs`), the last one round long, so the checks
  of each run hide behind the get of the next and only the last round's checks are left.

Threads: these helpers run on the client's I/O thread; `sealed_run` only waits on futures of the MAC threads.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Sequence

HASH_THREADS_RANGE = (2, 8)
"""Bounds of the default MAC threads (half the cores this process may run on): at least two, so one value seals
while another is checked; beyond 8 the MAC rate exceeds the store's transfer rate several times over, and more
threads would only take cores from the engine and its other ranks' clients when all transfer at once."""
CHECK_OVER_GET = 2
"""How much longer one MAC thread takes to check a value than the store takes to get it, at worst (measured: 1.5
into local memory, 0.8 over TCP): a fetch's runs shrink by the MAC threads over this, so that the checks of each run
end before the get of the next, smaller run does."""


def default_hash_threads(cores: int | None = None) -> int:
    """MAC threads for a client that was not told how many: half of `cores` (by default the cores this process may
    run on), within `HASH_THREADS_RANGE`."""
    if cores is None:  # the cores this process may run on (where the platform says), else every core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    low, high = HASH_THREADS_RANGE
    return max(low, min(high, cores // 2))


def round_values(sizes: Sequence[int], hash_threads: int, pipeline_bytes: int) -> int:
    """The fewest values of a batch (of values `sizes` bytes long) one put or get carries, unless fewer are left: one
    per MAC thread (a round of them), and at least `pipeline_bytes`, so that a batch of small values is not cut into
    many calls that each cost the master a round trip."""
    total = max(sum(sizes), 1)
    return max(hash_threads, -(-pipeline_bytes * len(sizes) // total), 1)


def sealed_run(sealed: Sequence[Future[int]], start: int, least: int) -> range:
    """The values the next put of a write-back carries: from `start`, once the next `least` values (or those left)
    are sealed, every value sealed without a gap. Waits on the MAC threads; a failed seal ends a run before it and
    raises here as the next run's first, so no put carries its value."""
    first = min(start + least, len(sealed))
    for future in sealed[start:first]:
        future.result()
    end = first
    while end < len(sealed) and sealed[end].done() and sealed[end].exception() is None:
        end += 1
    return range(start, end)


def fetch_runs(count: int, last: int, hash_threads: int) -> list[range]:
    """`count` values cut into runs for a fetch's gets: the last `last` values long, each earlier one
    `hash_threads // CHECK_OVER_GET` times the next (at least as long); what is left before the first run joins it
    when shorter than that ratio's share of it (an extra get for a few values costs more than their checks)."""
    shrink = max(1, hash_threads // CHECK_OVER_GET)
    sizes: list[int] = []
    left, size = count, max(last, 1)
    while left:
        take = left if left - size < size // shrink else size
        sizes.append(take)
        left, size = left - take, size * shrink
    runs, start = [], 0
    for size in reversed(sizes):
        runs.append(range(start, start + size))
        start += size
    return runs
