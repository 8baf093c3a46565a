"""LRU: the least recently stored or hit slot goes first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvfsm.manager.policies.base import Evictable, EvictionPolicy, take


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
        return take(n, filter(evictable, self.order))

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, slot: object) -> bool:
        return slot in self.order
