"""The connector's GPU-block fences: one record per engine GPU block a store has read, kept for reuse.

A store fences every GPU block it reads and unfences them when it ends: with 256 running requests, tens of
thousands of blocks a second. The engine's GPU pool is fixed, so a record per block id is made once (for the whole
pool when its size is known, else the first time a block is fenced) and kept after it is writable again: the same
block ids come back, and a record that lives as long as the pool costs nothing per store (making and dropping one
per fence cost an allocation and garbage-collector work every time).
Every change goes through the spec's `gpu-block` machine, in one batch per job.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvfsm.machines import LifecycleMachine
from kvfsm.records import GpuBlock
from kvfsm.states import GpuBlockState


class GpuFences:
    """The GPU blocks stores of one connector have read, indexed by block id."""

    def __init__(self, machine: LifecycleMachine, num_blocks: int = 0) -> None:
        """`num_blocks`: the engine's GPU pool size, when known, to make every record up front."""
        self.machine = machine
        self.blocks: list[GpuBlock] = [GpuBlock(block_id) for block_id in range(num_blocks)]
        """Indexed by block id (a list, not a dict: a block's record is found without comparing keys)."""

    def fire(self, trigger: str, block_ids: Iterable[int], **_: Any) -> None:
        """Fire `trigger` on each block in order, making a block's record the first time it is named.

        The coupling's context (the ledger, the job that caused it) is not passed on: a block's guards and effects
        read only the block, and a batch without context is the machine's cheapest."""
        blocks = self.blocks
        try:
            models = [blocks[b] for b in block_ids]
        except IndexError:  # a block beyond any named before, in a pool of unknown size
            blocks.extend(GpuBlock(block_id) for block_id in range(len(blocks), max(block_ids) + 1))
            models = [blocks[b] for b in block_ids]
        self.machine.fire_many(models, trigger)

    def fenced(self) -> dict[int, GpuBlock]:
        """The blocks some store still reads: what the engine must not write (and what invariants check)."""
        return {block.block_id: block for block in self.blocks if block.state != GpuBlockState.WRITABLE}
