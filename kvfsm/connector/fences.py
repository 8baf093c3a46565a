"""The connector's GPU-block fences: one record per engine GPU block a store has read, kept for reuse.

A store fences every GPU block it reads and unfences them when it ends: with 256 running requests, tens of
thousands of blocks a second. The engine's GPU pool is fixed, so a record per block id is made once (for the whole
pool when its size is known, else the first time a block is fenced) and kept after it is writable again: the same
block ids come back, and a record that lives as long as the pool costs nothing per store (making and dropping one
per fence cost an allocation and garbage-collector work every time).
Every change goes through the spec's `gpu-block` machine, in one batch per job.

Blocks whose request ended while stores still read them (`freed-while-read`) are indexed beside the records, from
the transition each batch took: a step asks only whether it hands out any of them (`take_handed_out`), so a step with
none pays one truth test.
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
        self.freed: set[int] = set()
        """The blocks now freed-while-read: the engine has them back while stores still read them."""
        self.allocated: list[int] = []
        """GPU blocks the engine allocated since the last metadata: handed out in the step that metadata is for."""

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
        if trigger == "free" or (self.freed and trigger != "fence"):  # into or out of freed-while-read
            freed = self.freed
            for block in models:
                if block.state == GpuBlockState.FREED_WHILE_READ:
                    freed.add(block.block_id)
                else:
                    freed.discard(block.block_id)

    def take_handed_out(self, written: Iterable[int]) -> set[int]:
        """The freed-while-read blocks among those a step may write (its scheduled requests' blocks) and those
        allocated for it (which its loads may write); the allocations are forgotten for the next step."""
        allocated, self.allocated = self.allocated, []
        if not self.freed:
            return set()
        return self.freed.intersection(written).union(self.freed.intersection(allocated))

    def fenced(self) -> dict[int, GpuBlock]:
        """The blocks some store still reads: what the engine must not write (and what invariants check)."""
        return {block.block_id: block for block in self.blocks if block.state != GpuBlockState.WRITABLE}
