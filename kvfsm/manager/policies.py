"""Eviction policies: which readable slots of the host pool to give up when a store needs room.

A policy only orders slots; it never moves a block. It holds exactly the slots whose blocks are readable (ready
or loading) and learns of every change from the manager: `insert` when a store completes, `touch` on a hit,
`remove` when the manager evicted a slot it picked, `clear` on a cache reset. `victims` is a pure question: the
manager passes which slots may go (unpinned ready blocks, not part of the store being planned) and fires `evict`
through the machine only once the whole plan fits, so a refused store leaves the policy untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Literal

PolicyName = Literal["lru", "arc"]
Evictable = Callable[[int], bool]


class UnknownPolicy(ValueError):
    """The manager was asked for a policy name this module does not provide."""


class EvictionPolicy(ABC):
    """The interface the manager drives; `capacity` is the pool's slot count, which the policy never exceeds."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, slot: int, block_hash: int) -> None:
        """`slot` now holds `block_hash` and is readable."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """`slot` was hit by a lookup; ignored when the policy does not hold it."""

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
        """The manager evicted `slot` (one `victims` picked)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, history included: the pool's contents were dropped."""

    @abstractmethod
    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        """`n` distinct slots for which `evictable` holds, best victim first, or None when fewer exist."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of slots held."""

    @abstractmethod
    def __contains__(self, slot: object) -> bool: ...


def _take(n: int, candidates: Iterator[int]) -> list[int] | None:
    chosen = [slot for _, slot in zip(range(n), candidates)]
    return chosen if len(chosen) == n else None


class LruPolicy(EvictionPolicy):
    """Least recently stored or hit goes first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[int, int] = OrderedDict()  # slot -> hash, least recent first

    def insert(self, slot: int, block_hash: int) -> None:
        self.order[slot] = block_hash

    def touch(self, slot: int) -> None:
        if slot in self.order:
            self.order.move_to_end(slot)

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        order = self.order
        for slot, block_hash in stored:
            order[slot] = block_hash

    def touch_many(self, slots: Iterable[int]) -> None:
        order, move = self.order, self.order.move_to_end
        for slot in slots:
            if slot in order:
                move(slot)

    def remove(self, slot: int) -> None:
        del self.order[slot]

    def clear(self) -> None:
        self.order.clear()

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        return _take(n, filter(evictable, self.order))

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, slot: object) -> bool:
        return slot in self.order


class ArcPolicy(EvictionPolicy):
    """Adaptive replacement: recency (T1, seen once) and frequency (T2, hit since stored) balanced by `target`.

    B1 and B2 remember the hashes recently evicted from T1 and T2. Storing a hash again that B1 remembers means T1
    was too small, so `target` (T1's share of the pool) grows; one that B2 remembers shrinks it. A one-off scan
    fills T1 only, so it cannot flush the hit blocks of T2 the way it flushes an LRU.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[int, int] = OrderedDict()  # slot -> hash, least recent first
        self.t2: OrderedDict[int, int] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghost hashes, oldest first
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.target = 0.0

    def insert(self, slot: int, block_hash: int) -> None:
        if block_hash in self.b1:
            self.target = min(float(self.capacity), self.target + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[block_hash]
            self.t2[slot] = block_hash
        elif block_hash in self.b2:
            self.target = max(0.0, self.target - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[block_hash]
            self.t2[slot] = block_hash
        else:
            self.t1[slot] = block_hash

    def touch(self, slot: int) -> None:
        if slot in self.t1:
            self.t2[slot] = self.t1.pop(slot)
        elif slot in self.t2:
            self.t2.move_to_end(slot)

    def remove(self, slot: int) -> None:
        if slot in self.t1:
            self.b1[self.t1.pop(slot)] = None
        else:
            self.b2[self.t2.pop(slot)] = None
        self._bound_ghosts()

    def _bound_ghosts(self) -> None:
        """Keep B1 + B2 within capacity, dropping from B1 first while T1 and B1 together overflow the pool."""
        while len(self.b1) + len(self.b2) > self.capacity:
            ghosts = self.b1 if len(self.t1) + len(self.b1) > self.capacity else self.b2
            ghosts.popitem(last=False)

    def clear(self) -> None:
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target = 0.0

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        t1 = filter(evictable, self.t1)
        t2 = filter(evictable, self.t2)
        t1_size = len(self.t1)
        chosen: list[int] = []
        while len(chosen) < n:
            first, second = (t1, t2) if t1_size > self.target else (t2, t1)
            slot = next(first, None)
            if slot is None:
                slot = next(second, None)
                if slot is None:
                    return None
            if slot in self.t1:
                t1_size -= 1
            chosen.append(slot)
        return chosen

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, slot: object) -> bool:
        return slot in self.t1 or slot in self.t2


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LruPolicy, "arc": ArcPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise UnknownPolicy(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
