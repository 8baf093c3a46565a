"""A small deterministic model whose output depends on the KV bytes actually in the cache.

It writes each layer's K and V for the scheduled tokens as a pure function of (token, position, layer), and picks
the next token from a position-weighted sum of every KV value the request's blocks hold. A stale, poisoned,
swapped or half-written block therefore changes the output, as a real model's garbled output would; and because
every value is a small integer, the arithmetic is exact and the same workload gives the same tokens on any device.

Tensor parallelism shards it as engines shard attention: a rank holds a contiguous range of heads, writes and reads
only their KV and contributes a partial sum; the token comes from the sum over every rank (an all-reduce) and, the
arithmetic being exact, equals the unsharded model's token. With replicated KV (MLA) every rank holds and writes
every head's KV, and reads only its share of the heads (`reads`), as MLA ranks split the query heads over one
latent that every rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON_BYTE = 0xFF
"""Freed blocks are filled with this byte: as float16 it is NaN, so a poisoned read shows in the output."""
POISONED_TOKEN = -1
"""What `token` yields from a sum that read a poisoned value: no real token is negative."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 4
    block_size: int = 4
    vocab: int = 1000
    dtype: torch.dtype = torch.float16

    @property
    def gpu_block_bytes(self) -> int:
        """Bytes of one GPU block across all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_heads * self.head_dim * self.dtype.itemsize


class ToyModel:
    """The compute a step runs for one request: write KV for new positions, then read all of it for a token."""

    def __init__(self, shape: ModelShape, caches: list[torch.Tensor], heads: range | None = None,
                 reads: range | None = None) -> None:
        """`heads`: the heads whose KV this model holds and writes; `reads`: those whose share of the sum it
        computes (default: all it holds)."""
        self.shape = shape
        self.caches = caches  # per layer, kv-first: (2, blocks, block_size, len(heads), dim)
        self.heads = heads if heads is not None else range(shape.num_heads)
        reads = reads if reads is not None else self.heads
        self._reads = slice(reads.start - self.heads.start, reads.stop - self.heads.start)
        device = caches[0].device
        s = shape
        lanes = torch.arange(2 * s.num_heads * s.head_dim, device=device, dtype=torch.int64)
        # broadcast over positions; only this model's heads
        self._lanes = lanes.view(2, 1, s.num_heads, s.head_dim)[:, :, self.heads.start:self.heads.stop]

    def kv_values(self, tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """K and V of this model's heads for `tokens` at `positions`, shape (2, n, heads, dim): small exact
        integers."""
        base = tokens.to(torch.int64) * 31 + positions * 7 + layer * 13
        return ((base.view(1, -1, 1, 1) + self._lanes) % 251 - 125).to(self.shape.dtype)

    def write(self, block_ids: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """Write KV for `tokens` occupying positions start, start+1, ... of a request whose blocks are `block_ids`."""
        for layer in range(len(self.caches)):
            self.write_layer(layer, block_ids, tokens, start)

    def write_layer(self, layer: int, block_ids: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """`write` for one layer: what a layer-by-layer forward does before that layer's attention."""
        positions = torch.arange(start, start + tokens.numel(), device=tokens.device)
        blocks = block_ids[positions // self.shape.block_size]
        offsets = positions % self.shape.block_size
        self.caches[layer][:, blocks, offsets] = self.kv_values(tokens, positions, layer)

    def read_layer(self, layer: int, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """Layer `layer`'s share of the next token's sum over the first `length` positions (float64, exact)."""
        positions = torch.arange(length, device=block_ids.device)
        blocks = block_ids[positions // self.shape.block_size]
        offsets = positions % self.shape.block_size
        weights = (positions + 1).to(torch.float64).view(1, -1, 1, 1)
        held = self.caches[layer][:, blocks, offsets][..., self._reads, :]
        return (held.to(torch.float64) * weights).sum() * (layer + 1)

    def token(self, total: torch.Tensor) -> torch.Tensor:
        """The token a summed read picks: NaN (poison) propagates to a negative token."""
        poisoned = torch.full((), float(POISONED_TOKEN), dtype=torch.float64, device=total.device)
        return torch.where(torch.isnan(total), poisoned, torch.remainder(total, self.shape.vocab)).to(torch.int64)

    def partial_sum(self, block_ids: torch.Tensor, length: int) -> torch.Tensor:
        """This model's heads' share of the sum the token after `length` positions is picked from."""
        return sum((self.read_layer(layer, block_ids, length) for layer in range(len(self.caches))),
                   torch.zeros((), dtype=torch.float64, device=block_ids.device))
