"""Whether a Mooncake batch moves as fast as one call when several threads each move their own values one at a time.

A fetch whose MAC threads each got and checked their own values as they land would leave one check after the last
byte instead of a run's; it pays only if the store's calls from several threads keep the rate of one batch call.
For each placement (a segment host over TCP, the client's own memory) this times, over 12 repetitions (the first two
dropped), 32 values of 2 MiB moved by one `batch_put_from` / `batch_get_into`, by 4, 8 or 16 threads each getting its
values one call at a time, by 8 threads each getting its values in one call, and by 8 threads putting one at a time;
it prints GB/s per way (docs/mooncake.md, session 25).

Usage (where Mooncake is installed; a GPU host for figures worth quoting): `python tools/probes/mooncake_concurrent_gets.py`.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.host_memory import address
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.mooncake.secret import ValueKey
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac

VALUES, VALUE_BYTES, REPS = 32, 2 << 20, 12


def one_at_a_time(call: Callable[[list[str], list[int], list[int]], object], keys: list[str], addresses: list[int]
                  ) -> Callable[[range], None]:
    def move(indices: range) -> None:
        for i in indices:
            call([keys[i]], [addresses[i]], [VALUE_BYTES])
    return move


def placement(segment: str) -> dict[str, float]:
    own, total = segment == "own", VALUES * VALUE_BYTES
    with LocalMooncake(DeploymentSettings(segment_bytes=16 << 20 if own else 8 * total)) as deployment:
        client = MooncakeClient(ClientSettings(master=deployment.address, transfer_buffer_bytes=2 * total,
                                               segment_bytes=8 * total if own else 0),
                                ValueMac(ValueKey.derive(os.urandom(32), "probe")))
        client.connect()
        store = client.raw()
        source = torch.randint(0, 256, (total,), dtype=torch.uint8).numpy()
        target = np.zeros(total, np.uint8)
        client.register(source)
        client.register(target)
        put_from = [address(source[i * VALUE_BYTES:(i + 1) * VALUE_BYTES]) for i in range(VALUES)]
        get_into = [address(target[i * VALUE_BYTES:(i + 1) * VALUE_BYTES]) for i in range(VALUES)]
        seconds: dict[str, list[float]] = {}

        def timed(way: str, move: Callable[[], object]) -> None:
            start = time.perf_counter()
            move()
            seconds.setdefault(way, []).append(time.perf_counter() - start)

        for rep in range(REPS):
            keys, more = [f"r{rep}-{i}" for i in range(VALUES)], [f"q{rep}-{i}" for i in range(VALUES)]
            timed("put, one call", lambda: store.batch_put_from(keys, put_from, [VALUE_BYTES] * VALUES))
            timed("get, one call", lambda: store.batch_get_into(keys, get_into, [VALUE_BYTES] * VALUES))
            for threads in (4, 8, 16):
                with ThreadPoolExecutor(threads) as pool:
                    stripes = [range(k, VALUES, threads) for k in range(threads)]
                    timed(f"get, {threads} threads one value a call",
                          lambda: list(pool.map(one_at_a_time(store.batch_get_into, keys, get_into), stripes)))
            with ThreadPoolExecutor(8) as pool:
                stripes = [range(k, VALUES, 8) for k in range(8)]
                timed("get, 8 threads one call each", lambda: list(pool.map(
                    lambda s: store.batch_get_into([keys[i] for i in s], [get_into[i] for i in s],
                                                   [VALUE_BYTES] * len(s)), stripes)))
                timed("put, 8 threads one value a call",
                      lambda: list(pool.map(one_at_a_time(store.batch_put_from, more, put_from), stripes)))
            store.remove_all(True)
        client.close()
    return {way: total / statistics.median(times[2:]) / 1e9 for way, times in seconds.items()}


if __name__ == "__main__":
    for segment in ("segment host", "own"):
        for way, gbps in placement(segment).items():
            print(f"{segment:12s} {way:36s} {gbps:5.2f} GB/s")
