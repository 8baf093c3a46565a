"""Faults a disk tier meets in service, injected on demand: disk full, an I/O error, a corrupted block, and a key
evicted between the lookup that found it and the fetch that reads it.

Each fault is produced where the real one arises (the system call fails, the file's bytes change, the entry is
evicted by the tier), so the tier and the connector handle it through their ordinary paths; the checks then
demand a miss or a failed fetch the engine recomputes, nothing wrong loaded, nothing leaked.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Sequence

from kvfsm.tier_records import TierEntry
from kvfsm.tiers.blockfile import RECORD, DiskIo
from kvfsm.tiers.disk import DiskTier


class FaultyDiskIo(DiskIo):
    """Real system calls, except the next write or read when armed with an errno."""

    def __init__(self) -> None:
        self.write_errno: int | None = None
        self.read_errno: int | None = None
        self.full = False
        """Every write fails with ENOSPC while set: a disk other files filled up (the soak's failing disk)."""

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.write_errno is not None:
            code, self.write_errno = self.write_errno, None
            raise OSError(code, os.strerror(code))
        super().write(fd, parts)

    def read(self, fd: int, parts: Sequence[memoryview]) -> int:
        if self.read_errno is not None:
            code, self.read_errno = self.read_errno, None
            raise OSError(code, os.strerror(code))
        return super().read(fd, parts)


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of a file in place, as bit rot or a stray writer would."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


FAULTS = ("disk-full", "write-io-error", "read-io-error", "corrupt-block", "evict-before-fetch", "stall")


class FakeClock:
    """The disk tier's clock in tests: time passes only when a test says the disk hung."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TierFaults:
    def __init__(self, disk: DiskTier | None) -> None:
        self.disk = disk
        self.io = FaultyDiskIo()
        self.corrupted: list[TierEntry] = []
        """Entries whose file bytes were changed on purpose (their fetch must fail, not load)."""
        self.injected: list[str] = []
        self.clock = FakeClock()
        if disk is not None:
            disk.files.disk = self.io
            disk._jobs.clock = self.clock

    def inject(self, fault: str, choice: int = 0) -> None:
        """Arm or apply one of `FAULTS`; a no-op without a disk tier or without a published key to hit."""
        if self.disk is None:
            return
        if fault == "disk-full":
            self.io.write_errno = errno.ENOSPC
        elif fault == "write-io-error":
            self.io.write_errno = errno.EIO
        elif fault == "read-io-error":
            self.io.read_errno = errno.EIO
        elif fault == "corrupt-block":
            self._corrupt(choice)
        elif fault == "evict-before-fetch":
            self._evict_before_next_fetch()
        elif fault == "stall":  # the disk hangs past the deadline of every job whose I/O has not returned
            self.clock.now += self.disk.io_timeout_s + 1
        else:
            raise ValueError(f"unknown tier fault {fault!r}; choose one of {FAULTS}")
        self.injected.append(fault)

    def evict_one(self, choice: int) -> None:
        """The tier's own eviction of a published key, as pressure from elsewhere would cause it."""
        if self.disk is None:
            return
        published = self._published()
        if published:
            self.disk.discard([published[choice % len(published)].key])

    def is_corrupted(self, entry: TierEntry) -> bool:
        return any(entry is bad for bad in self.corrupted)

    def _published(self) -> list[TierEntry]:
        assert self.disk is not None
        return sorted((e for e in self.disk.entries if e.state == "published"), key=lambda e: e.key)

    def _corrupt(self, choice: int) -> None:
        published = self._published()
        if not published:
            return
        entry = published[choice % len(published)]
        assert self.disk is not None
        flip_byte(self.disk.files.path(entry.key), RECORD.size + choice % self.disk.block_bytes)
        self.corrupted.append(entry)

    def _evict_before_next_fetch(self) -> None:
        """The next fetch finds its first key gone: evicted after the lookup counted it, before the read."""
        assert self.disk is not None
        disk, entries = self.disk, self.disk.entries
        if "pin" in vars(entries):
            return  # armed already
        pin = entries.pin

        def evicted_then_pin(key: int) -> TierEntry | None:
            del entries.pin  # disarm: back to the class's method
            disk.discard([key])
            return pin(key)

        entries.pin = evicted_then_pin  # type: ignore[method-assign]
