"""A request as the reference engine holds it, and the share of a forward pass one request gets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

_HASH_MASK = (1 << 63) - 1


class Phase(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    HELD = "held"
    """Finished or aborted; the engine keeps its blocks until the connector releases them."""
    DONE = "done"


@dataclass(eq=False)
class EngineRequest:
    """One request: its host-known prompt, and the tokens the device samples (read only when it finishes)."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    block_size: int
    handle: int
    phase: Phase = Phase.WAITING
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sampled: list[torch.Tensor] = field(default_factory=list)
    num_sampled: int = 0
    block_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        hashes, parent = [], 0
        for start in range(0, len(self.prompt) - self.block_size + 1, self.block_size):
            parent = hash((parent, self.prompt[start:start + self.block_size])) & _HASH_MASK
            hashes.append(parent)
        self.block_hashes = tuple(hashes)

    @property
    def num_tokens(self) -> int:
        """Prompt plus the tokens sampled so far: the positions its KV must cover before the next sample."""
        return len(self.prompt) + self.num_sampled

    @property
    def finished(self) -> bool:
        return self.num_sampled >= self.max_new_tokens


@dataclass(frozen=True)
class Work:
    """One request's part of a forward pass: KV for positions [start, end), then maybe a sample."""

    request: EngineRequest
    blocks: tuple[int, ...]
    start: int
    end: int
    sample: bool
