"""A lower tier's index of keys, every change fired through the spec's `tier-entry` machine.

Shared by every `LowerTier` implementation: it owns the records, the order in which published keys were last used
(the tier's own eviction picks the least recent that is not being read) and, for the `lookup-published` check, the
state of every key a lookup counted when it counted it. An entry that returns to `empty` is forgotten: the index
follows the transition the spec took, so a spec that left the entry elsewhere keeps it where checks see it.

The machine set is always the caller's (the connector's, handed down through `kvfsm.tiers.factory.open_tiers`), never
a global one: an observer of the connector's machines (a trace, a check) then sees every tier transition, and a tier
built without one is refused at construction instead of moving its entries where nobody watches.

Threads: used only from its tier's thread (`lookup` from the scheduler's, which in-process is the same thread).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Iterator, Sequence

from kvfsm.machines import LifecycleMachine, MachineSet
from kvfsm.tier_records import TierEntry
from kvfsm.states import TierEntryState

PUBLISHED, EMPTY = TierEntryState.PUBLISHED, TierEntryState.EMPTY


class TierEntries:
    def __init__(self, tier: str, machines: MachineSet, keep_lookups: bool = False, bound: int | None = None) -> None:
        """`machines`: the connector's machine set, so its observers trace this tier too. `bound`: at most this many
        keys published or being read are remembered; publishing or adopting one more evicts the least recently used
        (None: the tier bounds its keys itself, as a disk does by its slots)."""
        if not isinstance(machines, MachineSet):
            raise TypeError(f"tier {tier!r}: its entries need the connector's MachineSet, got {machines!r}")
        self.tier = tier
        """The tier's name, read by the census of a soak (`kvfsm.testing.census`, by `getattr`): it counts this index's
        structures under it, so a disk's entries and a shared store's are told apart."""
        self.by_key: dict[int, TierEntry] = {}
        self._recency: OrderedDict[int, None] = OrderedDict()  # published keys, least recently used first
        self._machine: LifecycleMachine = machines["tier-entry"]
        self.keep_lookups = keep_lookups
        self.bound = bound
        self.lookups: list[tuple[int, str]] = []
        """(key, state when counted) for every key a lookup counted, kept only when `keep_lookups` (tests)."""
        self.version = 0
        """Changes with every transition of an entry (every key that enters, leaves or changes state): what `get`
        and `lookup` answer is the same while it is unchanged."""

    def _fire(self, entry: TierEntry, trigger: str, **context: object) -> str:
        """Every entry transition of the index, counted in `version`."""
        self.version += 1
        return self._machine.fire(entry, trigger, **context)

    def __iter__(self) -> Iterator[TierEntry]:
        return iter(self.by_key.values())

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: int) -> TierEntry | None:
        return self.by_key.get(key)

    def published_prefix(self, keys: Sequence[int]) -> int:
        """Leading keys that are published now (what `lookup` answers, without logging it)."""
        count = 0
        for key in keys:
            entry = self.by_key.get(key)
            if entry is None or entry.state != PUBLISHED:
                break
            count += 1
        return count

    def lookup(self, keys: Sequence[int]) -> int:
        """Leading keys that are published now."""
        count = self.published_prefix(keys)
        if self.keep_lookups:
            self.lookups.extend((key, self.by_key[key].state) for key in keys[:count])
        return count

    def reserve(self, key: int, slot: int | None = None) -> TierEntry | None:
        """A new entry writing `key` (at `slot`), or None when the key is already held in any state."""
        if key in self.by_key:
            return None
        entry = TierEntry(key, slot)
        self._fire(entry, "reserve")
        self.by_key[key] = entry
        return entry

    def publish(self, entry: TierEntry, checksum: int) -> None:
        self._fire(entry, "write-done", checksum=checksum)
        self._recency[entry.key] = None
        self._forget_beyond_bound()

    def adopt(self, key: int) -> TierEntry | None:
        """A published entry for `key`, which a shared store showed complete though this process did not write it;
        None (and no change) when the key is already held in any state."""
        if key in self.by_key:
            return None
        entry = TierEntry(key)
        self._fire(entry, "adopt")
        self.by_key[key] = entry
        self._recency[key] = None
        self._forget_beyond_bound()
        return entry

    def settle(self, kind: str, entry: TierEntry, checksum: int | None = None, failed: bool = False) -> None:
        """The end of a tier's `kind` ("write" or "read") call on `entry`: a write publishes the key with its
        `checksum`, or forgets it if it failed; a read unpins it, or drops the key if it failed (the next lookup
        misses)."""
        if kind == "write":
            self.write_failed(entry) if failed else self.publish(entry, checksum)  # type: ignore[arg-type]
        else:
            self.read_failed(entry) if failed else self.read_done(entry)

    def write_failed(self, entry: TierEntry) -> None:
        self._forget_if_empty(entry, self._fire(entry, "write-failed"))

    def pin(self, key: int) -> TierEntry | None:
        """The published entry of `key`, now reading; None (and no change) when it is not published."""
        entry = self.by_key.get(key)
        if entry is None or entry.state != PUBLISHED:
            return None
        self._fire(entry, "pin")
        self._recency.move_to_end(key)
        return entry

    def read_done(self, entry: TierEntry) -> None:
        self._fire(entry, "read-done")

    def read_failed(self, entry: TierEntry) -> None:
        self._forget_if_empty(entry, self._fire(entry, "read-failed"))

    def evict(self, key: int) -> TierEntry | None:
        """Evict `key` if it is published (not being written or read); the evicted entry, else None."""
        entry = self.by_key.get(key)
        if entry is None or entry.state != PUBLISHED:
            return None
        self._forget_if_empty(entry, self._fire(entry, "evict"))
        return entry

    def least_recent_evictable(self, keep: Collection[int] = ()) -> int | None:
        """The published key used longest ago, other than those in `keep`; reading keys are pinned and skipped."""
        return next((k for k in self._recency if self.by_key[k].state == PUBLISHED and k not in keep), None)

    def _forget_beyond_bound(self) -> None:
        """Evict the least recently used published keys while more than `bound` are remembered; keys being read
        are pinned and stay (the bound is then exceeded by reads in flight only, until they end)."""
        while self.bound is not None and len(self._recency) > self.bound:
            key = self.least_recent_evictable()
            if key is None:
                return
            self.evict(key)

    def _forget_if_empty(self, entry: TierEntry, state: str) -> None:
        if state == EMPTY:
            del self.by_key[entry.key]
            self._recency.pop(entry.key, None)
