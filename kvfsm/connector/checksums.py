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
"""

from __future__ import annotations

import logging
import zlib
from typing import Sequence

from kvfsm.executor.pool import HostPool
from kvfsm.executor.transfer import TransferError

log = logging.getLogger(__name__)


class ChecksumMismatch(TransferError):
    """A CPU slot's bytes changed between the end of its store and a load of it."""


class ChecksumMissing(TransferError):
    """A load of a CPU slot that holds no checksum (a bug upstream: no load may go unchecked)."""


class SlotChecksums:
    def __init__(self, pool: HostPool) -> None:
        self._pool = pool
        self._sums: dict[int, int] = {}

    def _crc(self, slot: int) -> int:
        return zlib.crc32(self._pool.slot(slot).numpy())

    def record(self, slots: Sequence[int]) -> None:
        """These slots' stores completed: their blocks are first stored now."""
        for slot in slots:
            self._sums[slot] = self._crc(slot)

    def of(self, slots: Sequence[int]) -> list[int | None]:
        """The checksum each slot's block was first stored with, for a write-back to carry down."""
        return [self._sums.get(slot) for slot in slots]

    def forget(self, slots: Sequence[int]) -> None:
        """A fetch claimed these slots: what they held before is gone, and so is its checksum."""
        for slot in slots:
            self._sums.pop(slot, None)

    def carry(self, slot: int, checksum: int | None) -> None:
        """A fetch brought `slot` its block and the checksum the block was first stored with; a block stored by
        an engine that kept none gets one now, of the bytes the tier just verified."""
        self._sums[slot] = self._crc(slot) if checksum is None else checksum

    def verify(self, slots: Sequence[int]) -> None:
        for slot in slots:
            expected = self._sums.get(slot)
            if expected is None:
                log.error("CPU slot %d holds no checksum; its load fails", slot)
                raise ChecksumMissing(f"CPU slot {slot} holds no checksum")
            if self._crc(slot) != expected:
                log.error("CPU slot %d changed since its store completed; its load fails", slot)
                raise ChecksumMismatch(f"CPU slot {slot} changed since its store completed")
