"""The disk tier's files: one file per block, made visible whole by a rename, verified by every read.

A block is the file `<key in hex>.kv` in its namespace's directory: a 72-byte record, then the block's bytes. The
record names the block (`MAGIC`, which versions the format; the block's identity, a BLAKE2b over its namespace and
prefix hash, `kvfsm.mooncake.keys.object_key`; its length) and holds the CRC-32 taken when the block was first
stored. Why this shape, and not slots in one shared file:
- Visible only once complete: a write goes to a fresh temporary name (`tempfile.mkstemp`, created exclusively, so
  no two writers ever share one) and is renamed onto the block's name after its last byte was written. A rename
  is atomic, so a reader (this engine, another engine, a restarted one) finds either no file or a whole one; a
  writer killed mid-write leaves only a temporary file, which no reader opens.
- Never changed in place: a second writer of the same key renames its own whole file over the first, and a reader
  that opened the first keeps reading it (the file system keeps an open file's bytes until it is closed), so two
  engines writing one directory cannot tear each other's blocks and need no lock.
- Verified before use: a read checks the record against the identity and length it expects and the bytes against
  the record's CRC-32. What the rename cannot rule out (a power loss before the bytes reached the disk, bit rot, a
  file copied under another name) fails that check: `CorruptBlock`, a miss, and the file is removed.
- The index is the directory: a block's name is its prefix hash, so start-up rebuilds the index from one listing
  (names, sizes, modification times; no block is read), in time linear in the files, which the capacity bounds.

Threads: `write`, `read` and `remove` run on the tier's I/O threads or its own thread, `visible_prefix` on its lookup
thread; each touches only its block's files and the buffers it was handed. `scan` runs once, when the tier opens.
"""

from __future__ import annotations

import errno
import os
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvfsm.mooncake.keys import KvNamespace, object_key

MAGIC = b"kvfsmBK1"
"""The record's first bytes: a change of the file format bumps its version."""
RECORD = struct.Struct("<8s48sQI4x")
"""magic, identity (ASCII, zero-padded), block length, CRC-32 of the block's bytes."""
SUFFIX = ".kv"
TEMPORARY = ".tmp"


def _key_of(name: str) -> int | None:
    """The key a block file's name holds; None for any other file (left alone)."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return int(name[:-len(SUFFIX)], 16)
    except ValueError:
        return None


def _stat(item: os.DirEntry) -> os.stat_result | None:
    """A listed file's status; None if another process removed it since it was listed."""
    try:
        return item.stat()
    except FileNotFoundError:
        return None


class CorruptBlock(OSError):
    """A block's file is short or long, names another block, or holds bytes its record's checksum does not match."""


class DiskIo:
    """The system calls that move a block's bytes: a seam where tests inject the faults a real disk produces."""

    def write(self, fd: int, parts: Sequence[memoryview]) -> None:
        """Write every part, in order, from the file's start (a short write continues where it stopped)."""
        for part in parts:
            done = 0
            while done < part.nbytes:
                done += os.write(fd, part[done:])

    def read(self, fd: int, parts: Sequence[memoryview]) -> int:
        """Fill the parts in order from the file's start; the bytes read (fewer at the end of the file)."""
        return os.readv(fd, parts)


@dataclass
class Scan:
    """What a tier found in its directory when it opened."""

    keys: list[int] = field(default_factory=list)
    """Whole blocks kept, least recently written first."""
    torn: int = 0
    """Removed: temporary files of writers gone (killed, or past their deadline) and block files of a wrong size."""
    over_capacity: int = 0
    """Removed: whole blocks older than the `capacity` newest."""


class BlockFiles:
    """The block files of one namespace in one directory."""

    def __init__(self, directory: Path, namespace: KvNamespace, block_bytes: int, disk: DiskIo) -> None:
        self.directory = directory
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.disk = disk
        self.file_bytes = RECORD.size + block_bytes

    def path(self, key: int) -> Path:
        return self.directory / f"{key:x}{SUFFIX}"

    def record(self, key: int, checksum: int) -> bytes:
        return RECORD.pack(MAGIC, object_key(self.namespace, key).encode(), self.block_bytes, checksum)

    def write(self, key: int, source: memoryview, carried: int | None = None) -> int:
        """Store `source` as `key`'s block, visible only once whole; the CRC-32 it was stored with: `carried`, the
        one the block was first stored with in the CPU pool, when the engine hands one (so bytes changed since then
        fail their read), else the CRC-32 of the bytes written."""
        checksum = zlib.crc32(source) if carried is None else carried
        fd, temporary = tempfile.mkstemp(suffix=TEMPORARY, prefix=f".{key:x}-", dir=self.directory)
        try:
            try:
                self.disk.write(fd, [memoryview(self.record(key, checksum)), source])
            finally:
                os.close(fd)
            os.rename(temporary, self.path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return checksum

    def read(self, key: int, destination: memoryview) -> int:
        """Read `key`'s block into `destination` and verify it; the CRC-32 it was first stored with. A missing file
        raises `FileNotFoundError`; a file that fails its check raises `CorruptBlock` and is removed (it can never
        pass: the next writer of the key puts a whole new file in its place)."""
        record, extra = bytearray(RECORD.size), bytearray(1)
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            count = self.disk.read(fd, [memoryview(record), destination, memoryview(extra)])
        finally:
            os.close(fd)
        problem = self._problem(key, bytes(record), destination, count)
        if problem is not None:
            self.remove(key)
            raise CorruptBlock(errno.EIO, f"{self.path(key).name}: {problem}")
        return RECORD.unpack(record)[3]

    def _problem(self, key: int, record: bytes, payload: memoryview, count: int) -> str | None:
        if count != self.file_bytes:
            return f"{count} bytes (or more), expected {self.file_bytes}"
        magic, identity, length, checksum = RECORD.unpack(record)
        if magic != MAGIC or length != self.block_bytes:
            return f"record {magic!r} of {length} bytes, expected {MAGIC!r} of {self.block_bytes}"
        if identity.rstrip(b"\0") != object_key(self.namespace, key).encode():
            return "names another block or namespace"
        if zlib.crc32(payload) != checksum:
            return "checksum mismatch"
        return None

    def visible(self, key: int) -> bool:
        """Whether `key`'s block file is there, whole in size (not yet verified: that is the read's)."""
        try:
            return self.path(key).stat().st_size == self.file_bytes
        except OSError:
            return False

    def visible_prefix(self, keys: Sequence[int]) -> int:
        """How many leading `keys` have their block file there, whole in size: one `stat` each, up to the first
        that has none."""
        return next((index for index, key in enumerate(keys) if not self.visible(key)), len(keys))

    def torn(self) -> list[str]:
        """Names of files visible under a block's name that are not whole (what `disk-block-whole` rules out)."""
        with os.scandir(self.directory) as listing:
            return sorted(item.name for item in listing if _key_of(item.name) is not None
                          and (stat := _stat(item)) is not None and stat.st_size != self.file_bytes)

    def remove(self, key: int) -> None:
        self.path(key).unlink(missing_ok=True)

    def payload(self, key: int) -> bytes | None:
        """The block's bytes as the file holds them now, unverified (for checks and tools)."""
        try:
            return self.path(key).read_bytes()[RECORD.size:]
        except FileNotFoundError:
            return None

    def scan(self, capacity: int, stale_after_s: float) -> Scan:
        """List the directory: keep the `capacity` most recently written whole blocks; remove the rest, block files
        of a wrong size, and temporary files untouched for `stale_after_s` (their writer died or is past its
        deadline: removing the file under a live writer only fails its rename, so its write-back fails)."""
        found, whole = Scan(), []
        now = time.time()
        with os.scandir(self.directory) as listing:
            for item in listing:
                stat = _stat(item)
                if stat is None:
                    continue  # removed since the listing, by another engine
                if item.name.endswith(TEMPORARY):
                    if now - stat.st_mtime > stale_after_s:
                        found.torn += self._unlink(item.path)
                elif (key := _key_of(item.name)) is not None and stat.st_size == self.file_bytes:
                    whole.append((stat.st_mtime_ns, key))
                elif key is not None:
                    found.torn += self._unlink(item.path)
        whole.sort()
        excess = max(len(whole) - capacity, 0)
        for _, key in whole[:excess]:
            found.over_capacity += self._unlink(str(self.path(key)))
        found.keys = [key for _, key in whole[excess:]]
        return found

    @staticmethod
    def _unlink(path: str) -> int:
        """Remove one file another process may have removed first; 1 if this call removed it."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return 1
