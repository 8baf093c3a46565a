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
- Jobs, their deadline (`io_timeout_s` on the tier's clock) and the poll loop are `kvfsm.tiers.base.TierJobs`'s;
  this module keeps only the slots, their offsets and a checksum per slot.

Threads: the worker's thread calls every `LowerTier` method (the reference engine's scheduler looks up on the same
thread); the executor's threads run `_write` and `_read` only, which touch the file and the CPU slot they were handed
and nothing of the index. `close` hands the executor's shut-down and the file's release to a thread of its own and
waits for it at most `io_timeout_s`: a disk hung past the deadline never hangs the caller, and the file descriptor
is closed only after the last call returned, so a late write never lands in a file that reused its number.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Sequence

from kvfsm.io_executor import IoExecutor
from kvfsm.machines import MachineSet
from kvfsm.records import TierEntry
from kvfsm.tiers.base import FutureCalls, IoJob, IoKind, TierCompletion, TierFailure, TierJobs
from kvfsm.tiers.entries import TierEntries

log = logging.getLogger(__name__)


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


def _reason(error: BaseException) -> TierFailure | None:
    """The failure an I/O error means; None for any other error (not an I/O outcome: a bug)."""
    if isinstance(error, CorruptBlock):
        return TierFailure.corrupt
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFailure.full
    if isinstance(error, OSError):
        return TierFailure.io_error
    return None


class DiskTier:
    """A `LowerTier` on one preallocated file of `capacity_bytes // block_bytes` slots."""

    def __init__(self, name: str, path: Path, capacity_bytes: int, block_bytes: int, io: IoExecutor,
                 worker: int = 0, disk_io: DiskIo | None = None, keep_lookups: bool = False,
                 io_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic, *,
                 machines: MachineSet) -> None:
        """`machines`: the connector's machine set, which fires this tier's `tier-entry` transitions."""
        self.name = name
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots == 0:
            raise DiskTierError(f"disk tier {name!r}: capacity_bytes={capacity_bytes} holds no block of {block_bytes}")
        self.entries = TierEntries(name, machines, keep_lookups=keep_lookups)
        self.file = Path(path) / f"kvfsm-{name}-{worker}.slots"
        self._io = io
        self._disk = disk_io or DiskIo()
        self._free: list[int] = []  # slots given back (a stack)
        self._never_used = 0  # slots from here on were never handed out
        self._jobs = TierJobs(f"disk tier {name!r}", self.entries, block_bytes, _reason, self._settled, clock)
        self.io_timeout_s = io_timeout_s
        self._closing: threading.Thread | None = None
        """The thread releasing the file, once `close` began."""
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

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview],
                     checksums: Sequence[int | None] = ()) -> None:
        self._jobs.check(job_id, keys, sources)
        entries, futures, failed = [], [], {}
        for key, source, carried in zip(keys, sources, checksums or [None] * len(keys)):
            if self.entries.get(key) is not None:
                continue  # published or being written already: nothing to move
            slot = self._take_slot()
            if slot is None:
                failed[key] = TierFailure.full
                continue
            entry = self.entries.reserve(key, slot)
            assert entry is not None
            entries.append(entry)
            futures.append(self._io.submit(lambda s=slot, b=source, c=carried: self._write(s, b, c)))
        self._start(job_id, "write", entries, futures, failed)

    def submit_read(self, job_id: int, keys: Sequence[int], destinations: Sequence[memoryview]) -> None:
        self._jobs.check(job_id, keys, destinations)
        entries, futures, failed = [], [], {}
        for key, destination in reversed(list(zip(keys, destinations))):  # the head pinned last: most recent
            entry = self.entries.pin(key)
            if entry is None:
                failed[key] = TierFailure.missing
                continue
            entries.insert(0, entry)
            futures.insert(0, self._io.submit(
                lambda s=entry.slot, b=destination, c=entry.checksum: self._read(s, b, c)))
        self._start(job_id, "read", entries, futures, failed)

    def poll(self) -> list[TierCompletion]:
        return self._jobs.poll()

    def discard(self, keys: Sequence[int]) -> None:
        for key in keys:
            entry = self.entries.evict(key)
            if entry is not None:
                self._free.append(entry.slot)  # type: ignore[arg-type]

    def close(self) -> None:
        """Let the I/O in flight return, then close and remove the slot file; wait for that at most `io_timeout_s`
        (a hung disk's calls finish the release whenever they return)."""
        if self._closing is not None:
            return

        def release() -> None:
            self._io.shutdown(wait=True)  # queued calls still run, on the file they were submitted for
            os.close(self._fd)
            self._fd = -1
            self.file.unlink(missing_ok=True)

        self._closing = threading.Thread(target=release, name=f"kvfsm-{self.name}-close", daemon=True)
        self._closing.start()
        self._closing.join(self.io_timeout_s)
        if self._closing.is_alive():
            log.error("disk tier %r: I/O still running %ss after close; its file is released when it returns",
                      self.name, self.io_timeout_s)

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
        return self._jobs.busy

    def reads_in_flight(self) -> list[int]:
        return self._jobs.reads_in_flight()

    # --- helpers ---------------------------------------------------------------------------------------------

    def _start(self, job_id: int, kind: IoKind, entries: list[TierEntry], futures: list[Future],
               failed: dict[int, TierFailure]) -> None:
        deadline = self._jobs.clock() + self.io_timeout_s
        self._jobs.start(job_id, IoJob(kind, entries, FutureCalls(futures, deadline), failed))

    def _settled(self, kind: IoKind, entry: TierEntry, failure: TierFailure | None) -> None:
        if failure is not None:  # the key is gone from the index: its slot is free again
            self._free.append(entry.slot)  # type: ignore[arg-type]

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

    def _write(self, slot: int, source: memoryview, carried: int | None) -> int:
        """The checksum the slot's bytes are read back against: the one the block was first stored with when the
        engine carries one (the CPU pool's CRC-32, so bytes changed since then fail their read), else the CRC-32 of
        the bytes written."""
        checksum = zlib.crc32(source) if carried is None else carried
        self._disk.write(self._fd, source, slot * self.block_bytes)
        return checksum

    def _read(self, slot: int, destination: memoryview, checksum: int | None) -> int | None:
        """Read the slot into `destination`; the checksum its bytes matched (handed back to the worker)."""
        count = self._disk.read(self._fd, destination, slot * self.block_bytes)
        if count != self.block_bytes:
            raise CorruptBlock(errno.EIO, f"slot {slot}: read {count} of {self.block_bytes} bytes")
        if zlib.crc32(destination) != checksum:
            raise CorruptBlock(errno.EIO, f"slot {slot}: checksum mismatch")
        return checksum
