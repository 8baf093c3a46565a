"""Ways to move GPU blocks to and from host byte ranges, all driven by the same placement.

A placement says, for each GPU block of a job, the byte offset of its copy in the host pool. Every mechanism
moves exactly those bytes; they differ only in how many copies they issue and where the gathering happens:

- "copy-per-block": one `copy_` per contiguous piece; a run of consecutive blocks is one copy only where a block
  is one piece (a single block-contiguous tensor), otherwise one per block, tensor and K/V piece. The baseline.
- "cross-layer": the same plan, refused unless every tensor holds each block contiguously, where it issues one
  copy per run of blocks (per tensor).
- "staged-gather": gather a chunk of scattered blocks on the device into a staging slot (one kernel pair per
  tensor), then one DMA per contiguous host run; two slots pipelined so gathering overlaps the DMA.
- "fused-gather": staged-gather with each chunk gathered by one launch for every tensor (`kvfsm.executor.gather`,
  where Triton runs): the least host time and the most bandwidth both ways, for a larger share of a concurrent
  kernel's time (see `kvfsm.executor.choice.resolve`).

Every mechanism also moves one layer segment (one registered tensor) of a job on its own (`run_segment`), which is
what per-layer loads and stores issue. A segment's bytes in a run of consecutive CPU blocks are rows a GPU block
apart, so staged-gather moves them with one 2-D DMA per run (`kvfsm.executor.rows`).
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from dataclasses import dataclass
from typing import Iterator, Literal, Protocol, Sequence

import torch

from kvfsm.executor import gather, graphs
from kvfsm.executor.lanes import SLOTS, Lanes, Step, lanes_for
from kvfsm.executor.layouts import KVCaches, Plane
from kvfsm.executor.rows import RowCopies

Direction = Literal["store", "load"]
MECHANISMS = ("copy-per-block", "cross-layer", "staged-gather", "fused-gather", "staged-copy")
BLOCK_CONTIGUOUS_ONLY = frozenset({"cross-layer", "staged-copy"})
"""Mechanisms that refuse caches where a block is several pieces of one tensor (kv-first)."""
DEFAULT_STAGING_BYTES = 128 << 20  # per slot; 2 slots per direction

log = logging.getLogger(__name__)


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


@lru_cache(maxsize=16)
def chunk_runs(offsets: tuple[int, ...], chunk: int, stride: int) -> tuple[tuple[int, tuple], ...]:
    """Per chunk of `chunk` blocks, its first index and the `runs` of its host offsets. Every layer segment of a
    job has the same plan, so it is worked out once per job rather than once per layer (for a 32k-token prompt
    that loop was most of the host time of a segment)."""
    return tuple((i, tuple(runs(range(len(offsets[i:i + chunk])), offsets[i:i + chunk], stride)))
                 for i in range(0, len(offsets), chunk))


def _move(rows: RowCopies, direction: Direction, gpu: torch.Tensor, gpu_offset: int, host: torch.Tensor,
          host_offset: int, nbytes: int) -> None:
    """`nbytes` contiguous bytes at `gpu_offset` of `gpu` to or from `host_offset` of `host`, as a one-row copy:
    straight to the driver on CUDA, where a tensor `copy_` cost several times the host time (a DMA-only job
    issues one per run of blocks). Offsets, not sliced views: a view costs a few µs of host time per copy."""
    if direction == "store":
        rows.copy(host, host_offset, nbytes, gpu, gpu_offset, nbytes, nbytes, 1)
    else:
        rows.copy(gpu, gpu_offset, nbytes, host, host_offset, nbytes, nbytes, 1)


class Mechanism(Protocol):
    chunk_blocks: int | None
    """Blocks a job's copies are issued in at a time (a staging slot's worth), or None where a job is one piece."""

    def run(self, direction: Direction, placement: Placement, host: torch.Tensor, index: torch.Tensor | None,
            join: bool = True) -> None:
        """Issue the copies of one job (or one chunk of it) on the current stream; `index` is its GPU blocks on
        the device (None for a DMA-only mechanism, which never reads it); `join=False` continues the previous run
        on the same stream (see `Lanes`): the next chunk of blocks whose first chunk already waited."""

    def run_segment(self, direction: Direction, placement: Placement, host: torch.Tensor, segment: int,
                    index: torch.Tensor | None, join: bool) -> None:
        """Issue the copies of plane `segment` of one job on the current stream; `index` is the job's GPU blocks
        on the device (None for a DMA-only mechanism, which never reads it); `join=False` continues the job's
        previous segment on the same stream (see `Lanes`)."""


class DirectCopy:
    """One copy per piece that is contiguous on both sides, coalescing runs of blocks where a block is one piece."""

    def __init__(self, caches: KVCaches, require_block_contiguous: bool = False) -> None:
        if require_block_contiguous and not caches.block_contiguous:
            raise MechanismError(
                f"'cross-layer' needs each block contiguous in every tensor; layouts are {dict(caches.layouts)}")
        self._caches = caches
        self.chunk_blocks: int | None = None

    def _pieces(self, plane: Plane, gpu_start: int, host_start: int, n: int) -> Iterator[tuple[int, int, int]]:
        """(byte offset in `plane.rows`, byte offset in the host buffer, bytes) of each contiguous piece of the
        run of `n` blocks from `gpu_start`."""
        block_bytes, rows = self._caches.gpu_block_bytes, plane.rows
        piece_stride, block_stride = rows.stride(0), rows.stride(1)
        if plane.pieces == 1 and plane.block_bytes == block_bytes:
            yield gpu_start * block_stride, host_start, n * block_bytes
            return
        for i in range(n):
            for p in range(plane.pieces):
                yield (p * piece_stride + (gpu_start + i) * block_stride,
                       host_start + i * block_bytes + plane.offset + p * plane.piece_bytes, plane.piece_bytes)

    def run(self, direction: Direction, placement: Placement, host: torch.Tensor, index: torch.Tensor | None,
            join: bool = True) -> None:
        self._copy(direction, placement, host, self._caches.planes)

    def run_segment(self, direction: Direction, placement: Placement, host: torch.Tensor, segment: int,
                    index: torch.Tensor | None, join: bool) -> None:
        self._copy(direction, placement, host, self._caches.planes[segment:segment + 1])

    def _copy(self, direction: Direction, placement: Placement, host: torch.Tensor, planes: Sequence[Plane]) -> None:
        stride = self._caches.gpu_block_bytes
        with RowCopies(self._caches.device, batched=True) as rows:  # one driver call for the job's copies
            for _, gpu_start, host_start, n in runs(placement.gpu_blocks, placement.host_offsets, stride):
                for plane in planes:
                    for gpu_offset, host_offset, nbytes in self._pieces(plane, gpu_start, host_start, n):
                        _move(rows, direction, plane.rows, gpu_offset, host, host_offset, nbytes)


def word_dtype(caches: KVCaches) -> torch.dtype:
    """The widest integer type that every piece, offset and base address is a multiple of. Gather kernels move
    one element per thread step, so gathering bytes as uint8 costs several times the SM time of 8-byte words."""
    align = math.gcd(caches.gpu_block_bytes, *(
        n for plane in caches.planes for n in (plane.offset, plane.piece_bytes, plane.rows.storage_offset())))
    return next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if align % t.itemsize == 0)


class StagedGather:
    """Gather/scatter chunks of blocks through two device staging slots; one DMA per contiguous host run."""

    one_launch_gathers = False
    """Gather a chunk by one launch for every plane where `kvfsm.executor.gather` runs ("fused-gather")."""
    graph_launches = True
    """Replay a full chunk's per-plane gathers and scatters as CUDA graphs (`kvfsm.executor.graphs`) on a GPU."""

    def __init__(self, caches: KVCaches, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self._caches = caches
        self._chunk = max(1, min(staging_bytes // caches.gpu_block_bytes, caches.num_blocks))
        self.chunk_blocks: int | None = self._chunk
        size = self._chunk * caches.gpu_block_bytes
        self._staging = {
            d: [torch.empty(size, dtype=torch.uint8, device=caches.device) for _ in range(SLOTS)]
            for d in ("store", "load")
        }
        word = word_dtype(caches)
        self._rows = [plane.rows.view(word) for plane in caches.planes]
        # Each plane's place in each slot, built once: per-chunk Python work is what bounds host submission.
        self._words = {d: [slot.view(word) for slot in slots] for d, slots in self._staging.items()}
        self._views = {d: [[self._staged(p, slot) for p in caches.planes] for slot in slots]
                       for d, slots in self._words.items()}
        # A segment's chunk: as many blocks of one plane as a slot holds.
        self._segment_chunk = [max(1, min(size // p.block_bytes, caches.num_blocks)) for p in caches.planes]
        self._segment_views = {
            d: [[self._staged(p, slot, c) for p, c in zip(caches.planes, self._segment_chunk)] for slot in slots]
            for d, slots in self._words.items()}
        self._lanes: dict[Direction, Lanes] = {d: lanes_for(caches.device) for d in ("store", "load")}
        self._one_launch = self._piece_gather(caches)
        self._graphs = self._slot_graphs(caches)

    def _piece_gather(self, caches: KVCaches) -> gather.PieceGather | None:
        """A chunk's gather as one launch for every plane (`kvfsm.executor.gather`), where asked for and where it
        runs: compiled here, by gathering block 0, so an engine's first step does not pay the compilation; None
        (one launch per plane) otherwise, without Triton, off a GPU, or when it fails to build."""
        if not self.one_launch_gathers or not gather.available(caches.device):
            return None
        try:
            one_launch = gather.PieceGather(caches.planes, self._rows, caches.gpu_block_bytes)
            one_launch(torch.zeros(1, dtype=torch.int64, device=caches.device), self._words["store"][0])
        except Exception as err:  # noqa: BLE001 (no compiler, an old driver: the per-plane launches still work)
            log.warning("one-launch gathers unavailable, gathering one plane at a time: %s: %s",
                        type(err).__name__, err)
            return None
        return one_launch

    def _slot_graphs(self, caches: KVCaches) -> dict[Direction, graphs.SlotGraphs] | None:
        """Full chunks' per-plane gathers and scatters captured as CUDA graphs, on a GPU where no one-launch
        gather serves; None (a launch per plane from the host) elsewhere, or when capture fails. Capturing runs
        each once: the scatters write block 0 with its own bytes, gathered into the load slots first."""
        if not self.graph_launches or self._one_launch is not None or not graphs.available(caches.device):
            return None
        first = torch.zeros(self._chunk, dtype=torch.int64, device=caches.device)
        try:
            for slot in range(SLOTS):
                for rows, view in zip(self._rows, self._views["load"][slot]):
                    torch.index_select(rows, 1, first, out=view)
            return {"store": graphs.SlotGraphs(self._launch_gathers, SLOTS, self._chunk, caches.device),
                    "load": graphs.SlotGraphs(self._launch_scatters, SLOTS, self._chunk, caches.device)}
        except Exception as err:  # noqa: BLE001 (an old driver, a capture refused: the launches still work)
            log.warning("graph launches unavailable, launching each plane's gather and scatter from the host: "
                        "%s: %s", type(err).__name__, err)
            return None

    def _staged(self, plane: Plane, slot: torch.Tensor, segment_chunk: int | None = None) -> torch.Tensor:
        """Where `plane`'s pieces of a chunk sit in a staging slot (in words), shaped like its rows[:, :chunk]:
        inside each whole block of a job's chunk, or packed block after block for a segment's chunk."""
        size = slot.element_size()
        if segment_chunk is not None:
            packed = slot[:segment_chunk * plane.block_bytes // size]
            return packed.view(segment_chunk, plane.pieces, plane.piece_bytes // size).transpose(0, 1)
        rows = slot.view(self._chunk, -1)[:, plane.offset // size:(plane.offset + plane.block_bytes) // size]
        return rows.view(self._chunk, plane.pieces, plane.piece_bytes // size).transpose(0, 1)

    def _dma(self, direction: Direction, slot: torch.Tensor, offsets: Sequence[int], host: torch.Tensor) -> None:
        """One copy per run of consecutive host blocks; scattered slots make a copy per block, sent in batches."""
        block_bytes = self._caches.gpu_block_bytes
        with RowCopies(self._caches.device, batched=True) as rows:
            for first, _, host_start, n in runs(range(len(offsets)), offsets, block_bytes):
                _move(rows, direction, slot, first * block_bytes, host, host_start, n * block_bytes)

    def _gather(self, blocks: Sequence[int], index: torch.Tensor, slot: int, paced: bool = False) -> None:
        """Blocks `blocks` (on the device: `index`) of every plane into staging slot `slot` of the stores; `paced`
        where the copy engine has other chunks to move meanwhile (`graphs.PACE_NS`)."""
        if self._one_launch is not None:
            self._one_launch(index, self._words["store"][slot])
            return
        if self._graphs is not None and len(index) == self._chunk:
            self._graphs["store"](index, slot, paced)
        else:
            self._launch_gathers(index, slot)

    def _launch_gathers(self, index: torch.Tensor, slot: int, pause_ns: int = 0) -> None:
        for plane, (rows, view) in enumerate(zip(self._rows, self._views["store"][slot])):
            if plane and pause_ns:
                graphs.pause(pause_ns)
            torch.index_select(rows, 1, index, out=view[:, :len(index)])

    def _scatter(self, blocks: Sequence[int], index: torch.Tensor, slot: int, paced: bool = False) -> None:
        """Staging slot `slot` of the loads into blocks `blocks` of every plane; `paced` as for `_gather`."""
        if self._graphs is not None and len(index) == self._chunk:
            self._graphs["load"](index, slot, paced)
        else:
            self._launch_scatters(index, slot)

    def _launch_scatters(self, index: torch.Tensor, slot: int, pause_ns: int = 0) -> None:
        for plane, (rows, view) in enumerate(zip(self._rows, self._views["load"][slot])):
            if plane and pause_ns:
                graphs.pause(pause_ns)
            rows.index_copy_(1, index, view[:, :len(index)])

    def _segment_gather(self, segment: int, blocks: Sequence[int], index: torch.Tensor, slot: int) -> None:
        """One plane's share of blocks `blocks`, packed block after block into staging slot `slot`."""
        view = self._segment_views["store"][slot][segment]
        torch.index_select(self._rows[segment], 1, index, out=view[:, :len(index)])

    def _segment_scatter(self, segment: int, blocks: Sequence[int], index: torch.Tensor, slot: int) -> None:
        view = self._segment_views["load"][slot][segment]
        self._rows[segment].index_copy_(1, index, view[:, :len(index)])

    def _step(self, direction: Direction, blocks: Sequence[int], index: torch.Tensor, offsets: Sequence[int],
              host: torch.Tensor, paced: bool) -> Step:
        slots = self._staging[direction]
        if direction == "store":
            return (lambda s: self._gather(blocks, index, s, paced),
                    lambda s: self._dma("store", slots[s], offsets, host))
        return (lambda s: self._dma("load", slots[s], offsets, host),
                lambda s: self._scatter(blocks, index, s, paced))

    def _segment_dma(self, direction: Direction, slot: torch.Tensor, plane: Plane,
                     host_runs: tuple[tuple[int, int, int, int], ...], host: torch.Tensor) -> None:
        """One 2-D DMA per run of consecutive host blocks: row i is block i's share of `plane`."""
        width, pitch = plane.block_bytes, self._caches.gpu_block_bytes
        with RowCopies(self._caches.device, batched=True) as rows:  # a lone host block is a one-row copy: batched
            for first, _, host_start, n in host_runs:
                if direction == "store":
                    rows.copy(host, host_start + plane.offset, pitch, slot, first * width, width, width, n)
                else:
                    rows.copy(slot, first * width, width, host, host_start + plane.offset, pitch, width, n)

    def run_segment(self, direction: Direction, placement: Placement, host: torch.Tensor, segment: int,
                    index: torch.Tensor, join: bool) -> None:
        plane, c = self._caches.planes[segment], self._segment_chunk[segment]
        slots = self._staging[direction]

        def step(i: int, host_runs: tuple[tuple[int, int, int, int], ...]) -> Step:
            blocks, chunk = placement.gpu_blocks[i:i + c], index[i:i + c]
            dma = lambda s: self._segment_dma(direction, slots[s], plane, host_runs, host)  # noqa: E731
            if direction == "store":
                return lambda s: self._segment_gather(segment, blocks, chunk, s), dma
            return dma, lambda s: self._segment_scatter(segment, blocks, chunk, s)

        plan = chunk_runs(placement.host_offsets, c, self._caches.gpu_block_bytes)
        self._lanes[direction].run([step(i, host_runs) for i, host_runs in plan], join)

    def run(self, direction: Direction, placement: Placement, host: torch.Tensor, index: torch.Tensor,
            join: bool = True) -> None:
        c, n = self._chunk, len(placement.gpu_blocks)
        # Paced unless the copy engine waits on it: a pipeline's first gather (before any DMA), a job's last
        # scatter (after every DMA); the others overlap DMAs of other chunks.
        critical = (0 if join else -1) if direction == "store" else (n - 1) // c
        steps = [
            self._step(direction, placement.gpu_blocks[i:i + c], index[i:i + c], placement.host_offsets[i:i + c],
                       host, i // c != critical)
            for i in range(0, n, c)
        ]
        self._lanes[direction].run(steps, join)


class FusedGather(StagedGather):
    """staged-gather with each chunk gathered by one launch for all planes (where Triton runs on the caches' GPU;
    elsewhere it is staged-gather). One launch gathers at the full memory bandwidth: on a Llama-3-8B kv-first
    cache it took 4.3–5.5% of a concurrent matmul against 2.0–2.3% for staged-gather's paced graphs of a launch
    per plane (H100), for about the same share of the ceiling both ways at once (0.84–1.0 against 0.74–0.99)."""

    one_launch_gathers = True


class StagedCopy(StagedGather):
    """staged-gather with the gathering done by the copy engines instead of kernels: one device-to-device 2-D copy
    per plane per run of consecutive GPU blocks. Only where each block is one piece per tensor (cross-layer
    caches), where those copies are large; it leaves the SMs to compute while keeping one big DMA per host run."""

    graph_launches = False

    def __init__(self, caches: KVCaches, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if not caches.block_contiguous:
            raise MechanismError(
                f"'staged-copy' needs each block contiguous in every tensor; layouts are {dict(caches.layouts)}")
        super().__init__(caches, staging_bytes)

    def _copy(self, to_staging: bool, slot: torch.Tensor, planes: Sequence[Plane], blocks: Sequence[int],
              packed: bool) -> None:
        """Each plane's rows of `blocks` to or from the slot: inside whole blocks, or packed for one segment."""
        rows = RowCopies(self._caches.device)
        for plane in planes:
            width, cached = plane.block_bytes, plane.rows
            pitch, offset = (width, 0) if packed else (self._caches.gpu_block_bytes, plane.offset)
            for first, start, _, n in runs(blocks, range(len(blocks)), 1):
                if to_staging:
                    rows.copy(slot, first * pitch + offset, pitch, cached, start * width, width, width, n)
                else:
                    rows.copy(cached, start * width, width, slot, first * pitch + offset, pitch, width, n)

    def _gather(self, blocks: Sequence[int], index: torch.Tensor, slot: int, paced: bool = False) -> None:
        self._copy(True, self._staging["store"][slot], self._caches.planes, blocks, packed=False)

    def _scatter(self, blocks: Sequence[int], index: torch.Tensor, slot: int, paced: bool = False) -> None:
        self._copy(False, self._staging["load"][slot], self._caches.planes, blocks, packed=False)

    def _segment_gather(self, segment: int, blocks: Sequence[int], index: torch.Tensor, slot: int) -> None:
        self._copy(True, self._staging["store"][slot], self._caches.planes[segment:segment + 1], blocks, packed=True)

    def _segment_scatter(self, segment: int, blocks: Sequence[int], index: torch.Tensor, slot: int) -> None:
        self._copy(False, self._staging["load"][slot], self._caches.planes[segment:segment + 1], blocks, packed=True)
