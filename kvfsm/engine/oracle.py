"""The toy model's data oracles: what the bytes and the tokens must be, computed without kvfsm.

The toy model's KV is a pure function of (token, position, layer), so the bytes a CPU block must hold follow from
the prompt tokens its hash covers; and a request's tokens follow from its prompt, so the run without offloading
(`expected_tokens`) is the reference every offloaded run must reproduce exactly. They live beside the toy model
because the demo's and `kvfsm.tp`'s verdicts read them, as the tests do.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvfsm.engine.config import EngineConfig
from kvfsm.engine.engine import Engine
from kvfsm.engine.model import POISONED_TOKEN, ModelShape, ToyModel
from kvfsm.executor.sim import SimDevice


@lru_cache(maxsize=4096)
def expected_tokens(prompt: tuple[int, ...], max_new_tokens: int, shape: ModelShape) -> tuple[int, ...]:
    """The tokens a request yields on an engine without offloading, preemption or sharing."""
    blocks = -(-(len(prompt) + max_new_tokens) // shape.block_size)
    device = SimDevice()
    engine = Engine(EngineConfig(num_gpu_blocks=blocks, max_batched_tokens=len(prompt) + 1, model=shape), device)
    engine.add_request("reference", prompt, max_new_tokens)
    while engine.has_work:
        engine.step()
    device.run_until_idle()
    return tuple(engine.outputs()[0])


class BlockOracle:
    """Knows which prompt tokens every prefix hash covers, hence the exact bytes of a stored CPU block."""

    def __init__(self, shape: ModelShape, block_size_factor: int) -> None:
        self.shape = shape
        self.k = block_size_factor
        self.tokens: dict[int, tuple[int, ...]] = {}
        self._model = ToyModel(shape, [torch.zeros(2, 1, shape.block_size, shape.num_heads, shape.head_dim,
                                                   dtype=shape.dtype)])

    def learn(self, prompt: tuple[int, ...], gpu_block_hashes: tuple[int, ...]) -> None:
        span = self.shape.block_size * self.k
        for index in range(len(gpu_block_hashes) // self.k):
            self.tokens[gpu_block_hashes[(index + 1) * self.k - 1]] = prompt[:(index + 1) * span]

    def cpu_block_bytes(self, block_hash: int, heads: range | None = None, layout: str = "kv-first") -> torch.Tensor:
        """Host bytes of the CPU block for `block_hash`: per GPU block, layer by layer, K then V; with `heads`, the
        bytes of a tensor-parallel rank that holds only those heads (`layout`: as `prefix_bytes`)."""
        return self.prefix_bytes(self.tokens[block_hash], heads, layout)

    def prefix_bytes(self, prefix: tuple[int, ...], heads: range | None = None, layout: str = "kv-first"
                     ) -> torch.Tensor:
        """Host bytes of the CPU block that ends `prefix` (a whole number of CPU blocks long), of caches in
        `layout`: "kv-first" (K then V per layer) or "mla" (one latent per token: its K and V side by side)."""
        span = self.shape.block_size * self.k
        start = len(prefix) - span
        tokens = torch.tensor(prefix[start:], dtype=torch.int64)
        positions = torch.arange(start, len(prefix))
        per_layer = [self._model.kv_values(tokens, positions, layer) for layer in range(self.shape.num_layers)]
        # (layers, 2, k * block_size, heads, dim) -> per GPU block: (layers, 2, block_size, heads, dim)
        stacked = torch.stack(per_layer).unflatten(2, (self.k, self.shape.block_size))
        if heads is not None:
            stacked = stacked[..., heads.start:heads.stop, :]
        order = (2, 0, 3, 1, 4, 5) if layout == "mla" else (2, 0, 1, 3, 4, 5)  # mla: (k, layers, block_size, 2, ...)
        return stacked.permute(*order).contiguous().view(torch.uint8).flatten()


def poisoned(outputs: dict[int, list[int]]) -> list[int]:
    """Handles of requests whose tokens show a poisoned read."""
    return [handle for handle, tokens in outputs.items() if POISONED_TOKEN in tokens]
