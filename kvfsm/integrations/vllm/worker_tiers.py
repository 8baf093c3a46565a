"""The worker's side of the lower tiers under vLLM: what the scheduler's index of each tier must hear, and what the
scheduler's metadata asks of the tiers beyond their jobs.

The tiers open in the worker (it owns the CPU pool's bytes) and run the scheduler's tier orders through
`kvfsm.connector.worker.WorkerConnector`; their job reports travel with the transfer jobs'. Beside those:
- keys a tier evicted on its own (a write that found no free slot made room) go to the scheduler, whose index
  forgets them (`TierEvictions`, observing the worker's `tier-entry` machine);
- each shared tier's key namespace goes to the scheduler once, so it can ask the tier's store for keys other
  engines wrote (a Mooncake tier's master, `master_lookup`; a named disk tier's directory, `directory_lookup`);
- keys the scheduler's index dropped (a cache reset) are dropped from every tier here (`tier_discards`), and the
  keys of a fetch from a shared tier that this worker never saw are adopted first: the scheduler saw the store hold
  them for every rank, and every read verifies what it reads (a Mooncake value's sealed MAC, a block file's record
  and CRC-32). A disk tier adopts only the whole files it finds, making room as for a write.

Threads: everything here runs on the worker's thread.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvfsm.integrations.vllm.convert import KvfsmMetadata
from kvfsm.integrations.vllm.master_lookup import KeyScheme
from kvfsm.machines import MachineSet
from kvfsm.tiers.base import LowerTier
from kvfsm.tiers.disk import DiskTier


class TierEvictions:
    """Observes the worker's `tier-entry` machine for keys its tiers evicted, by tier; `take` hands over those the
    tier still does not hold (a key written again since is news to no one). The scheduler's own discards come back
    too, which its index ignores."""

    def __init__(self, machines: MachineSet) -> None:
        self.tiers: Sequence[LowerTier] = ()
        self._evicted: list[tuple[str, int]] = []
        machines["tier-entry"].observers.append(self)

    def __call__(self, lifecycle: str, entry: Any, source: str, trigger: str, dest: str) -> None:
        if trigger == "evict":  # called before the index forgets the entry: the tier holding it is still known
            self._evicted += [(tier.name, entry.key) for tier in self.tiers if tier.entries.get(entry.key) is entry]

    def take(self) -> tuple[tuple[str, int], ...]:
        evicted, self._evicted = self._evicted, []
        held = {tier.name: tier.entries for tier in self.tiers}
        return tuple((name, key) for name, key in evicted if held[name].get(key) is None)


def _scheme(tier: Any) -> KeyScheme:
    """How a shared tier names a block: a disk tier's namespace (its directory) and block bytes (its files' size);
    a Mooncake tier's namespace (`MooncakeTier.namespace`), and its head split if per head."""
    if isinstance(tier, DiskTier):
        return KeyScheme(tier.files.namespace, block_bytes=tier.block_bytes)
    return KeyScheme(tier.namespace, None if tier.heads is None else tier.heads.kv_heads)


def _adopt(tier: LowerTier, keys: Sequence[int]) -> None:
    """Take on the keys of a fetch the scheduler saw in a shared tier's store: a disk tier adopts the leading whole
    files it finds (its lookup, which makes room as a write does); a Mooncake tier each key it does not hold."""
    if isinstance(tier, DiskTier):
        tier.lookup(keys)
        return
    for key in keys:
        if tier.entries.get(key) is None:
            tier.entries.adopt(key)


class WorkerTiers:
    def __init__(self, machines: MachineSet, shared: Sequence[str]) -> None:
        """`shared`: the names of the tiers other engines write too (Mooncake, named disk tiers)."""
        self.evictions = TierEvictions(machines)
        self._shared = frozenset(shared)
        self._tiers: dict[str, LowerTier] = {}
        self._namespaces: tuple[tuple[str, int, KeyScheme], ...] = ()

    def opened(self, tiers: Sequence[LowerTier], rank: int) -> None:
        """The worker registered its caches and opened `tiers`: the shared ones' namespaces go out first."""
        self._tiers = {tier.name: tier for tier in tiers}
        self.evictions.tiers = tiers
        self._namespaces = tuple((tier.name, rank, _scheme(tier)) for tier in tiers if tier.name in self._shared)

    def apply(self, meta: KvfsmMetadata) -> None:
        """Before the step's tier orders run: drop what the scheduler dropped, adopt what it fetches from a shared
        tier."""
        for name, keys in meta.tier_discards:
            self._tiers[name].discard(keys)
        for order in meta.orders.tier_orders:
            if order.kind == "fetch" and order.tier in self._shared:
                _adopt(self._tiers[order.tier], order.keys)

    def take(self) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int, KeyScheme], ...]]:
        """Keys evicted since the last report, and the shared tiers' namespaces if not sent yet."""
        namespaces, self._namespaces = self._namespaces, ()
        return self.evictions.take(), namespaces
