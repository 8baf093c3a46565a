"""Mooncake tier throughput: kvfsm's zero-copy write-back and fetch beside the store's own batch calls, same run.

One local deployment (master + segment host on loopback), one client that lends no memory (so every byte crosses
the transfer engine to the segment host, as it would to another host). For each repetition the same bytes move
four ways, each timed from call to verified answer, in an order that rotates from one repetition to the next (the
way timed first finds caches the others left, so no way is always timed first or always after the same one):

- `baseline put/get`: Mooncake's `put_batch` / `get_batch` of Python `bytes` (the store's plain batch API);
- `zero-copy put/get`: Mooncake's `batch_put_from` / `batch_get_into` on the registered pool, nothing else;
- `tier write-back/fetch`: `MooncakeClient.write_back` / `fetch`: the zero-copy calls plus the keyed MAC of every
  block (sealed / checked on the client's MAC threads, overlapped with the transfers), the block checksum each
  value carries, the presence check before a put, and the hop to the I/O thread, i.e. what the engine gets;
- `MACs alone`: sealing every block on as many threads as the client's MAC threads, nothing moved: the rate the
  integrity pass must stay above to hide behind the transfer.

Figures are medians over repetitions, in GB/s (1e9 bytes/s); shares are tier / baseline of the same run. The
calls of one repetition take tens of milliseconds on an engine host, where one slow call moves a median of a few
by a tenth, so a full run takes 16 repetitions (four turns of the rotation). `hash_threads` picks the client's MAC
threads (None: its default), so that one run can set several beside each other (`--hash-threads`), each with its
own deployment and baselines.
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.host_memory import SlotRegion, address
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.mooncake.secret import ValueKey
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac

WAIT_S = 120.0
CALL_BLOCKS = 128
"""Blocks one call moves by default: 128 blocks of 2 MiB, the KV of a 2,048-token prefix of a Llama-3-8B-sized model,
which a tier job fetches whole. That is about where a shared tier starts to pay: recomputing 2k tokens takes about
63 ms on an H100 (docs/benchmarks.md), fetching their 256 MiB from Mooncake 45 to 70 ms on the H200 hosts measured
(5.8 GB/s from local memory, 3.8 over TCP), while 512 tokens (32 blocks) are recomputed in about the time their
fetch takes. Smaller calls are one option away (`--blocks`): each call also pays fixed costs (a master round trip
per get or put, hand-offs between the I/O and MAC threads, the last values' checks), which at 32 blocks are a tenth
of the call (docs/mooncake.md)."""


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    answer = fn()
    return time.perf_counter() - start, answer


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"mooncake bench: {what}")


def _moved(results: list[Any] | None, blocks: int) -> bool:
    return results is not None and len(results) == blocks and not any(isinstance(r, Exception) for r in results)


def _zero(region: SlotRegion) -> None:
    """Clear `region` on this thread alone. The bench's own checks use numpy, not torch: a torch op on a buffer this
    size runs on torch's OpenMP threads, which spin for a while after it (their block time) on every core, so the
    next thread hand-off (a client call reaching the I/O thread, a seal reaching a MAC thread) waits a millisecond or
    two for a core; that is the bench's doing, not the tier's."""
    region.buffer.numpy().fill(0)


def _same(one: SlotRegion, other: SlotRegion) -> bool:
    return bool(np.array_equal(one.buffer.numpy(), other.buffer.numpy()))


Move = Callable[[list[str]], dict[str, float]]


def _ways(store: Any, client: MooncakeClient, mac: ValueMac, sealers: ThreadPoolExecutor, source: SlotRegion,
          target: SlotRegion, carried: list[int], ptrs: list[int], into: list[int], payloads: list[bytes]
          ) -> list[tuple[str, Move]]:
    """The ways one repetition moves the same bytes, each a put then a get verified against the source, timed from
    call to answer (the MACs alone move nothing). The run rotates their order repetition by repetition."""
    blocks, block_bytes = len(payloads), len(payloads[0])
    slots = list(range(blocks))
    # the tier's views of its slots exist before its calls, as the zero-copy calls' addresses do (`ptrs`, `into`)
    sent, sent_trailers = source.payloads(slots), source.trailers_of(slots)
    got, got_trailers = target.payloads(slots), target.trailers_of(slots)

    def baseline(keys: list[str]) -> dict[str, float]:
        put, code = _timed(lambda: store.put_batch(keys, payloads))
        _expect(code == 0, f"put_batch answered {code}")
        get, got = _timed(lambda: store.get_batch(keys))
        _expect(got == payloads, "get_batch returned other bytes")
        return {"baseline put": put, "baseline get": get}

    def zero_copy(keys: list[str]) -> dict[str, float]:
        put, codes = _timed(lambda: store.batch_put_from(keys, ptrs, [block_bytes] * blocks))
        _expect(all(c == 0 for c in codes), f"batch_put_from answered {codes}")
        _zero(target)
        get, codes = _timed(lambda: store.batch_get_into(keys, into, [block_bytes] * blocks))
        _expect(all(c == block_bytes for c in codes) and _same(target, source),
                f"batch_get_into answered {codes} or other bytes")
        return {"zero-copy put": put, "zero-copy get": get}

    def tier(keys: list[str]) -> dict[str, float]:
        put, results = _timed(lambda: client.write_back(keys, sent, sent_trailers, carried=carried).wait(WAIT_S))
        _expect(_moved(results, blocks), f"write_back answered {results}")
        _zero(target)
        get, results = _timed(lambda: client.fetch(keys, got, got_trailers).wait(WAIT_S))
        _expect(_moved(results, blocks) and results == carried and _same(target, source),
                f"fetch answered {results} or other bytes")
        return {"tier write-back": put, "tier fetch": get}

    def macs(keys: list[str]) -> dict[str, float]:
        seconds, _ = _timed(lambda: list(sealers.map(
            lambda i: mac.seal(source.trailer(i), keys[i], source.payload(i), carried[i]), slots)))
        return {"MACs alone": seconds}

    return [("baseline", baseline), ("zero", zero_copy), ("tier", tier), ("macs", macs)]


def run(quick: bool, segment: str = "segment host", hash_threads: int | None = None, blocks: int | None = None
        ) -> dict[str, Any]:
    """`segment`: where the objects live, `"segment host"` (another process: bytes cross the transfer engine's
    TCP path) or `"own"` (memory this client lends: the path a single-host deployment takes). `blocks`: how many
    blocks one call moves (default `CALL_BLOCKS` of 2 MiB; 8 of 256 KiB when quick)."""
    block_bytes = (256 << 10) if quick else (2 << 20)
    blocks = blocks or (8 if quick else CALL_BLOCKS)
    reps = 2 if quick else 16  # a multiple of the four ways, so each leads as often
    total = blocks * block_bytes
    generator = torch.Generator().manual_seed(0)
    source = SlotRegion(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator), block_bytes)
    target = SlotRegion(torch.zeros(total, dtype=torch.uint8), block_bytes)
    payloads = [source.payload(i).tobytes() for i in range(blocks)]
    slots = list(range(blocks))
    carried = [zlib.crc32(p) for p in payloads]  # the CPU pool's checksums, taken at store time (not timed)
    times: dict[str, list[float]] = {name: [] for name in (
        "baseline put", "baseline get", "zero-copy put", "zero-copy get", "tier write-back", "tier fetch",
        "MACs alone")}
    capacity = max(4 * total, 64 << 20)
    with LocalMooncake(DeploymentSettings(segment_bytes=capacity if segment == "segment host" else 16 << 20)
                       ) as deployment:
        mac = ValueMac(ValueKey.derive(os.urandom(32), "bench"))
        client = MooncakeClient(ClientSettings(master=deployment.address, op_timeout_s=WAIT_S,
                                               transfer_buffer_bytes=2 * total,
                                               segment_bytes=capacity if segment == "own" else 0,
                                               hash_threads=hash_threads), mac)
        client.connect()
        sealers = ThreadPoolExecutor(client.hash_threads)
        try:
            for buffer in (source.buffer, target.buffer, source.trailers, target.trailers):
                client.register(buffer)  # whole, as the tier registers its slots' and trailers' chunks
            store: Any = client.raw()
            ptrs = [address(p) for p in source.payloads(slots)]
            into = [address(p) for p in target.payloads(slots)]
            ways = _ways(store, client, mac, sealers, source, target, carried, ptrs, into, payloads)
            for rep in range(reps):
                turn = rep % len(ways)  # each way leads in turn, so none is always timed on a cache the last one warmed
                for way, move in ways[turn:] + ways[:turn]:
                    keys = [f"bench-{way}-{rep}-{i}" for i in slots]
                    for name, seconds in move(keys).items():
                        times[name].append(seconds)
                _expect(store.remove_all(True) >= 0, "remove_all failed")
        finally:
            sealers.shutdown()
            client.close()
    gbps = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    return {"segment": segment, "hash_threads": client.hash_threads, "block_bytes": block_bytes, "blocks": blocks,
            "bytes_per_rep": total, "reps": reps, "gbps": gbps,
            "write_back_share_of_baseline": gbps["tier write-back"] / gbps["baseline put"],
            "fetch_share_of_baseline": gbps["tier fetch"] / gbps["baseline get"],
            "write_back_share_of_zero_copy": gbps["tier write-back"] / gbps["zero-copy put"],
            "fetch_share_of_zero_copy": gbps["tier fetch"] / gbps["zero-copy get"]}
