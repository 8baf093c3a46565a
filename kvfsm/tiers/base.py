"""The lower-tier interface: what a store below the CPU pool (a local disk, Mooncake Store) must provide.

kvfsm drives every lower tier the same way, so a new tier is one more implementation of `LowerTier`, not a second
framework:
- the scheduler half asks `lookup` how many leading keys of a prefix the tier can serve, and orders write-backs
  (CPU slots to the tier) and fetches (the tier to CPU slots) as `tier-job`s;
- the worker half, which owns the CPU pool's bytes, calls `submit_write` / `submit_read` with views of CPU slots
  at the start of a step and `poll` once per step; the calls return at once, the bytes move on I/O threads;
- the tier moves each key through the spec's `tier-entry` lifecycle (`kvfsm.tiers.entries.TierEntries` does that
  for it), so the named invariants hold for every implementation and the checks read one shape of record.

A fault is never an exception out of these methods: disk full, an I/O error, a checksum mismatch or a key gone
since the lookup end as a key listed in `TierCompletion.failed`, which the scheduler turns into a miss (the engine
recomputes). Only misuse (a job id submitted twice, a view of the wrong size) raises, before anything changes.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from kvfsm.config import OffloadConfig
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.pool import HostPool
from kvfsm.tiers.entries import TierEntries

T = TypeVar("T")


class TierFailure(str, Enum):
    """Why one key of a tier job did not move."""

    full = "full"  # no room: every slot is being written or read (disk full included)
    io_error = "io-error"  # the operating system or the store refused the I/O
    corrupt = "corrupt"  # the bytes read back do not match the checksum taken when they were written (torn, rotted)
    missing = "missing"  # not published when the job reached the tier: evicted, dropped, or never written
    timeout = "timeout"  # its I/O did not return by the tier's deadline (it may still run: see `held`)


@dataclass(frozen=True, slots=True)
class TierCompletion:
    """A job the tier finished: every key of it moved, except those in `failed` (with the reason for each).

    A job whose deadline passed with I/O still running is reported twice: first with `held=True`, its final
    outcome (every key not yet moved failed with `timeout`) although the tier may still read or write the job's
    buffers; then, once every call of it returned, with `release=True` (and nothing failed): the buffers are the
    caller's again. Between the two the caller keeps the CPU slots held: never freed, loaded or reused.
    """

    job_id: int
    failed: Mapping[int, TierFailure] = field(default_factory=dict)
    held: bool = False
    release: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed

    @classmethod
    def timed_out(cls, job_id: int, keys: Iterable[int], failed: Mapping[int, TierFailure]) -> TierCompletion:
        """The first report of a job past its deadline: every key not already failed failed with `timeout`."""
        return cls(job_id, {**{key: TierFailure.timeout for key in keys}, **failed}, held=True)

    @classmethod
    def ended(cls, job_id: int, held: bool, failed: Mapping[int, TierFailure]) -> TierCompletion:
        """The report of a job whose every call returned: its release if it was reported at its deadline already."""
        return cls(job_id, release=True) if held else cls(job_id, failed)


@dataclass(frozen=True)
class TierSite:
    """Where a tier is opened: what a tier may need to know about the engine beside its own config."""

    offload: OffloadConfig
    block_bytes: int
    """Bytes of one CPU block."""
    worker: int
    """This worker's index (its tensor-parallel rank); `offload.num_workers` is the world size."""
    caches: KVCaches
    """The registered KV caches: how the bytes of a block are laid out."""
    pool: HostPool
    """The CPU pool every view handed to the tier points into."""


class IoExecutor(Protocol):
    """Where a tier runs its blocking I/O: a `concurrent.futures.ThreadPoolExecutor` in production, a manual queue
    (`kvfsm.tiers.io.ManualIo`) in tests, so generated interleavings choose when each read or write happens."""

    def submit(self, fn: Callable[[], T], /) -> Future[T]: ...

    def shutdown(self, wait: bool = True) -> None: ...


class TierMisuse(ValueError):
    """A tier was called with arguments no correct caller passes (a job id twice, mismatched lengths, a view of the
    wrong size); nothing was changed."""


def check_job(tier: str, jobs_in_flight: Mapping[int, object], block_bytes: int, job_id: int,
              keys: Sequence[int], views: Sequence[memoryview]) -> None:
    """Refuse a job a tier cannot take as asked (a misuse, not a fault): a reused job id, keys that do not match
    the blocks one to one, or blocks of another size. Every tier's submit calls it before touching anything."""
    if job_id in jobs_in_flight:
        raise TierMisuse(f"{tier}: job {job_id} is already in flight")
    if len(keys) != len(views) or len(set(keys)) != len(keys):
        raise TierMisuse(f"{tier}: job {job_id} names {len(keys)} keys (distinct?) for {len(views)} blocks")
    wrong = [v.nbytes for v in views if v.nbytes != block_bytes]
    if wrong:
        raise TierMisuse(f"{tier}: blocks of {wrong} bytes, expected {block_bytes}")


@runtime_checkable
class LowerTier(Protocol):
    """One store below the CPU pool, holding whole CPU blocks addressed by their prefix hash (the key)."""

    name: str
    """Unique among a connector's tiers; orders and reports name the tier by it."""
    block_bytes: int
    """Bytes of one CPU block (every view passed in has exactly this size)."""
    entries: TierEntries
    """The `tier-entry` records of the keys this process writes, reads or saw published."""

    def lookup(self, keys: Sequence[int]) -> int:
        """How many leading `keys` are published now. Never counts a key whose write has not completed. Called on
        the scheduler's thread once per lookup: it answers from a local index or one batched query, never waits on
        the bytes."""

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview]) -> None:
        """Start writing each `sources[i]` (a CPU slot, pinned by the caller until this job is reported) under
        `keys[i]`; return at once. A key is published only once its bytes and their checksum are complete in the
        tier. A key already published or being written is skipped (it counts as moved). A key with no room, even
        after the tier's own eviction of published, unpinned keys, fails with `full`."""

    def submit_read(self, job_id: int, keys: Sequence[int], destinations: Sequence[memoryview]) -> None:
        """Start reading each key's bytes into `destinations[i]` (a CPU slot only this job touches); return at once.
        A key not published now fails with `missing` (it was evicted or dropped since the lookup); a read whose
        bytes do not match their checksum fails with `corrupt`. A failed key is dropped from the tier, so the next
        lookup misses it instead of fetching it again. While a key is read it is pinned: not evicted, not
        rewritten."""

    def reads_in_flight(self) -> list[int]:
        """The key of every entry a read in flight holds, once per read: from the `submit_read` that pinned it until
        the `poll` that reported its job (for a job held past its deadline, its release). This tier's own record of
        its reads, which the `read-pins-entry` check holds its entries against."""

    def poll(self) -> list[TierCompletion]:
        """Jobs that finished (or passed their deadline, or were released after it) since the last poll, in
        submission order. Entry transitions (publish, unpin, drop) fire here, on the caller's thread: I/O threads
        only move bytes."""

    def discard(self, keys: Sequence[int]) -> None:
        """Drop these keys if published and not being read (a cache reset, an operator's purge)."""

    def close(self) -> None:
        """Wait for the I/O in flight, then release files, connections and registrations; idempotent."""
