"""S3-FIFO whose small queue adapts as ARC's recency share does: the blocks' own returns say which side was short.

S3-FIFO's small queue is a fixed tenth of the pool. That suits a mix whose reuse is by popularity, but a chat turn's
blocks are next read one turn of their conversation later, after other conversations stored a good part of the pool:
a tenth demotes them before their one reuse. So this policy keeps a second ghost queue, of hashes the main queue
evicted, and moves the small queue's target on every store of a ghost (Megiddo and Modha's ARC rule):
- a block stored again after leaving the small queue (a small ghost) says the small queue was too short: it grows by
  max(1, main ghosts / small ghosts);
- a block stored again after the main queue evicted it (a main ghost) says main was too short: the small queue
  shrinks by max(1, small ghosts / main ghosts).
The ratios weigh a ghost of the rarer kind more, so the target settles where both kinds return about equally. The
target stays within 1 and capacity - 1; both ghost queues are bounded by the pool's capacity (`base`'s contract).
Everything else, `victims` a pure question included, is S3-FIFO's (`s3fifo`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvfsm.manager.policies.s3fifo import SMALL_SHARE, S3FifoPolicy


class AdaptiveS3FifoPolicy(S3FifoPolicy):
    """S3-FIFO with the small queue's target moved by ghost returns; `main_ghosts` holds hashes main evicted."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.main_ghosts: OrderedDict[int, None] = OrderedDict()

    def insert_many(self, stored: Iterable[tuple[int, int]]) -> None:
        """S3-FIFO's insertion, each ghost's return moving the target first; the ratios read the ghost queues as the
        batch found them (`returned`: small ghosts this batch already took back), in one pass (the hot path)."""
        ghosts, main_ghosts, small, main, count = self.ghosts, self.main_ghosts, self.small, self.main, self.count
        returned = 0
        for slot, block_hash in stored:
            if block_hash in ghosts:
                grow = max(1, len(main_ghosts) // (len(ghosts) + returned))
                self.small_target = min(max(1, self.capacity - 1), self.small_target + grow)
                del ghosts[block_hash]
                returned += 1
                main[slot] = block_hash
                count[slot] = 0
                continue
            if block_hash in main_ghosts:
                del main_ghosts[block_hash]
                shrink = max(1, (len(ghosts) + returned) // max(1, len(main_ghosts)))
                self.small_target = max(1, self.small_target - shrink)
            small[slot] = block_hash

    def remove(self, slot: int) -> None:
        block_hash = self.main.get(slot)
        super().remove(slot)
        if block_hash is not None:
            self.main_ghosts[block_hash] = None
            if len(self.main_ghosts) > self.capacity:
                self.main_ghosts.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self.main_ghosts.clear()
        self.small_target = max(1, int(self.capacity * SMALL_SHARE))
