"""Optional integrity aid: a checksum of every CPU block, taken when it was first stored, checked before every load.

Pinned host memory sits outside the GPU's protection for hours; a stray write, a bad DIMM or a bug elsewhere in the
process would be reloaded into the KV cache without complaint. With `OffloadConfig.checksum` on, a load whose
source changed since its block was stored fails loudly (logged, reported as a failed job, the blocks recomputed)
instead of feeding garbage to the model. The check runs on the host before the load is enqueued: the slot is
pinned by the load, so nothing can rewrite it between the check and the copy.

A block's checksum follows it through every tier: a write-back hands the lower tier the checksum the block was
first stored with (`of`), the tier keeps it with the bytes, and a fetch hands it back (`carry`), so the load after
a fetch is checked against the bytes as first stored, never against the slot's previous occupant. A fetch claiming
a slot forgets that occupant's checksum first (`forget`), and a load of a slot without a checksum fails
(`ChecksumMissing`): no load is ever unchecked.

With replicated KV (the ranks of a host share one pool) the checksums live in a table the ranks share too
(`SharedHostMemory.table`): a block's checksum is taken by the rank that copied it, once its copy landed (a
non-writer reading the slot at its own, empty, store's end could read it before the writer's copy did), and a
fetch's by the rank that moved it; every rank verifies its own load against it. The scheduler orders a load of the
slot only once every rank reported the store or fetch, the writer's report coming after its checksum was written.
A table entry is 0 for none, else the CRC-32 with bit 32 set, so that memory fresh from the kernel holds none.
"""

from __future__ import annotations

import logging
import zlib
from typing import Sequence

import torch

from kvfsm.executor.pool import HostPool
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.transfer import TransferError

log = logging.getLogger(__name__)


class ChecksumMismatch(TransferError):
    """A CPU slot's bytes changed between the end of its store and a load of it."""


class ChecksumMissing(TransferError):
    """A load of a CPU slot that holds no checksum (a bug upstream: no load may go unchecked)."""


_PRESENT = 1 << 32
"""Set in a table entry that holds a checksum (a CRC-32 is below it): entry 0 means none."""


class SlotChecksums:
    def __init__(self, pool: HostPool, shared: SharedHostMemory | None = None) -> None:
        """`shared`: the host memory the ranks' pools share (replicated KV); the table is then theirs together."""
        self._pool = pool
        self._sums = (torch.zeros(pool.num_slots, dtype=torch.int64) if shared is None
                      else shared.table(pool.num_slots))

    def _crc(self, slot: int) -> int:
        return zlib.crc32(self._pool.slot(slot).numpy())

    def _get(self, slot: int) -> int | None:
        entry = int(self._sums[slot])
        return entry - _PRESENT if entry else None

    def record(self, slots: Sequence[int]) -> None:
        """These slots' stores completed: their blocks are first stored now."""
        for slot in slots:
            self._sums[slot] = _PRESENT + self._crc(slot)

    def of(self, slots: Sequence[int]) -> list[int | None]:
        """The checksum each slot's block was first stored with, for a write-back to carry down."""
        return [self._get(slot) for slot in slots]

    def forget(self, slots: Sequence[int]) -> None:
        """A fetch claimed these slots: what they held before is gone, and so is its checksum."""
        for slot in slots:
            self._sums[slot] = 0

    def carry(self, slot: int, checksum: int | None) -> None:
        """A fetch brought `slot` its block and the checksum the block was first stored with; a block stored by
        an engine that kept none gets one now, of the bytes the tier just verified."""
        self._sums[slot] = _PRESENT + (self._crc(slot) if checksum is None else checksum)

    def verify(self, slots: Sequence[int]) -> None:
        for slot in slots:
            expected = self._get(slot)
            if expected is None:
                log.error("CPU slot %d holds no checksum; its load fails", slot)
                raise ChecksumMissing(f"CPU slot {slot} holds no checksum")
            if self._crc(slot) != expected:
                log.error("CPU slot %d changed since its store completed; its load fails", slot)
                raise ChecksumMismatch(f"CPU slot {slot} changed since its store completed")
