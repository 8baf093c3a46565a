"""The disk tier's write and read rates beside a plain sequential write and read of the same bytes, same run.

The ceiling is what one thread gets from the same file system with no bookkeeping: `pwrite` of the bytes in order
into one file, then `fdatasync`; `preadv` of them back after the page cache was told to drop them. The tier moves
the same bytes as CPU-block write-backs and fetches through a shared `DiskTier` (its threads, its file per block
with its record, written under a temporary name and renamed, its CRC32 and record check on every read, its
entries), also ending writes with `fdatasync` (of every block file, on as many threads as the tier's) and reading
cold. A share near 1 means the tier adds little to what the disk costs anyway; the CRC and a file per block are the
parts it cannot avoid.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvfsm.machines import default_machines
from kvfsm.mooncake.keys import KvNamespace
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import io_threads

NAMESPACE = KvNamespace(model_id="kvfsm-bench", dtype="uint8", layout="bytes", block_tokens=1)
"""The bench's blocks are random bytes of no model; shared, so its files are what an engine's would be."""
KEYS_PER_JOB = 16
"""Blocks per write-back or fetch job, as a scheduler step orders them in batches."""


def _filesystem(path: Path) -> str:
    """The mount's file system type (a tmpfs measures memory, not a disk)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if str(path.resolve()).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def _drop_cache(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _sequential(directory: Path, pool: np.ndarray, block_bytes: int) -> tuple[float, float]:
    """Seconds for one thread to write the pool's bytes in order (with fdatasync) and to read them back cold."""
    path = directory / "sequential.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, len(pool))  # as the tier's slot file is, before its clock starts
        _drop_cache(fd)
        view = memoryview(pool)
        start = time.perf_counter()
        for offset in range(0, len(view), block_bytes):
            os.pwrite(fd, view[offset:offset + block_bytes], offset)
        os.fdatasync(fd)
        write_s = time.perf_counter() - start
        _drop_cache(fd)
        start = time.perf_counter()
        for offset in range(0, len(view), block_bytes):
            os.preadv(fd, [view[offset:offset + block_bytes]], offset)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return write_s, read_s


def _drain(tier: DiskTier) -> int:
    """Poll until every job ended; the number of keys that failed."""
    failed = 0
    while tier.busy:
        failed += sum(len(c.failed) for c in tier.poll())
        time.sleep(0.0002)
    return failed


def _through_tier(directory: Path, pool: np.ndarray, block_bytes: int, threads: int) -> tuple[float, float, int]:
    """Seconds to write the pool's blocks through the tier (fdatasync included) and to fetch them back cold."""
    blocks = len(pool) // block_bytes
    tier = DiskTier("bench", directory, blocks * block_bytes, block_bytes, io_threads(threads, "bench"),
                    machines=default_machines(), namespace=NAMESPACE)
    views = [memoryview(pool[i * block_bytes:(i + 1) * block_bytes]) for i in range(blocks)]
    jobs = [range(first, min(first + KEYS_PER_JOB, blocks)) for first in range(0, blocks, KEYS_PER_JOB)]
    try:
        start = time.perf_counter()
        for job_id, keys in enumerate(jobs):
            tier.submit_write(job_id, list(keys), [views[k] for k in keys])
        failed = _drain(tier)
        files = [os.open(path, os.O_RDONLY) for path in sorted(tier.directory.glob("*.kv"))]
        with ThreadPoolExecutor(threads) as syncing:  # as many at once as the tier writes
            list(syncing.map(os.fdatasync, files))
        write_s = time.perf_counter() - start
        for fd in files:
            _drop_cache(fd)
            os.close(fd)
        start = time.perf_counter()
        for job_id, keys in enumerate(jobs, start=len(jobs)):
            tier.submit_read(job_id, list(keys), [views[k] for k in keys])
        failed += _drain(tier)
        read_s = time.perf_counter() - start
    finally:
        tier.close()
        shutil.rmtree(tier.directory, ignore_errors=True)  # the next repetition writes every block again
    return write_s, read_s, failed


def run(total_bytes: int = 1 << 30, block_bytes: int = 2 << 20, threads: int = 4, reps: int = 3,
        directory: Path | None = None) -> dict[str, Any]:
    """Both measurements, alternated `reps` times (medians reported), on `total_bytes` of random blocks in a scratch
    directory under `directory` (the working directory by default: usually a real disk, where /tmp may be memory)."""
    parent = directory or Path.cwd()
    pool = np.random.default_rng(0).integers(0, 256, total_bytes, dtype=np.uint8)
    expected = pool.copy()
    times: list[tuple[float, float, float, float]] = []
    failed, verified = 0, True
    with tempfile.TemporaryDirectory(prefix="kvfsm-disk-bench-", dir=parent) as scratch:
        for _ in range(reps):
            seq_write, seq_read = _sequential(Path(scratch), pool, block_bytes)
            pool[:] = 0
            pool[:] = expected
            tier_write, tier_read, lost = _through_tier(Path(scratch), pool, block_bytes, threads)
            failed += lost
            verified = verified and bool(np.array_equal(pool, expected))
            times.append((seq_write, seq_read, tier_write, tier_read))
    seq_write, seq_read, tier_write, tier_read = (float(np.median(column)) for column in zip(*times))
    gbps = lambda seconds: total_bytes / seconds / 1e9  # noqa: E731
    return {
        "filesystem": _filesystem(parent), "bytes": total_bytes, "block_bytes": block_bytes, "threads": threads,
        "sequential_write_gbps": gbps(seq_write), "sequential_read_gbps": gbps(seq_read),
        "tier_write_gbps": gbps(tier_write), "tier_read_gbps": gbps(tier_read),
        "write_share": seq_write / tier_write, "read_share": seq_read / tier_read,
        "reps": reps, "failed_keys": failed, "bytes_verified": verified,
    }
