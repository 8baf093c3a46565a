"""KV-cache events for the lower tiers under vLLM: which prefixes each tier below the CPU pool can serve.

vLLM publishes a connector's `take_events()` to its KV-event consumers (a router placing requests where their prefix
is cached). kvfsm announces the CPU pool's blocks with vLLM's `MEDIUM_CPU`; a lower tier's keys are announced as
the scheduler process sees them, in its index of that tier (`tier_index.ReportedTier`), which decides every fetch:
a key is stored once the index adopts it (its write-back ended on every rank, or the tier's master holds it for
every rank) and removed once the index forgets it (a rank's tier evicted it, a fetch of it failed, a cache reset
discarded it). Replaying a tier's events in order yields the keys its index can serve: published or being read.

Consumers tell the tiers apart as they tell vLLM's own secondary tiers apart: `medium` is `MEDIUM_STORAGE`,
`locality` is `LOCAL` for a tier on this host (disk) or `REMOTE` for a shared store (Mooncake), and `ownership`
names the tier (its `name` in `kv_connector_extra_config`).

Threads: everything here runs on vLLM's scheduler thread, as the index does.
"""

from __future__ import annotations

from typing import Callable

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvfsm.machines import MachineSet
from kvfsm.manager.events import BlockRemoved as KvfsmBlockRemoved
from kvfsm.manager.events import BlockStored as KvfsmBlockStored
from kvfsm.manager.events import KVCacheEvent as KvfsmEvent
from kvfsm.tier_records import TierEntry
from kvfsm.tiers.entries import TierEntries

LOCAL, REMOTE = "LOCAL", "REMOTE"
"""vLLM's localities of a tier's storage relative to the engine that publishes the event."""


class AnnouncedEntries(TierEntries):
    """A scheduler-side tier index's entries that also record each key entering (adopted) or leaving (evicted,
    dropped after a failed read) the set a lookup can be served from. The scheduler's index only adopts: it never
    writes a key itself, so `publish` needs no event."""

    def __init__(self, tier: str, machines: MachineSet) -> None:
        super().__init__(tier, machines)
        self._events: list[KvfsmEvent] = []

    def adopt(self, key: int) -> TierEntry | None:
        entry = super().adopt(key)
        if entry is not None:
            self._events.append(KvfsmBlockStored((key,)))
        return entry

    def evict(self, key: int) -> TierEntry | None:
        entry = super().evict(key)
        if entry is not None:
            self._events.append(KvfsmBlockRemoved((key,)))
        return entry

    def read_failed(self, entry: TierEntry) -> None:
        super().read_failed(entry)
        self._events.append(KvfsmBlockRemoved((entry.key,)))

    def take_events(self) -> list[KvfsmEvent]:
        events, self._events = self._events, []
        return events


def to_vllm(event: KvfsmEvent, to_bytes: Callable[[int], bytes], medium: str, locality: str | None = None,
            ownership: str | None = None) -> KVCacheEvent:
    """One of kvfsm's events as vLLM's, its hashes in vLLM's form, marked with where the blocks are."""
    hashes = [to_bytes(h) for h in event.hashes]
    if isinstance(event, KvfsmBlockStored):
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                           medium=medium, lora_name=None, locality=locality, ownership=ownership)
    return BlockRemoved(block_hashes=hashes, medium=medium, locality=locality, ownership=ownership)
