"""Which transfer mechanism moves a set of caches: a name checked, or "auto" resolved from the caches' shape, the
choice weighed on measurements of bandwidth against the compute the copies take (`python -m kvfsm.bench`)."""

from __future__ import annotations

from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.mechanisms import (
    DEFAULT_STAGING_BYTES, MECHANISMS, DirectCopy, FusedGather, Mechanism, MechanismError, StagedCopy, StagedGather,
)

COPY_ENGINE_MIN_PIECE = 1 << 20
"""The smallest contiguous piece per block for which "auto" moves blocks by DMA alone (one copy per piece)."""


def resolve(name: str, caches: KVCaches) -> str:
    """The mechanism `name` stands for with these caches. "auto" weighs bandwidth against what the copies take
    from compute (`python -m kvfsm.bench connector`: the mechanisms called directly, the connector rounds and a
    concurrent matmul; H100 and H200). Where every block is a few contiguous pieces of at least
    `COPY_ENGINE_MIN_PIECE` (a cross-layer cache) it is "cross-layer": one DMA per run of blocks straight between
    the cache and the pool, sent to the driver in batches, nothing on the SMs: 0.98-1.0 of the ceiling each way at
    a 1.1-1.8% matmul slowdown, where gathering through staging first cost 2.0-5.4% for a few hundredths more of
    the ceiling both ways at once and less one way.
    Elsewhere (per-layer tensors: 64 KiB pieces for a Llama-3-8B 16-token block, which copied one by one run at a
    quarter of the ceiling) it is "staged-gather", its full chunks' launches replayed as paced CUDA graphs: 0.95-0.98
    of the ceiling each way and 0.74-0.99 both ways at 2.0-2.3%, as launching each from the host (before
    2026-11-26: 0.93-0.97, 0.78-0.93, 2.0-2.7%) but for ~1 ms of host time per GiB stored instead of 4-7; its
    gather kernels are the SM time a kv-first cache costs. Replayed back to back they took 2.4-3.3% (and moved
    stores 1.2-1.4x faster under a saturating matmul); "fused-gather" (one Triton kernel a chunk) took 4.3-5.5%."""
    if name == "auto":
        large = caches.block_contiguous and min(p.block_bytes for p in caches.planes) >= COPY_ENGINE_MIN_PIECE
        return "cross-layer" if large else "staged-gather"
    if name not in MECHANISMS:
        raise MechanismError(f"unknown transfer mechanism {name!r}; choose one of {MECHANISMS} or 'auto'")
    return name


def build(name: str, caches: KVCaches, staging_bytes: int = DEFAULT_STAGING_BYTES) -> Mechanism:
    """The mechanism `name` (already resolved) for `caches`."""
    if name == "staged-gather":
        return StagedGather(caches, staging_bytes)
    if name == "fused-gather":
        return FusedGather(caches, staging_bytes)
    if name == "staged-copy":
        return StagedCopy(caches, staging_bytes)
    return DirectCopy(caches, require_block_contiguous=(name == "cross-layer"))
