"""The eviction-policy interface: which readable slots of the host pool to give up when a store needs room.

A policy only orders slots; it never moves a block. Every state change of a block goes through the spec's
`cpu-block` machine, fired by the manager (`kvfsm.manager.catalogue`), so a policy can make the pool evict
badly but, within this contract, never unsafely. The contract is what `python -m kvfsm.testing.conformance`
checks for any policy (docs/configuration.md, "Eviction policies").

What the manager guarantees the policy:
- `insert(slot, block_hash)` exactly when `slot`'s block became readable (a store or a fetch completed), for a
  slot the policy does not hold, `0 <= slot < capacity`; a batch arrives through `insert_many`, the head of a
  prefix last (a block's hash covers its whole prefix, so the tail of a prefix is worth least).
- `touch(slot)` for a hit on a slot the policy holds (`touch_many`, head of the prefix last).
- `remove(slot)` for a held slot that left the pool: one `victims` just picked, or one a failed write-back took
  out of the catalogue.
- `clear()` when the pool's contents were dropped (a cache reset).
- `victims(n, evictable)` with `n >= 1`; `evictable(slot)` holds only for ready, unpinned blocks outside the store
  being planned. The manager evicts the answer in order (calling `remove` on each) or, when the plan does not fit,
  not at all; others (the write-back look-ahead) ask without evicting.

What the policy must never do:
- answer anything but `n` distinct held slots for which `evictable` holds, or None when there are fewer: a slot
  being loaded, stored, written back or planned is never a victim (the manager refuses such an answer with
  `PolicyViolation` before anything moves; the conformance suite names the broken rule);
- change its state in `victims`: it is a question, asked also when nothing will be evicted;
- hold more than `capacity` slots, or keep history (ghosts, counters) that grows beyond a bound set by `capacity`;
- call back into the manager, or depend on anything but the calls above (the conformance suite replays them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Iterator

Evictable = Callable[[int], bool]
"""The manager's answer to "may this slot be evicted now?"."""


class EvictionPolicy(ABC):
    """The interface the manager drives (contract in the module docstring); `capacity` is the pool's slot count.

    A user's policy subclasses this and names itself in `OffloadConfig.eviction` as `package.module:ClassName`;
    it is built as `ClassName(capacity)`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, slot: int, block_hash: int) -> None:
        """`slot` now holds `block_hash` and is readable."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """`slot` was hit by a lookup."""

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        """`insert` each (slot, hash) in order: a store's blocks, as its completion makes them readable."""
        for slot, block_hash in stored:
            self.insert(slot, block_hash)

    def touch_many(self, slots: Iterable[int]) -> None:
        """`touch` each slot in order: a hit on a prefix."""
        for slot in slots:
            self.touch(slot)

    @abstractmethod
    def remove(self, slot: int) -> None:
        """`slot` left the pool (evicted, or taken out of the catalogue)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, history included: the pool's contents were dropped."""

    @abstractmethod
    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        """`n` distinct held slots for which `evictable` holds, best victim first, or None when fewer exist."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of slots held."""

    @abstractmethod
    def __contains__(self, slot: object) -> bool:
        """Whether `slot` is held."""


def take(n: int, candidates: Iterator[int]) -> list[int] | None:
    """The first `n` of `candidates`, or None when there are fewer: the common end of `victims`."""
    chosen = [slot for _, slot in zip(range(n), candidates)]
    return chosen if len(chosen) == n else None
