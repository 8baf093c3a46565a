"""How a fetch is cut into Mooncake calls so that the MAC checks hide behind the transfer.

Every value is checked with the tenant's MAC on a fetch, a pass over every byte on the client's MAC threads, while
the I/O thread moves bytes. Measured on an engine host (32 cores, Mooncake 0.3.13, 2 MiB values, docs/mooncake.md):
a batch call moves 2.8 GB/s over TCP and 5 GB/s into local memory, and an extra call costs little (a master round
trip, well under a millisecond). A fetch's checks can start only once a get brought their values, so what the MAC
adds to a fetch is the checks of the last values read. A fetch therefore gets the batch in runs that shrink toward
its end (`fetch_runs`), the last one round of the MAC threads long (one value each, or `pipeline_bytes` if that is
more), so the checks of each run hide behind the get of the next and only the last round's checks are left.
(A write-back needs no cut: its payloads go in one put while the MAC threads seal, and the sealed trailers in a
second, small put after it: `kvfsm.mooncake.client`.)

Threads: these helpers run on the client's I/O thread.
"""

from __future__ import annotations

import os
from typing import Sequence

HASH_THREADS_RANGE = (2, 8)
"""Bounds of the default MAC threads (half the cores this process may run on): at least two, so one value seals
while another is checked; beyond 8 the MAC rate exceeds the store's transfer rate several times over, and more
threads would only take cores from the engine and its other ranks' clients when all transfer at once."""
CHECK_OVER_GET = 4
"""How much longer one MAC thread takes to check a value than the store takes to get it, at worst: a fetch's runs
shrink by the MAC threads over this, so that the checks of each run end before the get of the next, smaller run
does. Measured on a one-H200 host (16 cores, 2 MiB values, eight MAC threads beside a get into local memory): a
thread checks 1.75 GB/s while the get moves 5.8, 3.3 times over (over TCP the get moves 3 to 4 GB/s, so TCP runs
could shrink faster). At 2, runs of 128 values shrank by 4 and the checks of each fell behind the next get: the
last check ended milliseconds after the last get (fetch 0.81 to 0.89 of the zero-copy get, against 0.91 to 0.95
at 4, docs/mooncake.md)."""


def default_hash_threads(cores: int | None = None) -> int:
    """MAC threads for a client that was not told how many: half of `cores` (by default the cores this process may
    run on), within `HASH_THREADS_RANGE`."""
    if cores is None:  # the cores this process may run on (where the platform says), else every core
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    low, high = HASH_THREADS_RANGE
    return max(low, min(high, cores // 2))


def round_values(sizes: Sequence[int], hash_threads: int, pipeline_bytes: int) -> int:
    """The fewest values of a batch (of values `sizes` bytes long) one get carries, unless fewer are left: one
    per MAC thread (a round of them), and at least `pipeline_bytes`, so that a batch of small values is not cut into
    many calls that each cost the master a round trip."""
    total = max(sum(sizes), 1)
    return max(hash_threads, -(-pipeline_bytes * len(sizes) // total), 1)


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
