"""Every plane's share of a chunk of blocks gathered into a staging slot by one kernel launch.

A staged store gathers a chunk of scattered GPU blocks into a contiguous staging slot before its DMA. Per-layer
caches (kv-first: a tensor per layer, each block two 32 KiB pieces per layer for Llama-3-8B) made that one
`index_select` launch per layer: 32 launches per chunk at ~10–15 µs of host time each, which put ~0.45 ms of host
work between a step's start and its first DMA (measured on an H200 host). torch has no gather over many tensors,
so this is a Triton kernel over a table of piece base addresses: one launch per chunk, whatever the layer count.

Used only where Triton is importable and the caches are on a GPU; elsewhere (the CPU simulator, CI) the per-plane
`index_select` stays, and `tests/test_gpu_executor.py` checks that both put the same bytes in the slot.
"""

from __future__ import annotations

from functools import cache
from importlib.util import find_spec
from typing import Any, Sequence

import torch

from kvfsm.executor.layouts import Plane

WORDS_PER_STEP = 1024
"""Words one program moves per loop step (4 warps: 8 words a thread). Other shapes (1–8 warps, 128–2048 words)
moved the same bytes in the same time and slowed a concurrent matmul as much (H200)."""


def available(device: torch.device) -> bool:
    """Whether one-launch gathers run here: Triton installed (CUDA builds of torch ship it) and caches on a GPU."""
    return device.type == "cuda" and find_spec("triton") is not None


@cache
def _kernel() -> Any:
    """The Triton kernel, defined on first use: importing Triton costs a CPU-only process for nothing."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_pieces(bases, strides, lengths, offsets, index, out, block_words, WORDS: tl.constexpr):
        """Program (piece, i) copies piece `piece` of GPU block `index[i]` into block i of `out`."""
        piece = tl.program_id(0)
        i = tl.program_id(1)
        source = tl.load(bases + piece).to(out.dtype) + tl.load(index + i) * tl.load(strides + piece)
        target = out + i * block_words + tl.load(offsets + piece)
        length = tl.load(lengths + piece)
        for start in range(0, length, WORDS):
            words = start + tl.arange(0, WORDS)
            inside = words < length
            tl.store(target + words, tl.load(source + words, mask=inside), mask=inside)

    return gather_pieces


class SlotOverflow(ValueError):
    """More blocks than the staging slot holds: the kernel would write past the slot, silently."""


class PieceGather:
    """The piece table of some planes (each piece: base address, block stride, length, place in a staged block),
    built once, and the launch that gathers a chunk of blocks by it."""

    def __init__(self, planes: Sequence[Plane], words: Sequence[torch.Tensor], block_bytes: int) -> None:
        """`words[i]`: plane i's rows viewed as words (one dtype for all); `block_bytes`: one staged block's size."""
        size = words[0].element_size()
        table = [(rows[p].data_ptr(), rows.stride(1), plane.piece_bytes // size,
                  (plane.offset + p * plane.piece_bytes) // size)
                 for plane, rows in zip(planes, words) for p in range(plane.pieces)]
        device = words[0].device
        # Byte addresses, cast to pointers of the slot's word type in the kernel; strides, lengths and offsets in
        # words, which is what pointer arithmetic on such a pointer counts.
        self._bases, self._strides, self._lengths, self._offsets = (
            torch.tensor(column, dtype=torch.int64, device=device) for column in zip(*table))
        self._pieces = len(table)
        self._block_words = block_bytes // size
        self._kernel = _kernel()

    def __call__(self, index: torch.Tensor, slot: torch.Tensor) -> None:
        """Blocks `index` (on the device) of every piece into the first `len(index)` blocks of `slot` (in words)."""
        if len(index) * self._block_words > slot.numel():
            raise SlotOverflow(f"{len(index)} blocks do not fit a staging slot of {slot.numel() // self._block_words}")
        if len(index):
            self._kernel[(self._pieces, len(index))](self._bases, self._strides, self._lengths, self._offsets,
                                                     index, slot, self._block_words, WORDS=WORDS_PER_STEP)
