"""The lower tiers as vLLM's scheduler process sees them: an index per tier, fed by the workers' reports.

Under vLLM the tiers' bytes and their own indexes live in the worker processes (one per rank: a disk tier's slot
file, a Mooncake client), out of reach of the scheduler process, which decides every write-back and fetch
(`kvfsm.connector.tier_planner`). `ReportedTier` is the `LowerTier` the planner is built with there: it answers
lookups from an index in the scheduler's memory (a lookup never waits on a disk, a store or a worker, so it never
stalls vLLM's scheduling step), and it moves no bytes: the orders it sees go to the workers in the step's metadata.

Its entries move through the spec's `tier-entry` lifecycle on the connector's machines (traced and checked like the
rest), as this process learns what the ranks did:
- a key is *adopted* (published, `adopted`: this process never wrote it) once every rank reported the write-back
  that carried it done (`every-rank-reports`); a key any rank failed is never published here;
- a fetch pins its keys (`pin`) when it is ordered and unpins them (`read-done`) when every rank reported it, or
  drops those some rank lost (`read-failed`: missing, corrupt, timed out), so the next lookup misses them;
- a key a rank's tier evicted on its own (a full disk making room) is reported by that worker
  (`KvfsmWorkerMetadata.evicted`) and evicted here, so a rank that lost it is never asked for it; one evicted while a
  fetch reads it here is evicted when that fetch ends;
- `discard` (a cache reset) evicts here and queues the keys for every worker's tier (`take_discards`), so bytes from
  before a reset are never adopted again; a write-back in flight at the reset is not adopted when it ends.
A key some rank lost without saying (a store's own eviction, another engine's removal) stays published here until
a fetch of it fails on that rank: a miss, never wrong bytes, since every rank verifies what it reads.
A shared tier also asks its store, within a bounded wait, for keys other engines wrote: a Mooncake tier its master
(`master_lookup.MasterLookup`), a named disk tier its directory (`directory_lookup.DirectoryLookup`): those the store
holds for every rank are adopted here too, except a key a fetch here failed on (the store may hold a value some rank
cannot read: adopting it again would fetch and fail it every step, and the request waiting on it would never run)
until this engine writes it back itself.

With vLLM's KV events on, each index announces the keys it adopts and forgets (`tier_events`), so vLLM's consumers
know what each tier can serve.

Threads: everything here runs on vLLM's scheduler thread (lookups in `get_num_new_matched_tokens`, orders in
`build_connector_meta`, reports in `update_connector_output`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

from kvfsm.config import LowerTierConfig, OffloadConfig
from kvfsm.connector.metadata import TierOrder
from kvfsm.integrations.vllm.directory_lookup import DirectoryLookup
from kvfsm.integrations.vllm.master_lookup import KeyScheme, MasterLookup
from kvfsm.integrations.vllm.tier_events import LOCAL, REMOTE, AnnouncedEntries
from kvfsm.machines import MachineSet
from kvfsm.manager.events import KVCacheEvent
from kvfsm.tier_records import TierEntry, TierJob
from kvfsm.states import TierEntryState, TierJobState
from kvfsm.tiers.entries import TierEntries

SharedStore = MasterLookup | DirectoryLookup
"""Where a shared tier's index asks for keys other engines wrote."""
_RUNNING = frozenset({TierJobState.CREATED, TierJobState.SUBMITTED})
"""A tier job's states before its ranks' outcome is known: the index waits for it."""
SHUNNED_KEYS = 1 << 16
"""How many keys a fetch failed on are kept from being adopted from the store again; the oldest beyond it may be."""


class ReportedTier:
    """One lower tier's index in the scheduler process: the `LowerTier` calls the planner makes, answered from what
    the workers reported."""

    def __init__(self, name: str, block_bytes: int, machines: MachineSet, master: SharedStore | None = None,
                 events: bool = False) -> None:
        """`master`: a shared tier's store (a Mooncake master, a named disk tier's directory), asked for keys this
        index does not know. `events`: record the keys entering and leaving this index for vLLM's KV-event
        consumers (`take_events`)."""
        self.name = name
        self.block_bytes = block_bytes
        self.entries = AnnouncedEntries(name, machines) if events else TierEntries(name, machines)
        self.master = master
        self.locality = REMOTE if isinstance(master, MasterLookup) else LOCAL
        """Where the tier's bytes are, as vLLM's KV events say it: on this host, or in a store shared by engines."""
        self.shown: set[int] = set()
        """Keys adopted because the store held them for every rank (not because this engine wrote them), while
        this index holds them."""
        self._shunned: OrderedDict[int, None] = OrderedDict()
        """Keys a fetch here failed on, not adopted from the store again (oldest first)."""
        self._writes: dict[int, TierJob] = {}
        """Write-backs ordered and not yet ended on every rank."""
        self._reads: dict[int, tuple[TierJob, list[TierEntry]]] = {}
        """Fetches ordered and not yet ended on every rank, with the entries each pinned."""
        self._evict_after_read: set[int] = set()
        """Keys a rank evicted while a fetch here still reads them: evicted when that fetch ends."""
        self._stale: set[int] = set()
        """Keys discarded while a write-back of them was in flight: not adopted when it ends."""
        self._discards: list[int] = []
        """Keys discarded here since the last metadata: every worker's tier discards them too."""

    # --- what the planner calls ------------------------------------------------------------------------------

    @property
    def plan_version(self) -> int | None:
        """The index's count, unless a shared store is asked too (its other writers are not counted here)."""
        return None if self.master is not None else self.entries.version

    def lookup(self, keys: Sequence[int]) -> int:
        count = self.entries.lookup(keys)
        if self.master is None or count == len(keys) or self.entries.get(keys[count]) is not None:
            return count
        for key in keys[count:count + self.master.present(keys[count:])]:
            if key in self._shunned or self.entries.adopt(key) is None:
                break
            self.shown.add(key)
        return self.entries.lookup(keys)

    def discard(self, keys: Sequence[int]) -> None:
        writing = {key for job in self._writes.values() for key in job.keys}
        for key in keys:
            self._forget(key)
            if key in writing:
                self._stale.add(key)
        self._discards.extend(keys)

    def reads_in_flight(self) -> list[int]:
        return [entry.key for _, entries in self._reads.values() for entry in entries]

    # --- what the scheduler side feeds it --------------------------------------------------------------------

    def ordered(self, job: TierJob) -> None:
        """The planner handed `job` to the workers: a fetch pins the keys it reads until every rank reported it."""
        if job.kind == "write-back":
            self._writes[job.job_id] = job
            return
        pinned = [entry for entry in map(self.entries.pin, job.keys) if entry is not None]
        self._reads[job.job_id] = (job, pinned)

    def settle(self) -> None:
        """Apply the outcome of every job of this tier whose ranks all reported (done, failed or abandoned)."""
        for job_id, job in list(self._writes.items()):
            if job.state in _RUNNING:
                continue
            del self._writes[job_id]
            failed = set(job.failed_keys)
            for key in job.keys:
                if key not in failed and key not in self._stale:
                    self.entries.adopt(key)
                    self._shunned.pop(key, None)
            self._stale.difference_update(job.keys)
        for job_id, (job, pinned) in list(self._reads.items()):
            if job.state in _RUNNING:
                continue
            del self._reads[job_id]
            failed = set(job.failed_keys)
            for entry in pinned:
                if entry.key in failed:
                    self.entries.read_failed(entry)
                    self.shown.discard(entry.key)
                    self._shun(entry.key)
                else:
                    self.entries.read_done(entry)
            self.evicted([entry.key for entry in pinned if entry.key in self._evict_after_read])

    def evicted(self, keys: Iterable[int]) -> None:
        """A rank's tier evicted these keys on its own: forget them (after the fetch that reads one, if any)."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.state == TierEntryState.READING:
                self._evict_after_read.add(key)
            else:
                self._evict_after_read.discard(key)
                self._forget(key)

    def _shun(self, key: int) -> None:
        self._shunned[key] = None
        while len(self._shunned) > SHUNNED_KEYS:
            self._shunned.popitem(last=False)

    def _forget(self, key: int) -> None:
        if self.entries.evict(key) is not None:
            self.shown.discard(key)

    def take_discards(self) -> tuple[int, ...]:
        if not self._discards:
            return ()
        discards, self._discards = tuple(self._discards), []
        return discards

    @property
    def discards_pending(self) -> bool:
        return bool(self._discards)

    def take_events(self) -> list[KVCacheEvent]:
        """The keys that entered or left this index since the last call (none unless built with `events`)."""
        return self.entries.take_events() if isinstance(self.entries, AnnouncedEntries) else []


def _shared_store(tier: LowerTierConfig, num_workers: int) -> SharedStore | None:
    """What a tier other engines write too is asked for their keys: a Mooncake tier's master, a named disk tier's
    directory; None for a private disk tier."""
    if tier.kind == "mooncake":
        return MasterLookup(tier, num_workers)  # type: ignore[arg-type]
    return DirectoryLookup(tier, num_workers) if tier.shared else None  # type: ignore[union-attr]


class TierIndexes:
    """Every configured lower tier's `ReportedTier`, in lookup order, and the traffic between them and the step."""

    def __init__(self, config: OffloadConfig, block_bytes: int, machines: MachineSet) -> None:
        self.tiers = tuple(ReportedTier(tier.tier_name, block_bytes, machines, _shared_store(tier, config.num_workers),
                                        events=config.kv_events)
                           for tier in config.lower_tiers)
        self._by_name = {tier.name: tier for tier in self.tiers}

    def ordered(self, orders: Sequence[TierOrder], jobs: Mapping[int, TierJob]) -> None:
        for order in orders:
            self._by_name[order.tier].ordered(jobs[order.job_id])

    def settle(self, evicted: Iterable[tuple[str, int]], schemes: Iterable[tuple[str, int, KeyScheme]]) -> None:
        """After the step's reports reached the planner: the jobs they ended, then the keys ranks evicted, and the
        key schemes ranks of a shared tier told (once each)."""
        for tier in self.tiers:
            tier.settle()
        for name, key in evicted:
            self._by_name[name].evicted((key,))
        for name, rank, scheme in schemes:
            master = self._by_name[name].master
            assert master is not None, f"tier {name!r} has no shared store to look keys up in"
            master.learn(rank, scheme)

    def close(self) -> None:
        for tier in self.tiers:
            if tier.master is not None:
                tier.master.close()

    @property
    def discards_pending(self) -> bool:
        """Some tier has discards the workers have not been sent: vLLM must step once more to send them."""
        return any(tier.discards_pending for tier in self.tiers)

    def take_discards(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(tier, keys) every worker's tier must discard before this step's tier orders."""
        return tuple((tier.name, keys) for tier in self.tiers if (keys := tier.take_discards()))
