"""Where a Mooncake fetch loses against the zero-copy get: the same values read several ways in one rotated run.

Stores one batch of values (128 blocks of 2 MiB by default) through the tier's write-back, then, repetition by
repetition in an order that rotates, reads them back these ways, each timed from call to answer into a zeroed target:

- `payloads, one get`: `batch_get_into` of the payloads alone (the bench's zero-copy get, the ceiling);
- `both halves, one get`: one `batch_get_into` of every payload and trailer (what two objects a value cost);
- `both halves, the fetch's runs`: the same, cut into the fetch's runs (`kvfsm.mooncake.pipeline.fetch_runs`), no
  checks (what the extra gets cost);
- `fetch`: `MooncakeClient.fetch`, as the tier calls it;
- `fetch, checks dropped`: the same with the MAC check replaced by nothing (what the checks' tail costs);
- `payloads, the fetch's runs`: the payloads alone in the fetch's runs, no checks (whether the runs cost is the
  trailers');
- `both halves, the fetch's runs at once`: each run's get on a thread of its own, all started at once, in order (when
  each lands is printed too);
- `fetch, gets at once`: the fetch with its runs' gets started so, each run's values handed to the MAC threads as it
  lands.

Prints, per placement, each way's median GB/s and the median over repetitions of its time over the zero-copy get's
in the same repetition (paired, so drift between repetitions cancels) (docs/mooncake.md, session 27).

Usage (where Mooncake is installed; a GPU host for figures worth quoting):
`python tools/probes/mooncake_fetch_parts.py [BLOCKS] [REPETITIONS]`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kvfsm.mooncake import pipeline, value
from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.host_memory import SlotRegion, address
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.mooncake.secret import ValueKey
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac

BLOCK_BYTES, WAIT_S = 2 << 20, 120.0


def placement(segment: str, blocks: int, reps: int) -> dict[str, tuple[float, float]]:
    own, total = segment == "own", blocks * BLOCK_BYTES
    capacity = max(4 * total, 64 << 20)
    with LocalMooncake(DeploymentSettings(segment_bytes=16 << 20 if own else capacity)) as deployment:
        client = MooncakeClient(ClientSettings(master=deployment.address, op_timeout_s=WAIT_S,
                                               transfer_buffer_bytes=2 * total, segment_bytes=capacity if own else 0,
                                               hash_threads=8), ValueMac(ValueKey.derive(os.urandom(32), "probe")))
        client.connect()
        source = SlotRegion(torch.randint(0, 256, (total,), dtype=torch.uint8), BLOCK_BYTES)
        target = SlotRegion(torch.zeros(total, dtype=torch.uint8), BLOCK_BYTES)
        for buffer in (source.buffer, target.buffer, source.trailers, target.trailers):
            client.register(buffer)
        slots = list(range(blocks))
        keys = [f"probe-{i}" for i in slots]
        written = client.write_back(keys, source.payloads(slots), source.trailers_of(slots)).wait(WAIT_S)
        assert written is not None and not any(isinstance(r, Exception) for r in written), written
        store, got, got_trailers = client.raw(), target.payloads(slots), target.trailers_of(slots)
        into = [address(p) for p in got] + [address(t) for t in got_trailers]
        sizes = [BLOCK_BYTES] * blocks + [value.TRAILER_BYTES] * blocks
        names = value.object_names(keys)
        checks = client.verify_value

        def one_get(count: int) -> Callable[[], object]:
            return lambda: store.batch_get_into(names[:count], into[:count], sizes[:count])

        def runs() -> None:
            least = pipeline.round_values([BLOCK_BYTES] * blocks, 8, client.settings.pipeline_bytes)
            for run in pipeline.fetch_runs(blocks, least, 8):
                picked = list(run) + [blocks + i for i in run]
                store.batch_get_into([names[i] for i in picked], [into[i] for i in picked], [sizes[i] for i in picked])

        def fetch(checked: bool = True) -> Callable[[], object]:
            def move() -> object:
                client.verify_value = checks if checked else (lambda trailer, key, payload: None)
                try:
                    return client.fetch(keys, got, got_trailers).wait(WAIT_S)
                finally:
                    client.verify_value = checks
            return move

        getters = ThreadPoolExecutor(8)
        cuts = pipeline.fetch_runs(blocks, pipeline.round_values([BLOCK_BYTES] * blocks, 8,
                                                                  client.settings.pipeline_bytes), 8)
        landings: list[list[float]] = [[] for _ in cuts]

        def runs_at_once() -> None:
            start = time.perf_counter()

            def get(k: int) -> None:
                picked = list(cuts[k]) + [blocks + i for i in cuts[k]]
                store.batch_get_into([names[i] for i in picked], [into[i] for i in picked], [sizes[i] for i in picked])
                landings[k].append(time.perf_counter() - start)
            list(getters.map(get, range(len(cuts))))

        def fetch_at_once() -> object:
            def call() -> list[object]:
                landed: dict[int, tuple[int, int]] = {}
                at, trailers_at = client._located(got), client._located(got_trailers)

                def check(i: int) -> object:
                    read, fault = client._read(keys[i], landed[i], "fetch of")
                    return fault if fault is not None else client._verified(keys[i], got[i], got_trailers[i], read)

                with client._macs.crew(check) as checking:
                    def get(run: range) -> None:
                        landed.update(zip(run, client._get([keys[i] for i in run], at.pick(run),
                                                           trailers_at.pick(run))))
                        checking.hand(run)
                    list(getters.map(get, cuts))
                    done = checking.join()
                return [done[i] for i in range(blocks)]
            return client._submit(call, fallback=lambda fault: [fault] * blocks).wait(WAIT_S)

        def payload_runs() -> None:
            least = pipeline.round_values([BLOCK_BYTES] * blocks, 8, client.settings.pipeline_bytes)
            for run in pipeline.fetch_runs(blocks, least, 8):
                store.batch_get_into([names[i] for i in run], [into[i] for i in run], [sizes[i] for i in run])

        ways: dict[str, Callable[[], object]] = {
            "payloads, one get": one_get(blocks), "both halves, one get": one_get(2 * blocks),
            "both halves, the fetch's runs": runs, "fetch": fetch(), "fetch, checks dropped": fetch(checked=False)}
        ways["payloads, the fetch's runs"] = payload_runs
        ways["both halves, the fetch's runs at once"] = runs_at_once
        ways["fetch, gets at once"] = fetch_at_once
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        order = list(ways)
        for rep in range(reps):
            turn = rep % len(order)
            for way in order[turn:] + order[:turn]:
                target.buffer.numpy().fill(0)
                start = time.perf_counter()
                ways[way]()
                seconds[way].append(time.perf_counter() - start)
                assert np.array_equal(target.buffer.numpy(), source.buffer.numpy()), way
        getters.shutdown()
        client.close()
    print(f"{segment}: runs of {[len(c) for c in cuts]} at once land at "
          f"{[round(statistics.median(t) * 1e3, 2) for t in landings]} ms", flush=True)
    ceiling = seconds["payloads, one get"]
    return {way: (total / statistics.median(ts) / 1e9, statistics.median(c / t for c, t in zip(ceiling, ts)))
            for way, ts in seconds.items()}


def main(blocks: int, reps: int) -> None:
    for segment in ("segment host", "own"):
        for way, (gbps, share) in placement(segment, blocks, reps).items():
            print(f"{blocks} blocks {segment:12s} {way:32s} {gbps:5.2f} GB/s  paired share {share:.3f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128, int(sys.argv[2]) if len(sys.argv) > 2 else 24)
