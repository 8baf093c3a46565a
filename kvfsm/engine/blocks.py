"""The engine's paged GPU block pool with prefix caching, as current engines keep it.

Blocks are reference-counted; a freed block keeps its prefix hash (and so stays a prefix-cache hit) until it is
reallocated, oldest-freed first. A block that leaves the pool without a hash holds nothing anyone may read again,
so the engine poisons it: a read that the ordering rules should have prevented then shows in the output.
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
        self.to_poison: list[int] = []
        """Blocks that left the pool holding nothing readable since the engine last poisoned."""

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
                self.to_poison.append(block)
        self.acquire(blocks)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):  # the tail of a request is the least likely to be shared: evict it first
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
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
            self.to_poison.append(block)

    def evict(self, blocks: Sequence[int]) -> None:
        """Drop these blocks from the prefix cache; those no request holds once released are then poisoned."""
        for block in blocks:
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._cached[old]

    def take_poison(self) -> list[int]:
        blocks, self.to_poison = sorted(set(self.to_poison)), []
        return blocks
