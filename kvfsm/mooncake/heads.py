"""One stored value per KV head, so that engines of every tensor-parallel size share a prefix byte for byte.

A rank of a TP=n engine holds heads [r·h/n, (r+1)·h/n) of every layer, so its CPU block is the block's *rows* (per
GPU block, every layer's K then V, token by token) each holding its heads' bytes side by side: `rows × local heads
× head bytes`. The rows and their order depend on the model, the layout and the block size, never on how many heads
a rank holds. So head g's value (its bytes of every row, in row order) is the same bytes whichever TP size computed
it, and is keyed by g with no TP rank or size (`kvfsm.mooncake.keys.head_key`): each rank writes and reads only its
own heads' values, and a prefix a TP=2 engine wrote is a whole hit for TP=1 (which reads both ranks' heads) and
TP=4 (which reads half of one rank's), and the reverse.

A value moves zero-copy only if it is contiguous, and a rank's heads interleave within every row; so each CPU slot
has a head-major *shadow* of the same size (held by the tier, registered with Mooncake like the pool). A write-back
copies the slot into its shadow before the put; a fetch lands in the shadow and `HeadCalls` copies it into the slot
once every head of the block arrived and passed its check, before the fetch is reported: the slot never holds a
mix of landed and missing heads that could become loadable.

Threads: the worker's thread copies (at submit for a write-back, in `poll` for a fetch); the client's I/O threads
move only the shadows' bytes, and a shadow is touched by one job at a time because its slot is (`writeback-pins-slot`,
`fetch-lands-private`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np


class HeadsDoNotSplit(ValueError):
    """A KV cache whose blocks cannot be cut into one value per KV head (a layout without heads, heads that do not
    divide among the ranks, or rows that do not add up)."""


@dataclass(frozen=True)
class HeadSplit:
    """How one rank's CPU block cuts into per-head values: it holds `local_heads` of the model's `kv_heads`, from
    `first_head` on, each `head_bytes` wide in every row."""

    kv_heads: int
    first_head: int
    local_heads: int
    head_bytes: int
    block_bytes: int

    @classmethod
    def of_rank(cls, kv_heads: int, rank: int, world: int, row_bytes: int, block_bytes: int) -> HeadSplit:
        """Rank `rank` of `world`, whose rows are `row_bytes` wide (its heads side by side) in a `block_bytes`
        CPU block; a split that does not come out whole is `HeadsDoNotSplit`."""
        if kv_heads % world:
            raise HeadsDoNotSplit(f"{kv_heads} KV heads do not divide among {world} ranks")
        local = kv_heads // world
        if row_bytes % local or block_bytes % row_bytes:
            raise HeadsDoNotSplit(f"rows of {row_bytes} bytes do not hold {local} heads each, or do not tile a "
                                  f"CPU block of {block_bytes} bytes")
        return cls(kv_heads, rank * local, local, row_bytes // local, block_bytes)

    @property
    def heads(self) -> range:
        """The global indices of this rank's heads."""
        return range(self.first_head, self.first_head + self.local_heads)

    @property
    def value_bytes(self) -> int:
        """Bytes of one head's value: its share of every row."""
        return self.block_bytes // self.local_heads

    def to_shadow(self, slot: np.ndarray, shadow: np.ndarray) -> None:
        """Copy a CPU slot's bytes into its shadow, head after head."""
        rows = self.block_bytes // (self.local_heads * self.head_bytes)
        shadow.reshape(self.local_heads, rows, self.head_bytes)[:] = \
            slot.reshape(rows, self.local_heads, self.head_bytes).transpose(1, 0, 2)

    def from_shadow(self, shadow: np.ndarray, slot: np.ndarray) -> None:
        """Copy a shadow's heads back into the CPU slot's rows."""
        rows = self.block_bytes // (self.local_heads * self.head_bytes)
        slot.reshape(rows, self.local_heads, self.head_bytes)[:] = \
            shadow.reshape(self.local_heads, rows, self.head_bytes).transpose(1, 0, 2)

    def values(self, shadow: np.ndarray) -> list[np.ndarray]:
        """Each of this rank's heads' value: a contiguous view into the shadow, in head order."""
        return [shadow[i * self.value_bytes:(i + 1) * self.value_bytes] for i in range(self.local_heads)]


class Answered(Protocol):
    """A client call's answers, one per key (`kvfsm.mooncake.io_thread.Pending`)."""

    @property
    def deadline(self) -> float: ...

    def poll(self, now: float | None = None) -> list[object] | None: ...


class HeadCalls:
    """The per-key answers of a call over `per_entry` head values per entry, folded into one answer per entry (the
    `JobCalls` a tier job waits on): an entry fails with its first failed head, and otherwise answers a checksum
    of its heads' checksums. `landed(i)` runs, on the polling thread, for each entry whose heads all arrived (a
    fetch copies its shadow into its slot there)."""

    def __init__(self, call: Answered, per_entry: int, landed: Callable[[int], None] | None = None) -> None:
        self._call = call
        self._per_entry = per_entry
        self._landed = landed

    @property
    def deadline(self) -> float:
        return self._call.deadline

    def poll(self, now: float) -> list[object] | None:
        answers = self._call.poll(now)
        if answers is None:
            return None
        folded = [fold(answers[i:i + self._per_entry]) for i in range(0, len(answers), self._per_entry)]
        if self._landed is not None:
            for index, answer in enumerate(folded):
                if not isinstance(answer, BaseException):
                    self._landed(index)
        return folded


def fold(answers: Sequence[object]) -> object:
    """One entry's answer from its heads' answers: the first failure; None where a head answered none (a fetch:
    head values carry no block checksum); else a CRC-32 over the heads' checksums (a write-back's)."""
    for answer in answers:
        if isinstance(answer, BaseException):
            return answer
    if any(answer is None for answer in answers):
        return None
    return zlib.crc32(b"".join(struct.pack("<I", int(a) & 0xFFFFFFFF) for a in answers))  # type: ignore[call-overload]
