"""The spec's named invariants about GPU blocks that stores still read: each block's fence counts the stores reading it
(`fence-count`), and a store still reading a block the engine handed out again is flushed by that step's metadata,
whether its request returned the block (`lazy-fence`) or its sliding window left the block behind (`window-fence`).

They read the same `World` as `kvfsm.invariants`; they live apart because they are about when the scheduler half
flushes a store, not about the order of device accesses the rest of that module checks.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator

from kvfsm.invariants import World
from kvfsm.records import FLUSHABLE_JOB_STATES, RequestRecord, TransferJob
from kvfsm.registry import REGISTRY
from kvfsm.states import GpuBlockState as G
from kvfsm.states import RequestState as R


@REGISTRY.invariant("fence-count")
def fence_count(world: World) -> list[str]:
    readers: Counter[int] = Counter(
        block for job in world.jobs.values() if job.kind == "store" and job.in_flight for block in job.gpu_blocks
    )
    found = [f"GPU block {b} is read by a store but not tracked" for b in readers if b not in world.gpu_blocks]
    for block in world.gpu_blocks.values():
        expect = readers.get(block.block_id, 0)
        if block.store_readers != expect or (block.state != G.WRITABLE) != (expect > 0):
            found.append(f"GPU block {block.block_id} is {block.state} with {block.store_readers} store readers, "
                         f"{expect} stores read it")
    return found


def _unflushed_stores(world: World) -> Iterator[tuple[TransferJob, RequestRecord]]:
    """Each store job not flushed yet (pending-store or submitted), with its request."""
    for job in world.jobs.values():
        if job.kind == "store" and job.state in FLUSHABLE_JOB_STATES:
            owner = world.requests.get(job.req_id)
            if owner is not None:
                yield job, owner


def _handed_out(world: World, block_ids: Iterable[int]) -> Iterator[tuple[int, str]]:
    """Each of these GPU blocks no longer freed-while-read (handed out again), with its state."""
    for block_id in block_ids:
        block = world.gpu_blocks.get(block_id)
        if block is None or block.state != G.FREED_WHILE_READ:
            yield block_id, block.state if block is not None else G.WRITABLE


@REGISTRY.invariant("lazy-fence")
def lazy_fence(world: World) -> list[str]:
    """A returned request's store not yet flushed reads only blocks nobody was handed since: once a step hands one
    out (`reuse` makes it fenced again), that step's metadata flushes the store."""
    found = []
    for job, owner in _unflushed_stores(world):
        if owner.state != R.RETURNED:
            continue
        found += [f"GPU block {block_id} is {state} (handed out again) while store job {job.job_id} of returned "
                  f"request {job.req_id} is still {job.state}, not flushed"
                  for block_id, state in _handed_out(world, job.gpu_blocks)]
    return found


@REGISTRY.invariant("window-fence")
def window_fence(world: World) -> list[str]:
    """A running request's store not yet flushed reads a block its window left behind only while that block is
    freed-while-read: once a step hands it out (`reuse`), that step's metadata flushes the store."""
    found = []
    for job, owner in _unflushed_stores(world):
        if owner.state == R.RETURNED:
            continue
        found += [f"GPU block {block_id} left {job.req_id}'s sliding window and is {state} while its store job "
                  f"{job.job_id} is still {job.state}, not flushed"
                  for block_id, state in _handed_out(world, owner.slid.intersection(job.gpu_blocks))]
    return found
