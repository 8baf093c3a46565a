"""W-TinyLFU (Einziger, Friedman and Manes, 2017; Caffeine's design): a small LRU window for new blocks, and a
segmented LRU main space that a block enters only if it is stored or hit more often than the block it would push
out, by a count-min sketch's estimate (`sketch`).

The window (1% of the pool) lets a burst of new blocks be hit once before any judgement. When the window
overflows, its least recent block is the candidate; with the main space full, it duels the main space's next
victim (the least recent probation block): the one the sketch counts less often loses, ties against the
candidate. Main is split into probation (blocks not hit since they entered) and protected (hit there; 80% of
main, its overflow demoted back to probation), so a one-off scan churns the window and probation only.

One adaptation: a manager's pool evicts only when a store needs room, after the store's duel was decided, so
the loser is not evicted at once but joins the "doomed" queue, which `victims` empties first. `victims` itself is
a pure question (the manager's contract, `base`): doomed, then probation, then protected, then the window.
The window's size is fixed (Caffeine adapts it by hill climbing).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Iterable

from kvfsm.manager.policies.base import Evictable, EvictionPolicy, take
from kvfsm.manager.policies.sketch import Cells, FrequencySketch

WINDOW_SHARE = 0.01
PROTECTED_SHARE = 0.8
"""The protected segment's share of the main space."""


class TinyLfuPolicy(EvictionPolicy):
    """W-TinyLFU over the readable slots; every part maps slot -> its hash's `cells` in the sketch (all a duel or a hit
    reads of the hash, kept so neither mixes it again), least recent (or oldest) first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.window_target = max(1, int(capacity * WINDOW_SHARE))
        self.main_target = max(1, capacity - self.window_target)
        self.protected_target = int(self.main_target * PROTECTED_SHARE)
        self.window: OrderedDict[int, int] = OrderedDict()
        self.probation: OrderedDict[int, int] = OrderedDict()
        self.protected: OrderedDict[int, int] = OrderedDict()
        self.doomed: OrderedDict[int, int] = OrderedDict()
        self.sketch = FrequencySketch(capacity)

    def insert(self, slot: int, block_hash: int) -> None:
        self.insert_many(((slot, block_hash),))

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        stored = list(stored)
        cells = self.sketch.cells_of([block_hash for _, block_hash in stored])
        self.sketch.add_cells(cells)
        window = self.window
        window.update(zip([slot for slot, _ in stored], cells))
        overflow = len(window) - self.window_target
        if overflow <= 0:
            return
        pop = window.popitem
        room = self.main_target - len(self.probation) - len(self.protected) - len(self.doomed)
        if room > 0:  # `_admit` of each while main has room, in one batch: no duels, each enters probation
            entering = min(overflow, room)
            self.probation.update([pop(last=False) for _ in range(entering)])
            overflow -= entering
        admit = self._admit
        for _ in range(overflow):
            admit(*pop(last=False))

    def _admit(self, slot: int, cells: Cells) -> None:
        """The window's candidate enters probation, unless main is full and its next victim is counted as often."""
        probation = self.probation
        if len(probation) + len(self.protected) + len(self.doomed) < self.main_target:
            probation[slot] = cells
            return
        rival_part = probation or self.protected
        if not rival_part:
            self.doomed[slot] = cells
            return
        rival = next(iter(rival_part))
        if self.sketch.more_often(cells, rival_part[rival]):
            self.doomed[rival] = rival_part.pop(rival)
            probation[slot] = cells
        else:
            self.doomed[slot] = cells

    def touch(self, slot: int) -> None:
        self.touch_many((slot,))

    def touch_many(self, slots: Iterable[int]) -> None:
        """Each part is asked by one lookup (a slot is in at most one part); a probation or doomed hit is protected,
        protected's overflow demoted back to probation (inlined: the hot path)."""
        window, protected, probation, doomed = self.window, self.protected, self.probation, self.doomed
        protected_target = self.protected_target
        hit: list[Cells] = []
        for slot in slots:
            cells = protected.get(slot)
            if cells is not None:
                protected.move_to_end(slot)
                hit.append(cells)
                continue
            cells = window.get(slot)
            if cells is not None:
                window.move_to_end(slot)
                hit.append(cells)
                continue
            cells = probation.pop(slot, None)
            if cells is None:
                cells = doomed.pop(slot, None)  # hit before its eviction: it earned its place after all
            if cells is None:
                continue  # not held: nothing to refresh
            hit.append(cells)
            protected[slot] = cells
            if len(protected) > protected_target:
                demoted, demoted_cells = protected.popitem(last=False)
                probation[demoted] = demoted_cells
        self.sketch.add_cells(hit)

    def remove(self, slot: int) -> None:
        for part in (self.doomed, self.probation, self.window, self.protected):
            if part.pop(slot, None) is not None:
                return
        raise KeyError(slot)

    def clear(self) -> None:
        for part in (self.window, self.probation, self.protected, self.doomed):
            part.clear()
        self.sketch.clear()

    def victims(self, n: int, evictable: Evictable) -> list[int] | None:
        return take(n, filter(evictable, chain(self.doomed, self.probation, self.protected, self.window)))

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected) + len(self.doomed)

    def __contains__(self, slot: object) -> bool:
        return slot in self.window or slot in self.probation or slot in self.protected or slot in self.doomed
