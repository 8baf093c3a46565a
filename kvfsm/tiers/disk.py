"""A local disk below the CPU pool: one preallocated slot file per worker, I/O on threads, every block checksummed.

Why these choices:
- One file of `capacity_bytes`, preallocated at start-up (`posix_fallocate`): a full disk is found before serving,
  not mid-write, and a block's place is a fixed offset, so a write never grows or fragments the file.
- Reads and writes go straight between the pinned CPU slot and the file (`pwrite`/`preadv`, no staging copy) on
  the tier's threads; the engine's thread only submits and polls.
- A CRC32 of each block is taken by the write and kept in the entry; a read whose bytes (or length) differ is a
  failed fetch, never a load: torn writes, bit rot and a racing overwrite all end as a miss.
- A restart starts empty: the file is truncated and preallocated again when the tier opens, and the index lives
  only in memory, so nothing a previous process wrote (or half wrote) can be served.
- Its own eviction: a write that finds no free slot evicts the least recently used published key; reading keys
  are pinned. A write with nothing evictable fails with `full`, which costs only the write-back.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvfsm.machines import MachineSet
from kvfsm.tiers.base import IoExecutor, TierCompletion, TierFailure, check_job
from kvfsm.tiers.entries import TierEntries
from kvfsm.records import TierEntry


class DiskTierError(RuntimeError):
    """The disk tier cannot open: its directory or slot file cannot be created, or the disk cannot hold it."""


class CorruptBlock(OSError):
    """A block read back short, or with bytes that do not match the checksum its write took."""


class DiskIo:
    """The system calls the tier makes: a seam where tests inject the faults a real disk produces."""

    def write(self, fd: int, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def read(self, fd: int, into: memoryview, offset: int) -> int:
        return os.preadv(fd, [into], offset)


@dataclass
class _Job:
    kind: str  # "write" or "read"
    deadline: float
    parts: list[tuple[TierEntry, Future]] = field(default_factory=list)
    failed: dict[int, TierFailure] = field(default_factory=dict)
    held: bool = False  # reported failed at its deadline; its buffers are released when its I/O returns


def _reason(error: BaseException) -> TierFailure:
    if isinstance(error, CorruptBlock):
        return TierFailure.corrupt
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFailure.full
    if isinstance(error, OSError):
        return TierFailure.io_error
    raise error  # not an I/O outcome: a bug, which must not pass as a miss


class DiskTier:
    """A `LowerTier` on one preallocated file of `capacity_bytes // block_bytes` slots."""

    def __init__(self, name: str, path: Path, capacity_bytes: int, block_bytes: int, io: IoExecutor,
                 worker: int = 0, disk_io: DiskIo | None = None, keep_lookups: bool = False,
                 io_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 machines: MachineSet | None = None) -> None:
        self.name = name
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots == 0:
            raise DiskTierError(f"disk tier {name!r}: capacity_bytes={capacity_bytes} holds no block of {block_bytes}")
        self.entries = TierEntries(name, keep_lookups=keep_lookups, machines=machines)
        self.file = Path(path) / f"kvfsm-{name}-{worker}.slots"
        self._io = io
        self._disk = disk_io or DiskIo()
        self._free: list[int] = []  # slots given back (a stack)
        self._never_used = 0  # slots from here on were never handed out
        self._jobs: dict[int, _Job] = {}
        self.io_timeout_s = io_timeout_s
        self._clock = clock
        self._fd = self._open()

    def _open(self) -> int:
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as error:
            raise DiskTierError(f"disk tier {self.name!r}: cannot create {self.file}: {error.strerror}") from error
        try:
            size = self.num_slots * self.block_bytes
            if shutil.disk_usage(self.file.parent).free < size:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for {size} bytes")
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            self.file.unlink(missing_ok=True)
            raise DiskTierError(f"disk tier {self.name!r}: cannot preallocate {self.num_slots * self.block_bytes} "
                                f"bytes in {self.file}: {error.strerror}") from error
        return fd

    # --- LowerTier -------------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[int]) -> int:
        return self.entries.lookup(keys)

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview]) -> None:
        check_job(f"disk tier {self.name!r}", self._jobs, self.block_bytes, job_id, keys, sources)
        job = self._jobs[job_id] = _Job("write", self._clock() + self.io_timeout_s)
        for key, source in zip(keys, sources):
            if self.entries.get(key) is not None:
                continue  # published or being written already: nothing to move
            slot = self._take_slot()
            if slot is None:
                job.failed[key] = TierFailure.full
                continue
            entry = self.entries.reserve(key, slot)
            assert entry is not None
            job.parts.append((entry, self._io.submit(lambda s=slot, b=source: self._write(s, b))))

    def submit_read(self, job_id: int, keys: Sequence[int], destinations: Sequence[memoryview]) -> None:
        check_job(f"disk tier {self.name!r}", self._jobs, self.block_bytes, job_id, keys, destinations)
        job = self._jobs[job_id] = _Job("read", self._clock() + self.io_timeout_s)
        for key, destination in reversed(list(zip(keys, destinations))):  # the head pinned last: most recent
            entry = self.entries.pin(key)
            if entry is None:
                job.failed[key] = TierFailure.missing
                continue
            job.parts.insert(0, (entry, self._io.submit(
                lambda s=entry.slot, b=destination, c=entry.checksum: self._read(s, b, c))))

    def poll(self) -> list[TierCompletion]:
        finished = []
        now = self._clock()
        for job_id, job in list(self._jobs.items()):
            if not all(future.done() for _, future in job.parts):
                if not job.held and now >= job.deadline:  # a hung disk: fail it now, keep its buffers
                    job.held = True
                    finished.append(TierCompletion.timed_out(job_id, (entry.key for entry, _ in job.parts), job.failed))
                continue
            del self._jobs[job_id]
            for entry, future in reversed(job.parts):  # a prefix's head settles last: most recently used
                error = future.exception()
                if error is None:
                    self.entries.settle(job.kind, entry, checksum=future.result())
                else:
                    job.failed[entry.key] = _reason(error)
                    self.entries.settle(job.kind, entry, failed=True)
                    self._free.append(entry.slot)  # type: ignore[arg-type]
            finished.append(TierCompletion.ended(job_id, job.held, job.failed))
        return finished

    def discard(self, keys: Sequence[int]) -> None:
        for key in keys:
            entry = self.entries.evict(key)
            if entry is not None:
                self._free.append(entry.slot)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._fd < 0:
            return
        self._io.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1
        self.file.unlink(missing_ok=True)

    # --- inspection ------------------------------------------------------------------------------------------

    def stored_bytes(self, key: int) -> bytes | None:
        """The bytes the file holds in `key`'s slot now (for checks and tools; it does not pin or verify)."""
        entry = self.entries.get(key)
        if entry is None or entry.slot is None:
            return None
        return os.pread(self._fd, self.block_bytes, entry.slot * self.block_bytes)

    @property
    def busy(self) -> bool:
        """Some job was submitted and not yet reported by `poll`."""
        return bool(self._jobs)

    def reads_in_flight(self) -> list[int]:
        return [entry.key for job in self._jobs.values() if job.kind == "read" for entry, _ in job.parts]

    # --- helpers ---------------------------------------------------------------------------------------------


    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._never_used < self.num_slots:
            self._never_used += 1
            return self._never_used - 1
        victim = self.entries.least_recent_evictable()
        if victim is None:
            return None
        entry = self.entries.evict(victim)
        assert entry is not None
        return entry.slot

    def _write(self, slot: int, source: memoryview) -> int:
        checksum = zlib.crc32(source)
        self._disk.write(self._fd, source, slot * self.block_bytes)
        return checksum

    def _read(self, slot: int, destination: memoryview, checksum: int | None) -> None:
        count = self._disk.read(self._fd, destination, slot * self.block_bytes)
        if count != self.block_bytes:
            raise CorruptBlock(errno.EIO, f"slot {slot}: read {count} of {self.block_bytes} bytes")
        if zlib.crc32(destination) != checksum:
            raise CorruptBlock(errno.EIO, f"slot {slot}: checksum mismatch")
