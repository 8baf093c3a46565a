"""ARC: adaptive replacement between a recency list and a frequency list, steered by ghost lists."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvfsm.manager.policies.base import Evictable, EvictionPolicy


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
        self.insert_many(((slot, block_hash),))

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        """Each (slot, hash) in order: a ghost's return moves `target` and enters T2, anything else enters T1."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for slot, block_hash in stored:
            if block_hash in b1:
                self.target = min(float(self.capacity), self.target + max(len(b2) / len(b1), 1.0))
                del b1[block_hash]
                t2[slot] = block_hash
            elif block_hash in b2:
                self.target = max(0.0, self.target - max(len(b1) / len(b2), 1.0))
                del b2[block_hash]
                t2[slot] = block_hash
            else:
                t1[slot] = block_hash

    def touch(self, slot: int) -> None:
        self.touch_many((slot,))

    def touch_many(self, slots: Iterable[int]) -> None:
        """Each slot in order: a T1 hit moves to T2, a T2 hit becomes T2's most recent."""
        t1, t2 = self.t1, self.t2
        move = t2.move_to_end
        for slot in slots:
            block_hash = t1.pop(slot, None)
            if block_hash is not None:
                t2[slot] = block_hash
            elif slot in t2:
                move(slot)

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
