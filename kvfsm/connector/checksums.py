"""Optional integrity aid: a checksum of every CPU slot, taken when its store completed, checked before a load.

Pinned host memory sits outside the GPU's protection for hours; a stray write, a bad DIMM or a bug elsewhere in the
process would be reloaded into the KV cache without complaint. With `OffloadConfig.checksum` on, a load whose
source changed since its store completed fails loudly (logged, reported as a failed job, the blocks recomputed)
instead of feeding garbage to the model. The check runs on the host before the load is enqueued: the slot is
pinned by the load, so nothing can rewrite it between the check and the copy.
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


class SlotChecksums:
    def __init__(self, pool: HostPool) -> None:
        self._pool = pool
        self._sums: dict[int, int] = {}

    def _crc(self, slot: int) -> int:
        return zlib.crc32(self._pool.slot(slot).numpy())

    def record(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._sums[slot] = self._crc(slot)

    def verify(self, slots: Sequence[int]) -> None:
        for slot in slots:
            expected = self._sums.get(slot)
            if expected is not None and self._crc(slot) != expected:
                log.error("CPU slot %d changed since its store completed; its load fails", slot)
                raise ChecksumMismatch(f"CPU slot {slot} changed since its store completed")
