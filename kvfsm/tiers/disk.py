"""A local disk below the CPU pool: one file per block (`kvfsm.tiers.blockfile`), I/O on threads, every read verified.

Why these choices:
- Shared or private. Named by a model (`DiskTierConfig.model_id`, `kv_dtype`), the tier keeps its blocks in the
  directory of their namespace (model, dtype, layout, block size, shard: `TierSite.namespace`), where they outlive
  the engine and every engine of that namespace on the host finds them: a restarted engine lists the directory
  when it opens (no block is read), and a lookup adopts (`tier-entry` `adopt`) a whole block it finds there,
  written before the restart or by another engine since.
  Unnamed, it is private to the process: its directory is emptied when it opens and removed when it closes.
- A block is visible only once whole and is loaded only once verified (`disk-block-whole`, `blockfile`): written
  under a temporary name and renamed into place, never changed in place, its record and CRC-32 checked by every
  read. A crash mid-write leaves a temporary file no reader opens; a corrupted or foreign file fails its read
  (`corrupt`), is removed, and the engine recomputes.
- Bounded: at most `capacity_bytes // block_bytes` blocks known to this tier; a write or adoption that finds no room
  evicts the least recently used published block (removing its file; an engine reading it keeps its open file);
  reading blocks are pinned. A write with nothing evictable fails with `full`, which costs only the write-back. The
  directory holds at most the capacities of the engines sharing it.
- Jobs, their deadline (`io_timeout_s` on the tier's clock) and the poll loop are `kvfsm.tiers.base.TierJobs`'s;
  this module keeps only the index's room and the directory.

Threads: the worker's thread calls every `LowerTier` method (the reference engine's scheduler looks up on the same
thread), and the index (the entries and the blocks found at open, `_dormant`) is that thread's alone; the executor's
threads run the block files' `write` and `read` only, which touch their block's files and the CPU slot they were
handed and nothing of the index. A shared tier's lookup `stat`s the blocks it does not know on a thread of its own
(`kvfsm.tiers.bounded.BoundedCall`) and waits at most `lookup_timeout_s` for the answer: a slow or hung disk is a
miss, never a stalled step; the adoption stays on the caller's thread. Removing a block's file (eviction, discard) happens on the tier's thread, so it never overtakes a later write
of the same key. `close` hands the executor's shut-down (and a private directory's removal) to a thread of its own
and waits for it at most `io_timeout_s`: a disk hung past the deadline never hangs the caller.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Sequence

from kvfsm.io_executor import IoExecutor
from kvfsm.machines import MachineSet
from kvfsm.mooncake.keys import KvNamespace, namespace_name
from kvfsm.tier_records import TierEntry
from kvfsm.tiers.base import FutureCalls, IoJob, IoKind, TierCompletion, TierFailure, TierJobs
from kvfsm.tiers.blockfile import BlockFiles, CorruptBlock, DiskIo, Scan
from kvfsm.tiers.bounded import BoundedCall
from kvfsm.tiers.entries import TierEntries

log = logging.getLogger(__name__)

PRIVATE = KvNamespace(model_id="(private)", dtype="(any)", layout="(any)", block_tokens=1)
"""The identity a private tier's block records name: only its own process reads them."""


class DiskTierError(RuntimeError):
    """The disk tier cannot open: its directory cannot be created or listed, or the disk cannot hold it."""


def _reason(error: BaseException) -> TierFailure | None:
    """The failure an I/O error means; None for any other error (not an I/O outcome: a bug)."""
    if isinstance(error, CorruptBlock):
        return TierFailure.corrupt
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFailure.full
    if isinstance(error, FileNotFoundError):  # removed since the lookup (another engine evicted it)
        return TierFailure.missing
    if isinstance(error, OSError):
        return TierFailure.io_error
    return None


class DiskTier:
    """A `LowerTier` of at most `capacity_bytes // block_bytes` block files in one directory."""

    def __init__(self, name: str, path: Path, capacity_bytes: int, block_bytes: int, io: IoExecutor,
                 worker: int = 0, disk_io: DiskIo | None = None, keep_lookups: bool = False,
                 io_timeout_s: float = 30.0, *,
                 machines: MachineSet, namespace: KvNamespace | None = None, lookup_timeout_s: float = 0.05) -> None:
        """`machines`: the connector's machine set, which fires this tier's `tier-entry` transitions. `namespace`:
        what the blocks are the KV of, which makes the tier shared (its directory is the namespace's, kept across
        restarts); None makes it private to this process (`private-<name>-<worker>`, emptied at open).
        `lookup_timeout_s`: longest a shared tier's lookup waits for the `stat`s of blocks other engines wrote."""
        self.name = name
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        if self.capacity_blocks == 0:
            raise DiskTierError(f"disk tier {name!r}: capacity_bytes={capacity_bytes} holds no block of {block_bytes}")
        self.entries = TierEntries(name, machines, keep_lookups=keep_lookups)
        self.shared = namespace is not None
        self.directory = Path(path) / (namespace_name(namespace) if namespace else f"private-{name}-{worker}")
        self.files = BlockFiles(self.directory, namespace or PRIVATE, block_bytes, disk_io or DiskIo())
        self._io = io
        self._jobs = TierJobs(f"disk tier {name!r}", self.entries, block_bytes, _reason)
        self.io_timeout_s = io_timeout_s
        self._lookups = BoundedCall(f"disk tier {name!r} lookup", lookup_timeout_s) if self.shared else None
        """Runs a shared tier's lookup `stat`s, so a hung disk holds up its thread and not the caller's."""
        self._closing: threading.Thread | None = None
        """The thread releasing the directory, once `close` began."""
        self.found = self._open()
        """What the directory held when the tier opened (a private tier's is emptied first)."""
        self._dormant: OrderedDict[int, None] = OrderedDict.fromkeys(self.found.keys)
        """Whole blocks found at open that no lookup asked for yet, least recently written first: they count
        against the capacity and are the first evicted; a lookup adopts one into the index when it first asks."""

    def _open(self) -> Scan:
        """Create or list the directory, adopt the whole blocks it holds, and check the disk can hold the rest."""
        created = not self.directory.exists()
        started = time.monotonic()
        try:
            if not self.shared:
                shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir(parents=True, exist_ok=True)
            found = self.files.scan(self.capacity_blocks, stale_after_s=self.io_timeout_s)
            held = len(found.keys) * self.files.file_bytes
            wanted = self.capacity_blocks * self.files.file_bytes
            if shutil.disk_usage(self.directory).free + held < wanted:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for {wanted} bytes")
        except OSError as error:
            if created or not self.shared:
                shutil.rmtree(self.directory, ignore_errors=True)
            raise DiskTierError(f"disk tier {self.name!r}: cannot hold {self.capacity_blocks} blocks of "
                                f"{self.block_bytes} bytes in {self.directory}: {error.strerror}") from error
        if self.shared:
            log.info("disk tier %r: %d blocks in %s, %d torn and %d over capacity removed, in %.3f s", self.name,
                     len(found.keys), self.directory, found.torn, found.over_capacity, time.monotonic() - started)
        return found

    # --- LowerTier -------------------------------------------------------------------------------------------

    @property
    def plan_version(self) -> int | None:
        return None if self.shared else self.entries.version

    def lookup(self, keys: Sequence[int]) -> int:
        if self.shared:
            self._adopt_visible(keys)
        return self.entries.lookup(keys)

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview],
                     checksums: Sequence[int | None] = ()) -> None:
        self._jobs.check(job_id, keys, sources)
        entries, futures, failed = [], [], {}
        for key, source, carried in zip(keys, sources, checksums or [None] * len(keys)):
            if self.entries.get(key) is not None:
                continue  # published or being written already: nothing to move
            self._dormant.pop(key, None)  # its file is written again
            if not self._make_room(keys):
                failed[key] = TierFailure.full
                continue
            entry = self.entries.reserve(key)
            assert entry is not None
            entries.append(entry)
            futures.append(self._io.submit(lambda k=key, b=source, c=carried: self.files.write(k, b, c)))
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
            futures.insert(0, self._io.submit(lambda k=key, b=destination: self.files.read(k, b)))
        self._start(job_id, "read", entries, futures, failed)

    def poll(self) -> list[TierCompletion]:
        return self._jobs.poll()

    def discard(self, keys: Sequence[int]) -> None:
        """Drop these keys and remove their files (a cache reset: their KV is not to be served again, by this
        engine or a restarted one); keys being read are kept."""
        for key in keys:
            self._evict(key)

    def close(self) -> None:
        """Let the I/O in flight return (then remove a private tier's directory); wait for that at most
        `io_timeout_s` (a hung disk's calls finish the release whenever they return). A shared tier's blocks stay."""
        if self._closing is not None:
            return

        if self._lookups is not None:
            self._lookups.close()

        def release() -> None:
            self._io.shutdown(wait=True)  # queued calls still run, into the directory they were submitted for
            if not self.shared:
                shutil.rmtree(self.directory, ignore_errors=True)

        self._closing = threading.Thread(target=release, name=f"kvfsm-{self.name}-close", daemon=True)
        self._closing.start()
        self._closing.join(self.io_timeout_s)
        if self._closing.is_alive():
            log.error("disk tier %r: I/O still running %ss after close; its directory is released when it returns",
                      self.name, self.io_timeout_s)

    # --- inspection ------------------------------------------------------------------------------------------

    def stored_bytes(self, key: int) -> bytes | None:
        """The bytes `key`'s file holds now, if the index has it (for checks and tools; it does not pin or
        verify)."""
        return None if self.entries.get(key) is None else self.files.payload(key)

    def torn_visible(self) -> list[str]:
        """Block files in the directory, of any writer, visible under a block's name but not whole (for the
        `disk-block-whole` check; a listing, no block is read)."""
        return self.files.torn()

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

    def _adopt_visible(self, keys: Sequence[int]) -> None:
        """Adopt the leading `keys` this tier does not know whose whole files another engine put in the directory
        (their read verifies them), as far as their `stat`s answer within `lookup_timeout_s`. Stops at the first key
        held here in another state, absent, or with no room."""
        unknown = keys[self.entries.published_prefix(keys):]
        unknown = unknown[:next((i for i, key in enumerate(unknown) if self.entries.get(key) is not None),
                                len(unknown))]
        assert self._lookups is not None  # a shared tier's
        visible = self._lookups(partial(self.files.visible_prefix, tuple(unknown))) if unknown else None
        if visible is None:
            return  # nothing to ask the disk, or no answer in time: the index answers alone
        dormant = {key for key in unknown if key in self._dormant}
        for key in unknown[:visible]:
            if key in dormant and key not in self._dormant:
                return  # its file was removed to make room for an earlier key of this lookup
            self._dormant.pop(key, None)
            if not self._make_room(keys):
                return
            self.entries.adopt(key)

    def _make_room(self, keep: Sequence[int]) -> bool:
        """Whether the tier can take one more block, removing a dormant block or evicting its least recent published
        key (none of `keep`, the keys of the job or lookup asking) if it must."""
        if len(self.entries) + len(self._dormant) < self.capacity_blocks:
            return True
        if self._dormant:
            self.files.remove(self._dormant.popitem(last=False)[0])
            return True
        victim = self.entries.least_recent_evictable(set(keep))
        return victim is not None and self._evict(victim)

    def _evict(self, key: int) -> bool:
        """Evict `key` if it is published, removing its file; whether it was."""
        if self.entries.evict(key) is None:
            return False
        self.files.remove(key)
        return True
