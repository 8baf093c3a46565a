"""A count-min sketch of how often each block hash was stored or hit, in 4-bit counters that age.

TinyLFU (Einziger, Friedman and Manes, 2017) needs frequencies for far more hashes than the pool holds, in
memory set by the pool: two rows of `width` counters (a power of two at least four times the pool's size), each
hash counted in one counter of each row and estimated by the smaller, so collisions can only overestimate. After
ten increments per slot every counter is halved, so what was popular long ago fades ("reset"). Counters saturate
at 15: past that, only the ranking among popular hashes is lost, and aging restores it.

Two rows rather than the usual four, twice as wide: the same memory per estimate's error, at half the
increments, which are the policy's hot path in pure Python (each stored or hit block costs one `add_cells` step).
"""

from __future__ import annotations

from typing import Iterable, Sequence

MAX_COUNTER = 15
SAMPLE_PER_SLOT = 10
"""Increments per pool slot between two halvings (TinyLFU's sample size W = 10 × the cache size)."""
WIDTH_PER_SLOT = 4
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_HALVE = bytes(value >> 1 for value in range(256))
Cells = tuple[int, int]
"""A hash's counter in each row of the table (`FrequencySketch.cells`)."""


class FrequencySketch:
    """Frequency estimates for any int hash; memory `2 × width` bytes."""

    def __init__(self, capacity: int) -> None:
        self.width = 1 << max(4, (WIDTH_PER_SLOT * capacity - 1).bit_length())
        self.mask = self.width - 1
        self.table = bytearray(2 * self.width)
        self.sample = SAMPLE_PER_SLOT * capacity
        self.additions = 0

    def cells(self, block_hash: int) -> Cells:
        """One cell per row, from a 64-bit multiplicative mix of the hash (structured hashes spread as well): row
        0's from its high half, row 1's from its low half."""
        mixed = (block_hash * _MIX) & _MASK64
        return (mixed >> 32) & self.mask, self.width + (mixed & self.mask)

    def cells_of(self, block_hashes: Iterable[int]) -> list[Cells]:
        """`cells` of each hash (inlined: a store's blocks, on the policy's hot path)."""
        width, mask = self.width, self.mask
        return [((mixed >> 32) & mask, width + (mixed & mask))
                for mixed in [(block_hash * _MIX) & _MASK64 for block_hash in block_hashes]]

    def add_many(self, block_hashes: Iterable[int]) -> None:
        """Count one more store or hit of each hash."""
        self.add_cells(self.cells_of(block_hashes))

    def add_cells(self, pairs: Sequence[Cells]) -> None:
        """Count one more store or hit of each hash, named by its `cells` (a policy keeps them, so a hit need not mix
        its hash again: the mix multiplies the whole hash, 256 bits for a vLLM engine's)."""
        table = self.table
        for first, second in pairs:
            if table[first] < MAX_COUNTER:
                table[first] += 1
            if table[second] < MAX_COUNTER:
                table[second] += 1
        self.additions += len(pairs)
        if self.additions >= self.sample:
            self.table = table.translate(_HALVE)
            self.additions //= 2

    def estimate(self, block_hash: int) -> int:
        first, second = self.cells(block_hash)
        return min(self.table[first], self.table[second])

    def more_often(self, mine: Cells, than: Cells) -> bool:
        """Whether the hash of cells `mine` is estimated more frequent than that of `than` (TinyLFU's duel, once per
        stored block when the pool is full)."""
        table = self.table
        return min(table[mine[0]], table[mine[1]]) > min(table[than[0]], table[than[1]])

    def clear(self) -> None:
        self.table = bytearray(len(self.table))
        self.additions = 0
