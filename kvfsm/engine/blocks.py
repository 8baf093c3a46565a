"""The engine's paged GPU block pool with prefix caching, as current engines keep it.

Blocks are reference-counted; a freed block keeps its prefix hash (and so stays a prefix-cache hit) until it is
reallocated, oldest-freed first. A block handed out fresh holds nothing its new owner may read, so the engine
poisons it in the step that allocated it: a read that the ordering rules should have prevented then shows in the
output. A freed block is left as it is until then (a store may still read it: `lazy-fence`), so the poison is the
first write of a reallocated block, as vLLM's first write of one is its new owner's compute.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._reclaimed: set[int] = set()
        """Evicted blocks still held: handed out first once freed."""
        self.to_poison: list[int] = []
        """Blocks allocated (or a preempted request's own, freed) since the engine last poisoned: the poison is their
        first write, in the step that took them."""

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes`."""
        blocks = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] += 1
            self._free.pop(block, None)

    def allocate(self, count: int, keep: Sequence[int] = ()) -> list[int] | None:
        """`count` fresh blocks, evicting the oldest cached free ones; None (and nothing taken) if too few."""
        candidates = [b for b in self._free if b not in keep]
        if len(candidates) < count:
            return None
        blocks = candidates[:count]
        for block in blocks:
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._cached[old]
        self.to_poison.extend(blocks)
        self.acquire(blocks)
        return blocks

    def release(self, blocks: Sequence[int], rewrite: bool = False) -> None:
        """`rewrite`: the blocks of a preempted request, whose stores were flushed at once (`preempt-flushes`): those
        without a hash (its own, never shared) are rewritten in the next step."""
        for block in reversed(blocks):  # the tail of a request is the least likely to be shared: evict it first
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None
                if block in self._reclaimed:
                    self._reclaimed.discard(block)
                    self._free.move_to_end(block, last=False)
                elif rewrite and block not in self._hash_of:
                    self.to_poison.append(block)

    def cache(self, block: int, block_hash: int) -> None:
        """Make `block` a prefix-cache hit for `block_hash` (first writer wins: later duplicates stay private)."""
        if block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (what an engine's prefix-cache reset does)."""
        for block in [b for b in self._free if b in self._hash_of]:
            del self._cached[self._hash_of.pop(block)]

    def evict(self, blocks: Sequence[int]) -> None:
        """Drop these blocks from the prefix cache and hand them out first once freed, as memory pressure would give
        them to the next request at once (its allocation is what the connector sees)."""
        for block in blocks:
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._cached[old]
        self._reclaimed.update(blocks)

    def take_poison(self) -> list[int]:
        blocks, self.to_poison = sorted(set(self.to_poison)), []
        return blocks
