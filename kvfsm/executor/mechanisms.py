"""Ways to move GPU blocks to and from host byte ranges, all driven by the same placement.

A placement says, for each GPU block of a job, the byte offset of its copy in the host pool. Every mechanism
moves exactly those bytes; they differ only in how many copies they issue and where the gathering happens:

- "copy-per-block": one `copy_` per contiguous piece; a run of consecutive blocks is one copy only where a block
  is one piece (a single block-contiguous tensor), otherwise one per block, tensor and K/V piece. The baseline.
- "cross-layer": the same plan, refused unless every tensor holds each block contiguously, where it issues one
  copy per run of blocks (per tensor).
- "staged-gather": gather a chunk of scattered blocks on the device into a staging slot (one kernel pair per
  tensor), then one DMA per contiguous host run; two slots pipelined so gathering overlaps the DMA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Literal, Protocol, Sequence

import torch

from kvfsm.executor.lanes import SLOTS, Lanes, Step, lanes_for
from kvfsm.executor.layouts import KVCaches, Plane

Direction = Literal["store", "load"]
MECHANISMS = ("copy-per-block", "cross-layer", "staged-gather")
DEFAULT_STAGING_BYTES = 128 << 20  # per slot; 2 slots per direction


class MechanismError(ValueError):
    """A mechanism that does not exist, or cannot move this layout."""


@dataclass(frozen=True)
class Placement:
    """GPU block `gpu_blocks[i]` is copied at byte `host_offsets[i]` of the host buffer."""

    gpu_blocks: tuple[int, ...]
    host_offsets: tuple[int, ...]


def runs(starts: Sequence[int], offsets: Sequence[int], stride: int) -> Iterator[tuple[int, int, int, int]]:
    """Maximal runs (first index, start, offset, length) where both sequences advance together (start by 1,
    offset by `stride`), so each run is contiguous on both sides of a copy."""
    i = 0
    while i < len(starts):
        n = 1
        while (i + n < len(starts) and starts[i + n] == starts[i] + n
               and offsets[i + n] == offsets[i] + n * stride):
            n += 1
        yield i, starts[i], offsets[i], n
        i += n


def _move(direction: Direction, gpu: torch.Tensor, host: torch.Tensor) -> None:
    if direction == "store":
        host.copy_(gpu, non_blocking=True)
    else:
        gpu.copy_(host, non_blocking=True)


def device_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """`ids` as an int64 tensor on `device`, copied without blocking the host (pageable copies would)."""
    index = torch.tensor(ids, dtype=torch.int64)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


class Mechanism(Protocol):
    def run(self, direction: Direction, placement: Placement, host: torch.Tensor) -> None:
        """Issue the copies of one job on the current stream."""


class DirectCopy:
    """One copy per piece that is contiguous on both sides, coalescing runs of blocks where a block is one piece."""

    def __init__(self, caches: KVCaches, require_block_contiguous: bool = False) -> None:
        if require_block_contiguous and not caches.block_contiguous:
            raise MechanismError(
                f"'cross-layer' needs each block contiguous in every tensor; layouts are {dict(caches.layouts)}")
        self._caches = caches

    def _pieces(self, plane: Plane, gpu_start: int, host_start: int, n: int) -> Iterator[tuple[torch.Tensor, int]]:
        block_bytes = self._caches.gpu_block_bytes
        if plane.pieces == 1 and plane.block_bytes == block_bytes:
            yield plane.rows[0, gpu_start:gpu_start + n].reshape(-1), host_start
            return
        for i in range(n):
            for p in range(plane.pieces):
                yield plane.rows[p, gpu_start + i], host_start + i * block_bytes + plane.offset + p * plane.piece_bytes

    def run(self, direction: Direction, placement: Placement, host: torch.Tensor) -> None:
        stride = self._caches.gpu_block_bytes
        for _, gpu_start, host_start, n in runs(placement.gpu_blocks, placement.host_offsets, stride):
            for plane in self._caches.planes:
                for gpu, offset in self._pieces(plane, gpu_start, host_start, n):
                    _move(direction, gpu, host[offset:offset + gpu.numel()])


def word_dtype(caches: KVCaches) -> torch.dtype:
    """The widest integer type that every piece, offset and base address is a multiple of. Gather kernels move
    one element per thread step, so gathering bytes as uint8 costs several times the SM time of 8-byte words."""
    align = math.gcd(caches.gpu_block_bytes, *(
        n for plane in caches.planes for n in (plane.offset, plane.piece_bytes, plane.rows.storage_offset())))
    return next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if align % t.itemsize == 0)


class StagedGather:
    """Gather/scatter chunks of blocks through two device staging slots; one DMA per contiguous host run."""

    def __init__(self, caches: KVCaches, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self._caches = caches
        self._chunk = max(1, min(staging_bytes // caches.gpu_block_bytes, caches.num_blocks))
        size = self._chunk * caches.gpu_block_bytes
        self._staging = {
            d: [torch.empty(size, dtype=torch.uint8, device=caches.device) for _ in range(SLOTS)]
            for d in ("store", "load")
        }
        word = word_dtype(caches)
        self._rows = [plane.rows.view(word) for plane in caches.planes]
        # Each plane's place in each slot, built once: per-chunk Python work is what bounds host submission.
        self._views = {d: [[self._staged(p, slot.view(word)) for p in caches.planes] for slot in slots]
                       for d, slots in self._staging.items()}
        self._lanes: dict[Direction, Lanes] = {d: lanes_for(caches.device) for d in ("store", "load")}

    def _staged(self, plane: Plane, slot: torch.Tensor) -> torch.Tensor:
        """Where `plane`'s pieces of a chunk sit in a staging slot (in words), shaped like its rows[:, :chunk]."""
        size = slot.element_size()
        rows = slot.view(self._chunk, -1)[:, plane.offset // size:(plane.offset + plane.block_bytes) // size]
        return rows.view(self._chunk, plane.pieces, plane.piece_bytes // size).transpose(0, 1)

    def _dma(self, direction: Direction, slot: torch.Tensor, offsets: Sequence[int], host: torch.Tensor) -> None:
        block_bytes = self._caches.gpu_block_bytes
        for first, _, host_start, n in runs(range(len(offsets)), offsets, block_bytes):
            _move(direction, slot[first * block_bytes:(first + n) * block_bytes],
                  host[host_start:host_start + n * block_bytes])

    def _gather(self, index: torch.Tensor, views: list[torch.Tensor]) -> None:
        for rows, view in zip(self._rows, views):
            torch.index_select(rows, 1, index, out=view[:, :len(index)])

    def _scatter(self, index: torch.Tensor, views: list[torch.Tensor]) -> None:
        for rows, view in zip(self._rows, views):
            rows.index_copy_(1, index, view[:, :len(index)])

    def _step(self, direction: Direction, index: torch.Tensor, offsets: Sequence[int], host: torch.Tensor) -> Step:
        slots, views = self._staging[direction], self._views[direction]
        if direction == "store":
            return (lambda s: self._gather(index, views[s]),
                    lambda s: self._dma("store", slots[s], offsets, host))
        return (lambda s: self._dma("load", slots[s], offsets, host),
                lambda s: self._scatter(index, views[s]))

    def run(self, direction: Direction, placement: Placement, host: torch.Tensor) -> None:
        # One index for the whole job, on the enqueuing stream, which every lane starts behind.
        index = device_index(placement.gpu_blocks, self._caches.device)
        c = self._chunk
        steps = [
            self._step(direction, index[i:i + c], placement.host_offsets[i:i + c], host)
            for i in range(0, len(placement.gpu_blocks), c)
        ]
        self._lanes[direction].run(steps)


def resolve(name: str) -> str:
    """The mechanism `name` stands for. "auto" is staged-gather for every layout: on an H100 it was the fastest
    each way and both ways at once for per-layer and cross-layer caches alike (kvfsm.bench.transfer), and the
    DMA-only mechanisms showed no smaller slowdown of concurrent compute."""
    if name == "auto":
        return "staged-gather"
    if name not in MECHANISMS:
        raise MechanismError(f"unknown transfer mechanism {name!r}; choose one of {MECHANISMS} or 'auto'")
    return name


def build(name: str, caches: KVCaches, staging_bytes: int = DEFAULT_STAGING_BYTES) -> Mechanism:
    """The mechanism `name` (already resolved) for `caches`."""
    if name == "staged-gather":
        return StagedGather(caches, staging_bytes)
    return DirectCopy(caches, require_block_contiguous=(name == "cross-layer"))
