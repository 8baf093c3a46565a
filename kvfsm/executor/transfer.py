"""Stores and loads of KV blocks between registered caches and the host pool, as device operations.

`Transfers` is the one place a job's block ids and slots are checked and turned into a placement; a bad job
raises before anything is enqueued, so a wrong id can never become a silent wrong copy. Every operation declares
the blocks it reads and writes, which is what the simulator's access log (and so the spec's ordering invariants)
is built from. A CPU slot holds `block_size_factor` consecutive GPU blocks, block-major.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from itertools import accumulate, chain, pairwise
from typing import Sequence

import torch

from kvfsm.executor.device import Device, StreamName, Touch
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.block_ids import BlockIds
from kvfsm.executor.choice import build, resolve
from kvfsm.executor.mechanisms import DEFAULT_STAGING_BYTES, Direction, Placement
from kvfsm.executor.pool import HostPool

POISON_BYTE = 0xA5

MIN_LAYER_COPY_BYTES = 2 << 20
"""Bytes a load's layer segment must move per copy on average, or a gathering mechanism sends the load whole, in its
first segment. A layer segment copies each run of consecutive CPU slots once, and the pieces of a layer are short (64
KiB per Llama-3-8B 16-token block), so a pool whose free slots are fragmented makes many small copies. H100,
kv-first, 512 blocks loaded from runs of 512, 64, 17, 8, 4 and 1 slots: a layer at a time moved 0.95, 0.93, 0.83,
0.75, 0.60 and 0.49 of the ceiling, the whole load through staging 0.95-1.0 in every case (0.66 once in a second
call, noise: the same slots sent whole by this rule moved 0.97 there). A prompt's layers then wait for the whole
load, which the bandwidth repays: the layers' compute a per-layer load overlaps, the tail of a prefix hit, is a few
per cent of its load time (`kvfsm.bench.ttft`). 2 MiB a copy is 32 slots a run there. Varied prompt lengths under the
scheduler bench's churn left load jobs 17 slots a run on average."""


class TransferError(ValueError):
    """A job whose shape does not match the caches, the pool or the block size factor."""


class IdOutOfRange(TransferError, IndexError):
    """A GPU block id or CPU slot outside the registered caches or the pool."""


class UnknownLayer(KeyError):
    """A per-layer hook named a layer that is not a registered KV cache."""


def _ids(values: Sequence[int], limit: int, what: str) -> tuple[int, ...]:
    ids = tuple(map(operator.index, values))  # in C: a job's ids are checked on the step's critical path
    if ids and (min(ids) < 0 or max(ids) >= limit):
        raise IdOutOfRange(f"{what} {[v for v in ids if not 0 <= v < limit]} out of range [0, {limit})")
    return ids


def _distinct(ids: tuple[int, ...], what: str) -> None:
    if len(set(ids)) != len(ids):
        raise TransferError(f"{what} {list(ids)} name the same one twice: one of the two writes would be lost")


class Transfers:
    """Enqueues stores on the "store" stream and loads on the "load" stream of `device`.

    With staged-gather (the default) it holds four device staging slots of `staging_bytes` each (two per
    direction, capped at the cache's size; 128 MiB unless given), so a store and a load can run at once without
    sharing a slot."""

    def __init__(self, device: Device, caches: KVCaches, pool: HostPool, block_size_factor: int,
                 mechanism: str = "auto", staging_bytes: int | None = None) -> None:
        if block_size_factor < 1:
            raise TransferError(f"block_size_factor must be at least 1, got {block_size_factor}")
        if pool.slot_bytes != block_size_factor * caches.gpu_block_bytes:
            raise TransferError(
                f"a pool slot is {pool.slot_bytes} bytes, but {block_size_factor} GPU blocks are "
                f"{block_size_factor * caches.gpu_block_bytes}")
        if caches.device.type != device.tensor_device().type:
            raise TransferError(f"the caches are on {caches.device}, but the device runs on {device.tensor_device()}")
        self._device = device
        self._caches = caches
        self._pool = pool
        self.block_size_factor = block_size_factor
        self.mechanism = resolve(mechanism, caches)
        self._mechanism = build(self.mechanism, caches, staging_bytes or DEFAULT_STAGING_BYTES)
        self._block_ids = BlockIds(caches.device)
        self._segments = {plane.name: i for i, plane in enumerate(caches.planes)}

    def _host_offsets(self, slots: tuple[int, ...], first: int, count: int) -> tuple[int, ...]:
        """Where `count` consecutive GPU blocks sit in the host pool, from sub-block `first` of `slots[0]` on (a slot
        holds `block_size_factor` GPU blocks, block-major)."""
        k, slot_bytes = self.block_size_factor, self._pool.slot_bytes
        if k == 1:  # a GPU block per slot (the placements checked first == 0, count == len(slots)): in C
            return tuple(map(slot_bytes.__mul__, slots))
        block_bytes = self._caches.gpu_block_bytes
        return tuple(slots[(i + first) // k] * slot_bytes + (i + first) % k * block_bytes for i in range(count))

    def _index(self, placement: Placement) -> torch.Tensor | None:
        """The placement's GPU blocks on the device, for a gathering mechanism; None for a DMA-only one."""
        return self._block_ids(placement.gpu_blocks) if self._mechanism.chunk_blocks is not None else None

    def _sends_whole(self, placement: Placement) -> bool:
        """Whether a layer segment of this placement would copy less than `MIN_LAYER_COPY_BYTES` at a time, on a
        mechanism that could send it whole through staging in copies of whole blocks instead."""
        if self.num_segments == 1 or self._mechanism.chunk_blocks is None:
            return False
        offsets, block_bytes = placement.host_offsets, self._caches.gpu_block_bytes
        # counted in C: a 32k-token prompt's load is 2k blocks, on the step's critical path
        copies = len(offsets) - list(map(operator.sub, offsets[1:], offsets)).count(block_bytes)
        return copies > 1 and len(offsets) * block_bytes < MIN_LAYER_COPY_BYTES * copies * self.num_segments

    @property
    def num_segments(self) -> int:
        """Layer segments of a job: one per registered tensor (a cross-layer tensor is one segment of all its
        layers, since a block's layers are one copy there)."""
        return len(self._caches.planes)

    def segment_of(self, name: str) -> int:
        """The segment holding the registered tensor `name`."""
        segment = self._segments.get(name)
        if segment is None:
            raise UnknownLayer(f"{name!r} is not a registered KV cache; registered: {list(self._segments)}")
        return segment

    def _store_placement(self, gpu_blocks: Sequence[int], cpu_slots: Sequence[int]) -> Placement:
        k = self.block_size_factor
        blocks = _ids(gpu_blocks, self._caches.num_blocks, "GPU blocks")
        slots = _ids(cpu_slots, self._pool.num_slots, "CPU slots")
        if len(blocks) != k * len(slots):
            raise TransferError(f"a store of {len(slots)} CPU slots needs {k * len(slots)} GPU blocks, got {len(blocks)}")
        _distinct(slots, "CPU slots")
        return Placement(blocks, self._host_offsets(slots, 0, len(blocks)))

    def _load_placement(self, cpu_slots: Sequence[int], gpu_blocks: Sequence[int], gpu_offset: int) -> Placement:
        k = self.block_size_factor
        slots = _ids(cpu_slots, self._pool.num_slots, "CPU slots")
        blocks = _ids(gpu_blocks, self._caches.num_blocks, "GPU blocks")
        if not 0 <= gpu_offset < k:
            raise TransferError(f"gpu_offset must be in [0, {k}), got {gpu_offset}")
        most = k * len(slots) - gpu_offset if slots else 0
        fewest = most - k + 1 if slots else 0
        if not fewest <= len(blocks) <= most:
            raise TransferError(
                f"a load of {len(slots)} CPU slots from sub-block {gpu_offset} fills {fewest} to {most} GPU blocks, "
                f"got {len(blocks)}")
        _distinct(blocks, "GPU blocks")
        return Placement(blocks, self._host_offsets(slots, gpu_offset, len(blocks)))

    def store(self, gpu_blocks: Sequence[int], cpu_slots: Sequence[int], label: str = "store") -> None:
        """Copy k consecutive GPU blocks into each CPU slot, filling every slot."""
        placement = self._store_placement(gpu_blocks, cpu_slots)
        self._device.enqueue(
            "store", "store", label,
            lambda: self._mechanism.run("store", placement, self._pool.buffer, self._index(placement)),
            (Touch("read", "gpu", placement.gpu_blocks), Touch("write", "cpu", tuple(cpu_slots))))

    def load(self, cpu_slots: Sequence[int], gpu_blocks: Sequence[int], gpu_offset: int = 0,
             label: str = "load") -> None:
        """Copy CPU sub-blocks, starting at sub-block `gpu_offset` of the first slot, into consecutive GPU blocks;
        the last slot may be used only in part, every other slot from the offset on."""
        placement = self._load_placement(cpu_slots, gpu_blocks, gpu_offset)
        self._device.enqueue(
            "load", "load", label,
            lambda: self._mechanism.run("load", placement, self._pool.buffer, self._index(placement)),
            (Touch("read", "cpu", tuple(cpu_slots)), Touch("write", "gpu", placement.gpu_blocks)))

    def store_segments(self, gpu_blocks: Sequence[int], cpu_slots: Sequence[int]) -> Segments:
        """A store checked now, whose layer segments are enqueued one at a time (`Segments.enqueue`)."""
        return Segments(self, "store", self._store_placement(gpu_blocks, cpu_slots), tuple(cpu_slots))

    def store_chunks(self, gpu_blocks: Sequence[int], cpu_slots: Sequence[int]) -> Chunks:
        """A store checked now, whose copies are enqueued a chunk of blocks at a time (`Chunks.enqueue`)."""
        return Chunks(self, self._store_placement(gpu_blocks, cpu_slots), (len(cpu_slots) * self.block_size_factor,))

    def merge_chunks(self, parts: Sequence[Chunks]) -> Chunks:
        """Checked stores as one pipeline of chunks: a step's stores go out back to back, the copy engine never
        waiting for the next job's first gather. Their CPU slots must be distinct (no slot written twice)."""
        if len(parts) == 1:
            return parts[0]
        offsets = tuple(chain.from_iterable(part._placement.host_offsets for part in parts))
        _distinct(offsets, "CPU blocks of the merged stores")
        blocks = tuple(chain.from_iterable(part._placement.gpu_blocks for part in parts))
        return Chunks(self, Placement(blocks, offsets), tuple(chain.from_iterable(part._sizes for part in parts)))

    def load_segments(self, cpu_slots: Sequence[int], gpu_blocks: Sequence[int], gpu_offset: int = 0) -> Segments:
        """A load checked now, whose layer segments are enqueued one at a time (`Segments.enqueue`)."""
        return Segments(self, "load", self._load_placement(cpu_slots, gpu_blocks, gpu_offset), tuple(cpu_slots))

    def merge(self, parts: Sequence[Segments]) -> Segments:
        """Checked jobs of one direction as one whose layer segments each move every job's share of that layer:
        one submission per layer for all of a step's loads. Their GPU blocks must be distinct (one scatter)."""
        if len(parts) == 1:
            return parts[0]
        directions = {part._direction for part in parts}
        if len(directions) != 1:
            raise TransferError(f"cannot merge jobs of directions {sorted(directions)}")
        blocks = tuple(chain.from_iterable(part._placement.gpu_blocks for part in parts))
        _distinct(blocks, "GPU blocks of the merged jobs")
        offsets = tuple(chain.from_iterable(part._placement.host_offsets for part in parts))
        slots = tuple(dict.fromkeys(slot for part in parts for slot in part._cpu_slots))
        return Segments(self, directions.pop(), Placement(blocks, offsets), slots)

    def poison_gpu(self, gpu_blocks: Sequence[int], stream: StreamName, label: str = "poison GPU blocks") -> None:
        """Fill every byte of these GPU blocks with `POISON_BYTE`, so a copy that never landed shows."""
        blocks = _ids(gpu_blocks, self._caches.num_blocks, "GPU blocks")

        def fill() -> None:
            index = self._block_ids(blocks)
            for plane in self._caches.planes:
                plane.rows.index_fill_(1, index, POISON_BYTE)

        self._device.enqueue(stream, stream, label, fill, (Touch("write", "gpu", blocks),))

    def poison_cpu(self, cpu_slots: Sequence[int], stream: StreamName, label: str = "poison CPU slots") -> None:
        """Fill every byte of these CPU slots with `POISON_BYTE`, by a copy on `stream` so it keeps stream order."""
        slots = _ids(cpu_slots, self._pool.num_slots, "CPU slots")

        def fill() -> None:
            poison = torch.full((self._pool.slot_bytes,), POISON_BYTE, dtype=torch.uint8, device=self._caches.device)
            for slot in slots:
                self._pool.slot(slot).copy_(poison, non_blocking=True)

        self._device.enqueue(stream, stream, label, fill, (Touch("write", "cpu", slots),))


class Segments:
    """One job's placement, checked once, whose layer segments go out one at a time on the job's stream.

    Each segment is its own device operation touching only its layer, so a per-layer wait can follow it alone. The
    job's GPU block index is built by the first segment that runs and shared by the rest. A load a gathering
    mechanism would copy in small pieces (`MIN_LAYER_COPY_BYTES`) goes out whole as its first segment, touching
    every layer, and its later segments move nothing: each layer's wait still follows every byte of that layer."""

    def __init__(self, transfers: Transfers, direction: Direction, placement: Placement,
                 cpu_slots: tuple[int, ...]) -> None:
        self._transfers = transfers
        self._direction = direction
        self._placement = placement
        self._cpu_slots = cpu_slots
        self._index: torch.Tensor | None = None
        self._joined = False
        self.whole = direction == "load" and transfers._sends_whole(placement)
        """Whether the job goes out whole in segment 0 (a load from fragmented CPU slots)."""

    def nbytes(self, segment: int) -> int:
        """Bytes segment `segment` moves."""
        caches, blocks = self._transfers._caches, len(self._placement.gpu_blocks)
        if self.whole:
            return blocks * caches.gpu_block_bytes if segment == 0 else 0
        return blocks * caches.planes[segment].block_bytes

    def enqueue(self, segment: int, label: str) -> None:
        """Enqueue segment `segment` on the job's stream (behind whatever that stream waits on by now)."""
        t, direction, placement = self._transfers, self._direction, self._placement
        if self.whole and segment:
            return  # segment 0 moved it, earlier on the same stream
        # Loads go out back to back: only the first waits for the stream. Stores go out a layer at a time, each
        # behind its own compute event, so every one waits.
        join = direction == "store" or not self._joined
        self._joined = True

        def run() -> None:
            if self._index is None:
                self._index = t._index(placement)
            if self.whole:
                t._mechanism.run(direction, placement, t._pool.buffer, self._index, join)
            else:
                t._mechanism.run_segment(direction, placement, t._pool.buffer, segment, self._index, join)

        gpu = Touch("read" if direction == "store" else "write", "gpu", placement.gpu_blocks,
                    layer=None if self.whole else segment)
        cpu = Touch("write" if direction == "store" else "read", "cpu", self._cpu_slots)
        t._device.enqueue(direction, direction, label, run, (gpu, cpu))


class Chunks:
    """Checked stores (one job, or a step's jobs merged) whose copies go out one chunk of blocks at a time, every
    layer of a chunk together, as one pipeline: the first chunk waits for the stream, each later one continues
    the pipeline without waiting again, so the gather of the next job's first chunk overlaps the DMA of the last
    one's (waiting per job left the copy engine idle for a gather at every job boundary). A chunk is one device
    operation touching only its own blocks and slots, so chunks of stores and layer segments of loads can be
    sent in turns, both copy engines starting early. `ends[j]` is the chunk with the last block of part j.

    A gathering mechanism's chunk is a staging slot's worth of blocks; a DMA-only mechanism's is one part (job),
    so each job's event follows its own copies and an engine hears of it while the step's later jobs still copy
    (one chunk of the whole step held every job's report, and its GPU blocks' fences, until the last byte)."""

    def __init__(self, transfers: Transfers, placement: Placement, sizes: tuple[int, ...]) -> None:
        self._transfers = transfers
        self._placement = placement
        self._sizes = sizes
        n = len(placement.gpu_blocks)
        chunk = transfers._mechanism.chunk_blocks
        starts = range(0, n, chunk) if chunk is not None else dict.fromkeys(
            total for total in accumulate(sizes, initial=0) if total < n)
        self._bounds = (*(starts or (0,)), n)
        """Chunk i is blocks `_bounds[i]` to `_bounds[i + 1]` of the placement."""
        self.count = len(self._bounds) - 1
        self.ends = tuple(bisect_right(self._bounds, max(0, total - 1), hi=self.count) - 1
                          for total in accumulate(sizes))
        self._index: torch.Tensor | None = None

    def nbytes(self, chunk: int) -> int:
        """Bytes chunk `chunk` moves."""
        return (self._bounds[chunk + 1] - self._bounds[chunk]) * self._transfers._caches.gpu_block_bytes

    def part_bytes(self, chunk: int) -> tuple[int, ...]:
        """Bytes chunk `chunk` moves of each part (job), in part order: a chunk of merged stores may end one job and
        begin the next, and what each job sent is counted per job (`WorkerConnector.store_bytes`)."""
        start, stop, block_bytes = self._bounds[chunk], self._bounds[chunk + 1], self._transfers._caches.gpu_block_bytes
        return tuple(max(0, min(stop, end) - max(start, begin)) * block_bytes
                     for begin, end in pairwise(accumulate(self._sizes, initial=0)))

    def enqueue(self, chunk: int, label: str) -> None:
        """Enqueue chunk `chunk` on the store stream (chunks go out in order, the first behind the stream)."""
        t, start, stop = self._transfers, self._bounds[chunk], self._bounds[chunk + 1]
        part = Placement(self._placement.gpu_blocks[start:stop], self._placement.host_offsets[start:stop])

        def run() -> None:
            if self._index is None:  # one upload per pipeline (None for a DMA-only mechanism, which reads none)
                self._index = t._index(self._placement)
            index = self._index[start:stop] if self._index is not None else None
            t._mechanism.run("store", part, t._pool.buffer, index, chunk == 0)

        slots = tuple(dict.fromkeys(offset // t._pool.slot_bytes for offset in part.host_offsets))
        t._device.enqueue("store", "store", label, run,
                          (Touch("read", "gpu", part.gpu_blocks), Touch("write", "cpu", slots)))
