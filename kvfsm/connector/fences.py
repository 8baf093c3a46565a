"""The connector's GPU-block fences: one record per engine GPU block a store has read, kept for reuse.

A store fences every GPU block it reads and unfences them when it ends: with 256 running requests, tens of
thousands of blocks a second. A record is made the first time a block is fenced and kept after it is writable
again, because the engine's GPU pool is fixed: the same few thousand block ids come back, and a record that lives
as long as the pool costs the garbage collector nothing per store (making and dropping one per fence did).
Every change goes through the spec's `gpu-block` machine, in one batch per job.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvfsm.machines import LifecycleMachine
from kvfsm.records import GpuBlock
from kvfsm.states import GpuBlockState


class GpuFences:
    """The GPU blocks stores of one connector have read, by block id."""

    def __init__(self, machine: LifecycleMachine) -> None:
        self.machine = machine
        self.blocks: dict[int, GpuBlock] = {}

    def fire(self, trigger: str, block_ids: Iterable[int], **context: Any) -> None:
        """Fire `trigger` on each block in order, making a block's record the first time it is named."""
        blocks = self.blocks
        self.machine.fire_many([blocks.get(b) or self._new(b) for b in block_ids], trigger, **context)

    def fenced(self) -> dict[int, GpuBlock]:
        """The blocks some store still reads: what the engine must not write (and what invariants check)."""
        return {b: block for b, block in self.blocks.items() if block.state != GpuBlockState.WRITABLE}

    def _new(self, block_id: int) -> GpuBlock:
        block = self.blocks[block_id] = GpuBlock(block_id)
        return block
