"""A count-min sketch of how often each block hash was stored or hit, in 4-bit counters that age.

TinyLFU (Einziger, Friedman and Manes, 2017) needs frequencies for far more hashes than the pool holds, in
memory set by the pool: four rows of `width` counters (a power of two at least the pool's size), each hash
counted in one counter of each row and estimated by the smallest, so collisions can only overestimate. After
ten increments per slot every counter is halved, so what was popular long ago fades ("reset"). Counters saturate
at 15: past that, only the ranking among popular hashes is lost, and aging restores it.
"""

from __future__ import annotations

ROWS = 4
MAX_COUNTER = 15
SAMPLE_PER_SLOT = 10
"""Increments per pool slot between two halvings (TinyLFU's sample size W = 10 × the cache size)."""
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_HALVE = bytes(value >> 1 for value in range(256))


class FrequencySketch:
    """Frequency estimates for any int hash; memory `4 × width` bytes."""

    def __init__(self, capacity: int) -> None:
        self.width = 1 << max(4, (capacity - 1).bit_length())
        self.mask = self.width - 1
        self.table = bytearray(ROWS * self.width)
        self.sample = SAMPLE_PER_SLOT * capacity
        self.additions = 0

    def _cells(self, block_hash: int) -> tuple[int, int, int, int]:
        """One cell per row, by double hashing a 64-bit mix of the hash (structured hashes spread as well)."""
        mixed = ((block_hash ^ (block_hash >> 31)) * _MIX) & _MASK64
        mixed ^= mixed >> 29
        first, step, width, mask = mixed & self.mask, (mixed >> 32) | 1, self.width, self.mask
        return first, width + ((first + step) & mask), 2 * width + ((first + 2 * step) & mask), \
            3 * width + ((first + 3 * step) & mask)

    def add(self, block_hash: int) -> None:
        table = self.table
        for cell in self._cells(block_hash):
            if table[cell] < MAX_COUNTER:
                table[cell] += 1
        self.additions += 1
        if self.additions >= self.sample:
            self.table = table.translate(_HALVE)
            self.additions //= 2

    def estimate(self, block_hash: int) -> int:
        table = self.table
        return min(table[cell] for cell in self._cells(block_hash))

    def clear(self) -> None:
        self.table = bytearray(len(self.table))
        self.additions = 0
