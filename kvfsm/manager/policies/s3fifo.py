"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO that quickly demotes one-hit blocks, a main FIFO with a CLOCK
hand for the blocks that proved themselves, and a ghost queue of recently demoted hashes.

Most stored blocks are never hit again (a one-off document, a conversation that ended): they enter the small
queue, about a tenth of the pool, and leave from it without disturbing the main queue. A block hit while in the
small queue moves to main; a block stored again while its hash is a ghost (it left the small queue recently, so
the small queue was too short for it) goes straight to main. Main evicts like CLOCK with a two-bit counter: each
hit raises a block's count (at most 3), and the hand passing a block lowers it; the hand evicts a block whose
count is 0.

Two adaptations keep `victims` a pure question, as the manager's contract demands (`base`): a block hit in the
small queue moves to main at the hit, not when it reaches the small queue's end (the same blocks reach main, a
little earlier); and the CLOCK hand moves only in `remove`, where the manager confirms an eviction: `victims`
answers where the hand would stop, pass after pass, without moving it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvfsm.manager.policies.base import Evictable, EvictionPolicy

MAX_COUNT = 3
"""A main block's count saturates here: the hand passes it at most this many times before evicting it."""
SMALL_SHARE = 0.1
"""The small queue's share of the pool (the paper's 10%)."""


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO over the readable slots; ghosts are hashes, at most as many as the main queue's share."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_target = max(1, int(capacity * SMALL_SHARE))
        self.ghost_limit = max(1, capacity - self.small_target)
        self.small: OrderedDict[int, int] = OrderedDict()  # slot -> hash, oldest first
        self.main: OrderedDict[int, int] = OrderedDict()  # slot -> hash, the CLOCK hand at the front
        self.count: dict[int, int] = {}  # main slot -> hits not yet spent by the hand
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # hashes demoted from small, oldest first

    def insert(self, slot: int, block_hash: int) -> None:
        self.insert_many(((slot, block_hash),))

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        ghosts, small, main, count = self.ghosts, self.small, self.main, self.count
        for slot, block_hash in stored:
            if block_hash in ghosts:
                del ghosts[block_hash]
                main[slot] = block_hash
                count[slot] = 0
            else:
                small[slot] = block_hash

    def touch(self, slot: int) -> None:
        self.touch_many((slot,))

    def touch_many(self, slots: Iterable[int]) -> None:
        small, main, count = self.small, self.main, self.count
        for slot in slots:
            hits = count.get(slot)
            if hits is not None:
                if hits < MAX_COUNT:
                    count[slot] = hits + 1
            elif slot in small:
                main[slot] = small.pop(slot)
                count[slot] = 0

    def remove(self, slot: int) -> None:
        if slot in self.small:
            self.ghosts[self.small.pop(slot)] = None
            if len(self.ghosts) > self.ghost_limit:
                self.ghosts.popitem(last=False)
            return
        main, count = self.main, self.count
        if slot not in main:
            raise KeyError(slot)
        while True:  # the hand passes every block before `slot`, spending one of its hits
            passed, block_hash = main.popitem(last=False)
            if passed == slot:
                del count[slot]
                return
            count[passed] = max(0, count[passed] - 1)
            main[passed] = block_hash

    def clear(self) -> None:
        for part in (self.small, self.main, self.count, self.ghosts):
            part.clear()

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        """From small while it is over its share, then where main's hand would stop, then the rest of small."""
        small = filter(evictable, self.small)
        excess = len(self.small) - self.small_target
        chosen = [slot for _, slot in zip(range(min(n, excess)), small)]  # range first: zip stops before small
        if len(chosen) < n:
            self._main_victims(n, evictable, chosen)
        chosen.extend(slot for _, slot in zip(range(n - len(chosen)), small))
        return chosen if len(chosen) == n else None

    def _main_victims(self, n: int, evictable: Evictable, chosen: list[int]) -> None:
        """On pass p the hand evicts each block whose count was p or less, in queue order."""
        count, taken = self.count, set()
        for spent in range(MAX_COUNT + 1):
            for slot in self.main:
                if count[slot] <= spent and slot not in taken and evictable(slot):
                    chosen.append(slot)
                    taken.add(slot)
                    if len(chosen) == n:
                        return

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, slot: object) -> bool:
        return slot in self.small or slot in self.main
