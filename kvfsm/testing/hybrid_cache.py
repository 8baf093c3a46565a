"""The hybrid cache's groups and bytes, for the rig of `kvfsm.testing.hybrid_rig`.

A group is what vLLM's hybrid allocator pages from one pool of GPU blocks: full attention keeps every block, a sliding
window the blocks its window still reads, a state a window of one block (the block at the end of a prefix). Each is
tracked by kvfsm as a request of its own with keys of its own (`CacheGroup.tracked`, `CacheGroup.key`), the vLLM
adapter's mapping (`kvfsm/integrations/vllm/groups.py`; both make their ids with `kvfsm.connector.tracked_ids`).
`BlockBytes` reads and writes whole blocks whatever the layout, as the host pool lays them out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kvfsm.connector.tracked_ids import tracked_id
from kvfsm.executor import KVCaches

NULL_BLOCK = 0
"""The engine's null block: what a window's table names below the window. Never handed out."""
NULL_FILL = 0x5A
"""The null block's bytes, which nothing may change."""
HASH_BITS = 48
"""Width of a block hash; a group's rank sits above it in the group's keys."""
CHUNK_BYTES = 1 << 30
"""The most bytes one tensor operation of the rig touches."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: its rank among the groups (0 is the full-attention group) and its window, if any."""

    name: str
    rank: int
    window_blocks: int | None
    """Blocks the window reads back from the next token (1: a state); None for full attention."""

    @property
    def label(self) -> int | None:
        """The number its tracked ids carry (`tracked_id`): its rank; None for the full-attention group."""
        return self.rank or None

    def tracked(self, req_id: str) -> str:
        """The id kvfsm's scheduler tracks this group of the request under (the adapter's naming)."""
        return tracked_id(req_id, self.label)

    def first_kept(self, tokens: int, block_tokens: int) -> int:
        """The first block the group still needs once `tokens` are computed: the next token's window starts there."""
        if self.window_blocks is None:
            return 0
        return max(0, tokens - self.window_blocks * block_tokens + 1) // block_tokens

    def key(self, block_hash: int) -> int:
        """The group's key for a block hash: no two groups' keys meet."""
        return block_hash | self.rank << HASH_BITS


@dataclass(frozen=True)
class HybridShape:
    """The KV cache the rig allocates; every group pages from its `gpu_blocks`."""

    layout: str
    layers: int
    block_tokens: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    gpu_blocks: int
    window_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one GPU block, every layer's (K and V, but for MLA's one latent)."""
        planes = 1 if self.layout == "mla" else 2 * self.heads
        return self.layers * self.block_tokens * planes * self.head_dim * self.dtype.itemsize

    @property
    def groups(self) -> tuple[CacheGroup, ...]:
        return (CacheGroup("full", 0, None), CacheGroup("window", 1, self.window_blocks), CacheGroup("state", 2, 1))


@dataclass(eq=False)
class RigRequest:
    """A request of the rig's engine: its content, its tokens and one block table per group."""

    req_id: str
    seed: int
    """What its tokens are: requests of one seed share their prefix's hashes and bytes."""
    prompt_tokens: int
    hashes: tuple[int, ...]
    """The hash chain of every full block it will hold."""
    num_tokens: int
    computed: int = 0
    tables: dict[str, list[int]] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)
    """Its groups' tracked ids whose load has not been reported yet."""
    ended: bool = False


class GroupView:
    """A request as kvfsm's scheduler tracks one of its groups (`kvfsm.connector.RequestView`)."""

    def __init__(self, request: RigRequest, group: CacheGroup, block_tokens: int) -> None:
        self._request, self._group, self._block_tokens = request, group, block_tokens
        self.request_id = group.tracked(request.req_id)

    @property
    def num_tokens(self) -> int:
        return self._request.num_tokens

    @property
    def block_hashes(self) -> list[int]:
        return [self._group.key(h) for h in self._request.hashes[:self._request.num_tokens // self._block_tokens]]


def hash_chain(seed: int, blocks: int) -> tuple[int, ...]:
    """Block i's hash covers the request's content up to block i, as an engine's prefix hashes do."""
    chain, parent = [], seed.to_bytes(8, "little")
    for i in range(blocks):
        parent = hashlib.blake2b(parent + i.to_bytes(4, "little"), digest_size=HASH_BITS // 8).digest()
        chain.append(int.from_bytes(parent, "little"))
    return tuple(chain)


class BlockBytes:
    """Whole GPU blocks as rows of bytes (every plane's pieces in the host pool's order), on the current stream, a
    GiB at a time (no tensor of 2**31 elements or more, which some kernels index with 32 bits)."""

    def __init__(self, caches: KVCaches) -> None:
        self.caches = caches
        self._pieces = [(plane.rows[p], plane.offset + p * plane.piece_bytes, plane.piece_bytes)
                        for plane in caches.planes for p in range(plane.pieces)]
        self.chunk_blocks = max(1, CHUNK_BYTES // caches.gpu_block_bytes)

    def _chunks(self, blocks: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """Each run of at most `chunk_blocks` of `blocks`: its first position and its ids on the caches' device,
        uploaded from pinned memory (a pageable upload would first wait for everything already on the stream)."""
        ids = list(blocks)
        for first in range(0, len(ids), self.chunk_blocks):
            index = torch.tensor(ids[first:first + self.chunk_blocks], dtype=torch.long)
            if self.caches.device.type == "cuda":
                index = index.pin_memory().to(self.caches.device, non_blocking=True)
            yield first, index

    def write(self, blocks: Sequence[int], rows: torch.Tensor) -> None:
        for first, index in self._chunks(blocks):
            for piece, start, size in self._pieces:
                piece.index_copy_(0, index, rows[first:first + len(index), start:start + size])

    def fill(self, blocks: Sequence[int], value: int) -> None:
        for _, index in self._chunks(blocks):
            for piece, _, _ in self._pieces:
                piece.index_fill_(0, index, value)

    def differing(self, blocks: Sequence[int], rows: torch.Tensor) -> int:
        """How many of `blocks` hold other bytes than their row of `rows`."""
        found = 0
        for first, index in self._chunks(blocks):
            expected = rows[first:first + len(index)]
            wrong = torch.zeros(len(index), dtype=torch.bool, device=index.device)
            for piece, start, size in self._pieces:
                wrong |= (piece.index_select(0, index) != expected[:, start:start + size]).any(dim=1)
            found += int(wrong.sum())
        return found
