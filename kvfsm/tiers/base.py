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
recomputes). Only misuse (a job id submitted twice, a view of the wrong size) raises, before anything changes; and a
bug (an error no I/O produces) raises from `poll`, but only once every finished job has settled (see `TierJobs`).

What every tier shares beyond the interface lives here too, so a tier writes only what is its own (a disk its
directory of block files, Mooncake its keys, values and client): `TierJobs` keeps the jobs in flight, their deadline
and the poll loop that settles them into `TierCompletion`s, including the held/release protocol of a job past its
deadline.

Threads: the tier's thread (the worker's, which owns the CPU pool) calls `submit_write`, `submit_read`, `poll`,
`reads_in_flight`, `discard` and `close`; the scheduler's thread calls `lookup` (in-process, the same thread in the
reference engine). I/O threads (an `kvfsm.io_executor.IoExecutor`) only run the calls a job submitted, which move
bytes and compute checksums and settle their futures; `TierJobs` and the `tier-entry` records are read and written
on the tier's thread alone, in `submit_*` and `poll`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

from kvfsm.config import OffloadConfig
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.pool import HostPool
from kvfsm.mooncake.keys import KvNamespace
from kvfsm.tier_records import TierEntry
from kvfsm.tiers.entries import TierEntries

log = logging.getLogger(__name__)

IoKind = Literal["write", "read"]


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
    checksums: Mapping[int, int | None] = field(default_factory=dict)
    """Of a read, for each key it moved: the block checksum the tier keeps with the key's bytes, i.e. the one its
    write was handed (taken when the block was first stored in the CPU pool); where it was handed none, a CRC-32
    the tier took of the bytes it wrote, or None. The worker checks the CPU slot's next load against it."""

    @property
    def ok(self) -> bool:
        return not self.failed

    @classmethod
    def timed_out(cls, job_id: int, keys: Iterable[int], failed: Mapping[int, TierFailure]) -> TierCompletion:
        """The first report of a job past its deadline: every key not already failed failed with `timeout`."""
        return cls(job_id, {**{key: TierFailure.timeout for key in keys}, **failed}, held=True)

    @classmethod
    def ended(cls, job_id: int, held: bool, failed: Mapping[int, TierFailure],
              checksums: Mapping[int, int | None]) -> TierCompletion:
        """The report of a job whose every call returned: its release if it was reported at its deadline already."""
        return cls(job_id, release=True) if held else cls(job_id, failed, checksums=checksums)


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

    def namespace(self, model_id: str, dtype: str) -> KvNamespace:
        """What a block stored from this site is the KV of, beside its prefix hash: the model, dtype, layout, block
        size and shard. A tier that stores blocks where other engines (or a later one) read them names them by it.
        With replicated KV a block is every head's KV, what a TP=1 engine's block is: it is named as rank 0 of one,
        so engines of any TP size holding the model's replicated KV read it."""
        offload = self.offload
        rank, world = (0, 1) if offload.replicated else (self.worker, offload.num_workers)
        return KvNamespace(model_id=model_id, dtype=dtype, layout=layout_of(self.caches),
                           block_tokens=offload.cpu_block_tokens, tp_rank=rank, tp_world_size=world)


def layout_of(caches: KVCaches) -> str:
    """Where each piece of a block lives in a CPU block: layouts per group, then each plane's name, piece count,
    piece size and offset. Two engines whose KV bytes are arranged differently get different namespaces."""
    groups = ",".join(f"{group}={layout}" for group, layout in sorted(caches.layouts.items()))
    planes = ",".join(f"{p.name}:{p.pieces}x{p.piece_bytes}@{p.offset}" for p in caches.planes)
    return f"{groups};{planes}"


class TierMisuse(ValueError):
    """A tier was called with arguments no correct caller passes (a job id twice, mismatched lengths, a view of the
    wrong size); nothing was changed."""


@runtime_checkable
class LowerTier(Protocol):
    """One store below the CPU pool, holding whole CPU blocks addressed by their prefix hash (the key)."""

    name: str
    """Unique among a connector's tiers; orders and reports name the tier by it."""
    block_bytes: int
    """Bytes of one CPU block (every view passed in has exactly this size)."""
    entries: TierEntries
    """The `tier-entry` records of the keys this process writes, reads or saw published."""

    @property
    def plan_version(self) -> int | None:
        """A count that changes whenever `lookup` or `entries` may answer differently, so a plan read from them (the
        on-evict write-back look-ahead) still holds while it is unchanged; None when lookups also ask a store other
        engines write (a shared tier), whose changes this process cannot count."""

    def lookup(self, keys: Sequence[int]) -> int:
        """How many leading `keys` are published now. Never counts a key whose write has not completed. Called on
        the scheduler's thread once per lookup: it answers from a local index or one batched query, never waits on
        the bytes."""

    def submit_write(self, job_id: int, keys: Sequence[int], sources: Sequence[memoryview],
                     checksums: Sequence[int | None] = ()) -> None:
        """Start writing each `sources[i]` (a CPU slot, pinned by the caller until this job is reported) under
        `keys[i]`; return at once. A key is published only once its bytes and their checksum are complete in the
        tier. A key already published or being written is skipped (it counts as moved). A key with no room, even
        after the tier's own eviction of published, unpinned keys, fails with `full`. `checksums[i]` (when given:
        the engine runs with `OffloadConfig.checksum`) is the block's checksum taken when it was first stored: the
        tier keeps it with the bytes and hands it back with every read of them (`TierCompletion.checksums`)."""

    def submit_read(self, job_id: int, keys: Sequence[int], destinations: Sequence[memoryview]) -> None:
        """Start reading each key's bytes into `destinations[i]` (a CPU slot only this job touches); return at once.
        A key not published now fails with `missing` (it was evicted or dropped since the lookup); a read whose
        bytes do not match their checksum fails with `corrupt`. The job's completion hands back, per key moved, the
        block checksum its write was handed. A failed key is dropped from the tier, so the next
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


# --- what every tier shares: its jobs in flight, their deadline, the poll loop ------------------------------


class JobCalls(Protocol):
    """The I/O one job started: one answer per entry of the job, once every call of it returned (or will never
    run). An answer is the call's value (the checksum of the block written or read) or the exception it ended with."""

    @property
    def deadline(self) -> float:
        """When the job counts as hung if its calls have not all returned (on the clock of its `TierJobs`)."""

    def poll(self, now: float) -> Sequence[object] | None:
        """Each entry's answer (a write's: the entry's checksum; a read's: the block checksum stored with the key,
        or None), in the job's entry order; None while a call may still touch the job's buffers."""


class FutureCalls:
    """`JobCalls` of a tier that submits one executor call per entry (the disk tier)."""

    def __init__(self, futures: Sequence[Future], deadline: float) -> None:
        self._futures = list(futures)
        self.deadline = deadline

    def poll(self, now: float) -> list[object] | None:
        if not all(future.done() for future in self._futures):
            return None
        return [future.exception() or future.result() for future in self._futures]


@dataclass
class IoJob:
    """One job a tier took: the entries its calls move, the keys that failed before any call, and whether it was
    reported at its deadline already."""

    kind: IoKind
    entries: list[TierEntry]
    calls: JobCalls
    failed: dict[int, TierFailure] = field(default_factory=dict)
    held: bool = False
    """Reported failed (`timeout`) at its deadline while its calls still run; released once they all returned."""
    checksums: dict[int, int | None] = field(default_factory=dict)
    """Of a read: the block checksum each key's call answered, for `TierCompletion.checksums`."""


Reason = Callable[[BaseException], TierFailure | None]
"""A tier's reading of an error its I/O ended with: the failure it means, or None for an error no I/O produces (a
bug, which must not pass as a miss)."""

Settled = Callable[[IoKind, TierEntry, TierFailure | None], None]
"""What a tier does of its own once an entry's call settled (Mooncake shuns a key whose value failed its check)."""


def _nothing_more(kind: IoKind, entry: TierEntry, failure: TierFailure | None) -> None:
    """The `Settled` of a tier with nothing of its own to do once an entry settled."""


@dataclass
class TierJobs:
    """A tier's jobs in flight, their deadline and the poll loop every tier shares.

    `poll` turns each job whose calls all returned into one `TierCompletion`, firing each entry's `tier-entry`
    transition (publish or forget a write, unpin or drop a read), the head of a prefix last so that it is the most
    recently used. A job still running at its deadline is reported once with `held=True` (every key not moved failed
    `timeout`) and once more, with `release=True`, when its calls returned. Used from the tier's thread only.
    """

    label: str
    """How messages name the tier (`disk tier 'disk'`)."""
    entries: TierEntries
    block_bytes: int
    reason: Reason
    settled: Settled = _nothing_more
    clock: Callable[[], float] = time.monotonic
    """What deadlines are measured on (tests pass a clock that moves only when they say the I/O hung)."""
    _jobs: dict[int, IoJob] = field(default_factory=dict, init=False)
    _unreported: list[TierCompletion] = field(default_factory=list, init=False)
    """Completions settled by a `poll` that then raised a bug: the next `poll` reports them."""

    def check(self, job_id: int, keys: Sequence[int], views: Sequence[memoryview]) -> None:
        """Refuse a job the tier cannot take as asked (a misuse, not a fault): a reused job id, keys that do not
        match the blocks one to one, or blocks of another size. Every submit calls it before touching anything."""
        if job_id in self._jobs:
            raise TierMisuse(f"{self.label}: job {job_id} is already in flight")
        if len(keys) != len(views) or len(set(keys)) != len(keys):
            raise TierMisuse(f"{self.label}: job {job_id} names {len(keys)} keys (distinct?) for {len(views)} blocks")
        wrong = [v.nbytes for v in views if v.nbytes != self.block_bytes]
        if wrong:
            raise TierMisuse(f"{self.label}: blocks of {wrong} bytes, expected {self.block_bytes}")

    def start(self, job_id: int, job: IoJob) -> None:
        self._jobs[job_id] = job

    @property
    def busy(self) -> bool:
        """Some job was submitted and not yet reported by `poll`."""
        return bool(self._jobs)

    def reads_in_flight(self) -> list[int]:
        return [entry.key for job in self._jobs.values() if job.kind == "read" for entry in job.entries]

    def poll(self) -> list[TierCompletion]:
        """Settle every job that ended or passed its deadline, in submission order. An answer no I/O produces (a
        bug) fails its key `io-error` like a fault would, and is raised once every job settled; the completions of
        that poll are reported by the next one."""
        finished, self._unreported = self._unreported, []
        bugs: list[BaseException] = []
        now = self.clock()
        for job_id, job in list(self._jobs.items()):
            try:
                answers = job.calls.poll(now)
            except Exception as error:  # noqa: BLE001 - a call that raised out of its future: every key failed
                answers = [error] * len(job.entries)
            if answers is None:
                if not job.held and now >= job.calls.deadline:  # hung I/O: fail it now, keep its buffers
                    job.held = True
                    log.warning("%s: %s job %d: still running past its deadline", self.label, job.kind, job_id)
                    finished.append(TierCompletion.timed_out(job_id, (e.key for e in job.entries), job.failed))
                continue
            del self._jobs[job_id]
            for entry, answer in reversed(list(zip(job.entries, answers, strict=True))):
                self._settle(job, entry, answer, bugs)
            finished.append(TierCompletion.ended(job_id, job.held, job.failed, job.checksums))
        if bugs:
            self._unreported = finished
            raise bugs[0] if len(bugs) == 1 else ExceptionGroup(f"{self.label}: errors no I/O produces", bugs)
        return finished

    def _settle(self, job: IoJob, entry: TierEntry, answer: object, bugs: list[BaseException]) -> None:
        if not isinstance(answer, BaseException):  # a write's answer: the entry's checksum; a read's: the block's
            if job.kind == "read":
                job.checksums[entry.key] = answer  # type: ignore[assignment]
            self.entries.settle(job.kind, entry, checksum=answer)  # type: ignore[arg-type]
            self.settled(job.kind, entry, None)
            return
        failure = self.reason(answer)
        if failure is None:
            bugs.append(answer)
            failure = TierFailure.io_error
        log.warning("%s: %s of key %#x: %s: %s", self.label, job.kind, entry.key, type(answer).__name__, answer)
        job.failed[entry.key] = failure
        self.entries.settle(job.kind, entry, failed=True)
        self.settled(job.kind, entry, failure)
