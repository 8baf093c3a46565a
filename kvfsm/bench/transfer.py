"""How close each transfer mechanism comes to the copy engines' own ceiling, measured in one process.

Absolute GB/s move from machine to machine, so every figure is reported beside the contiguous pinned ceiling
measured in the same run (device-to-host, host-to-device, and both at once). The workload is a Llama-3-8B-shaped
cache (32 layers, 8 KV heads, 128 dims, bf16, 16-token blocks: 2 MiB per block over all layers) in a per-layer
kv-first layout and in a cross-layer layout; half the GPU blocks, chosen at random, are stored into consecutive
fresh pool slots (what a store into an empty pool gets) and the other half loaded back from the rest of the pool.
Times are wall-clock medians, host submission included. Run `python -m kvfsm.bench.transfer`.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from kvfsm.executor import MECHANISMS, CudaDevice, HostPool, KVCaches, Transfers, register_kv_caches
from kvfsm.executor.mechanisms import BLOCK_CONTIGUOUS_ONLY
from kvfsm.executor.layouts import allocate_kv_caches

GIB = 1 << 30
GOALS = {"kv-first": 0.95, "cross-layer": 0.97, "both-ways": 0.90, "compute-slowdown": 1.02}


def _median_seconds(fn: Callable[[], None], reps: int) -> float:
    """Median wall time of `fn` until the GPU is idle, after one warm-up run."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


CEILING_CHUNKS = (GIB, 128 << 20, 16 << 20)


def ceilings(device: CudaDevice, nbytes: int, reps: int) -> dict:
    """GB/s of contiguous pinned copies each way and of both at once (their sum): the best over copy sizes.

    One 1 GiB H2D copy was seen running well below what 128 MiB copies reach on the same machine, which would
    make shares above 1; the ceiling is what contiguous copies of any of `CEILING_CHUNKS` achieve."""
    hosts = [device.pin_host(nbytes) for _ in range(2)]
    for host in hosts:
        host.fill_(0x5A)  # touched pages, like a pool that has been used
    gpus = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256) for _ in range(2)]
    store, load = device.streams["store"], device.streams["load"]
    by_chunk: dict[str, dict[str, float]] = {}
    for chunk in (c for c in CEILING_CHUNKS if c <= nbytes):
        def d2h() -> None:
            with torch.cuda.stream(store):
                for start in range(0, nbytes, chunk):
                    hosts[0][start:start + chunk].copy_(gpus[0][start:start + chunk], non_blocking=True)

        def h2d() -> None:
            with torch.cuda.stream(load):
                for start in range(0, nbytes, chunk):
                    gpus[1][start:start + chunk].copy_(hosts[1][start:start + chunk], non_blocking=True)

        def both() -> None:
            d2h()
            h2d()

        by_chunk[f"{chunk >> 20}MiB"] = {
            "d2h": nbytes / _median_seconds(d2h, reps) / 1e9,
            "h2d": nbytes / _median_seconds(h2d, reps) / 1e9,
            "both": 2 * nbytes / _median_seconds(both, reps) / 1e9,
        }
    for host in hosts:
        device.unpin_host(host)
    result = {key: max(entry[key] for entry in by_chunk.values()) for key in ("d2h", "h2d", "both")}
    return {**result, "by_chunk": by_chunk}  # type: ignore[dict-item]


def _cache(device: CudaDevice, layout: str, num_blocks: int) -> tuple[KVCaches, HostPool]:
    tensors, groups = allocate_kv_caches(layout, 32, num_blocks, 16, 8, 128, torch.bfloat16, "cuda")
    for tensor in tensors.values():
        tensor.view(torch.uint8).view(-1).random_(0, 256)
    caches = register_kv_caches(tensors, layout, groups)
    return caches, HostPool(device, num_blocks, caches.gpu_block_bytes)


def _block(caches: KVCaches, b: int) -> torch.Tensor:
    return torch.cat([plane.rows[p, b] for plane in caches.planes for p in range(plane.pieces)])


def mechanisms(device: CudaDevice, layout: str, num_blocks: int, peaks: dict[str, float],
               reps: int) -> dict[str, dict[str, float | str]]:
    """Store and load GB/s (and share of ceiling) of every mechanism that fits `layout`, both at once, and how
    much each slows a matmul loop on the compute stream."""
    caches, pool = _cache(device, layout, num_blocks)
    half = num_blocks // 2
    order = torch.randperm(num_blocks).tolist()
    stored, loaded = order[:half], order[half:]
    moved = half * caches.gpu_block_bytes
    results: dict[str, dict[str, float | str]] = {}
    for name in [m for m in MECHANISMS if m not in BLOCK_CONTIGUOUS_ONLY or caches.block_contiguous] + ["auto"]:
        transfers = Transfers(device, caches, pool, 1, name)
        per_piece = transfers.mechanism == "copy-per-block" and not caches.block_contiguous
        repeat = 1 if per_piece else reps

        def store() -> None:
            transfers.store(stored, range(half))

        def load() -> None:
            transfers.load(range(half, num_blocks), loaded)

        def both() -> None:
            store()
            load()

        store_s = _median_seconds(store, repeat)
        if not torch.equal(pool.slot(0).cuda(), _block(caches, stored[0])):
            raise AssertionError(f"{layout}/{name}: the store did not land byte-exact")
        entry: dict[str, float | str] = {"resolved": transfers.mechanism}
        torch.cuda.synchronize()
        start = time.perf_counter()
        store()
        entry["store_submit_ms"] = (time.perf_counter() - start) * 1e3  # host time to enqueue the whole store
        torch.cuda.synchronize()
        entry["store_gbps"] = moved / store_s / 1e9
        entry["load_gbps"] = moved / _median_seconds(load, repeat) / 1e9
        entry["both_gbps"] = 2 * moved / _median_seconds(both, repeat) / 1e9
        entry["store_share"] = entry["store_gbps"] / peaks["d2h"]
        entry["load_share"] = entry["load_gbps"] / peaks["h2d"]
        entry["both_share"] = entry["both_gbps"] / peaks["both"]
        if not per_piece:
            entry.update(compute_interference(device, both))
        results[name] = entry
    pool.close()
    return results


def compute_interference(device: CudaDevice, transfer: Callable[[], None], size: int = 8192, iters: int = 8,
                         trials: int = 21, cover: int = 3) -> dict[str, float]:
    """How much slower a bf16 matmul loop on the compute stream runs while `transfer` moves blocks.

    Each trial times the loop alone and busy back to back (their order alternating), and the figure is the median
    of the per-trial ratios, so clock and thermal drift between trials cancels. For the busy half `transfer` is
    enqueued `cover` times before the loop so copies run for its whole length; `covered` is the share of busy
    trials in which they were still running when the loop ended (below 1, the ratio understates interference).
    """
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")

    def loop_ms(busy: bool) -> tuple[float, bool]:
        torch.cuda.synchronize()
        tails = []
        if busy:
            for _ in range(cover):
                transfer()
            for stream in ("store", "load"):
                tails.append(torch.cuda.Event())
                device.record(stream, tails[-1])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        covered = any(not tail.query() for tail in tails)
        torch.cuda.synchronize()
        return start.elapsed_time(end), covered

    loop_ms(False)
    loop_ms(True)
    alone, busy, ratios, covered = [], [], [], 0
    for trial in range(trials):
        first, second = (False, True) if trial % 2 == 0 else (True, False)
        times = {first: loop_ms(first), second: loop_ms(second)}
        alone.append(times[False][0])
        busy.append(times[True][0])
        covered += times[True][1]
        ratios.append(busy[-1] / alone[-1])
    return {"matmul_alone_ms": statistics.median(alone), "matmul_busy_ms": statistics.median(busy),
            "compute_slowdown": statistics.median(ratios), "compute_slowdown_p10": _quantile(ratios, 0.1),
            "compute_slowdown_p90": _quantile(ratios, 0.9), "covered": covered / trials, "trials": trials}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(num_blocks: int = 1024, ceiling_bytes: int = GIB, reps: int = 5) -> dict:
    """Every measurement of this benchmark, as one JSON-ready dict."""
    device = CudaDevice()
    peaks = ceilings(device, ceiling_bytes, reps)
    layouts = {layout: mechanisms(device, layout, num_blocks, peaks, reps) for layout in ("kv-first", "cross-layer")}
    return {"device": torch.cuda.get_device_name(), "peaks_gbps": peaks, "layouts": layouts, "goals": GOALS,
            "blocks_moved_each_way": num_blocks // 2, "block_bytes": 2 << 20}


def table(device: str, peaks: dict[str, float], layouts: dict[str, dict[str, dict]]) -> Table:
    """Every mechanism's GB/s and share of its ceiling, and the matmul slowdown it caused."""
    out = Table(title=f"KV transfer on {device}: ceilings D2H {peaks['d2h']:.1f}, H2D {peaks['h2d']:.1f}, "
                        f"both {peaks['both']:.1f} GB/s")
    for column in ("layout", "mechanism", "store", "share", "load", "share", "both", "share", "matmul"):
        out.add_column(column)
    for layout, entries in layouts.items():
        for name, e in entries.items():
            out.add_row(layout, f"{name}" if name != "auto" else f"auto={e['resolved']}",
                          f"{e['store_gbps']:.1f}", f"{e['store_share']:.3f}", f"{e['load_gbps']:.1f}",
                          f"{e['load_share']:.3f}", f"{e['both_gbps']:.1f}", f"{e['both_share']:.3f}",
                          f"{e['compute_slowdown']:.3f}x" if "compute_slowdown" in e else "-")
    return out


def main() -> None:
    if not torch.cuda.is_available():
        print("kvfsm.bench.transfer: no CUDA device here; skipped every measurement")
        return
    result = run()
    print(json.dumps(result, indent=1))
    Console(width=120).print(table(result["device"], result["peaks_gbps"], result["layouts"]))


if __name__ == "__main__":
    main()
