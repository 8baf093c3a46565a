"""Several full-attention KV-cache groups, and block hashes finer than a block, with vLLM 0.32's real Scheduler.

vLLM's hybrid allocator splits the full-attention layers into several groups when they outnumber the other kind
(groups `[Full, Full, SlidingWindow]`): every full group holds the same prefix, each for its own layers, in blocks of
its own. kvfsm stores each whole under its own keys and offers a hit only where every full group holds it all and
every sliding group its window (`groups`, `window_hit`). A `prefix_match_unit` below the block size hashes a block
several times; kvfsm keys a block by one hash, so it refuses that at start-up by name. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvfsm.integrations.vllm import UnsupportedKVCache  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, vllm_config  # noqa: E402
from test_vllm_groups import SHAPE, WINDOW, HybridWorker, prefix_block  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

LAYERS = ("layers.0.attn", "layers.2.attn", "layers.1.attn")
"""One layer per group, in vLLM's group order: two full-attention groups, then a sliding-window group."""


def two_full_groups(num_blocks: int, hash_block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    """Groups `[Full, Full, SlidingWindow]`, as vLLM's hybrid allocator makes them for two full layers to one, hashed
    every `hash_block_size` tokens (vLLM's engine resolves it to the block size unless `prefix_match_unit` says)."""
    specs = (FullAttentionSpec(**SHAPE), FullAttentionSpec(**SHAPE), SlidingWindowSpec(**SHAPE, sliding_window=WINDOW))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([layer], spec) for layer, spec in zip(LAYERS, specs)])
    config.hash_block_size = hash_block_size
    return config


class ThreeGroupWorker(HybridWorker):
    """`HybridWorker` over groups `[Full, Full, SlidingWindow]`: each position's token id (mod 251) plus 256 times its
    group's index lands in that group's block, so a reloaded block's bytes say which prefix and group they came from."""

    layers = LAYERS

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        self.open(config, two_full_groups(config.cache_config.num_gpu_blocks))


def test_each_full_attention_group_reloads_its_own_whole_prefix(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = ThreeGroupWorker(config)
    d = Driver(config, worker, two_full_groups(48))
    try:
        store_prefix(d)
        worker.caches[LAYERS[0]].zero_()  # whatever the reader finds now came from the CPU pool
        d.add("reader", PREFIX + [9])
        d.run()
        loaded = [[worker.block_tokens(b) for order in loads_of(d, tracked) for b in order.gpu_blocks]
                  for tracked in ("reader", "reader@g1", "reader@g2")]
        assert loaded == [[prefix_block(i, 0) for i in range(4)], [prefix_block(i, 1) for i in range(4)],
                          [prefix_block(i, 2) for i in (2, 3)]]
        assert d.cpu_pool_drained()
    finally:
        d.close()


def test_block_hashes_finer_than_a_block_are_refused_at_start_up_saying_why(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    with pytest.raises(UnsupportedKVCache) as refused:
        Driver(config, FakeWorker(), two_full_groups(48, hash_block_size=BLOCK_SIZE // 2))
    assert str(refused.value) == (
        f"vLLM hashes every {BLOCK_SIZE // 2} tokens (prefix_match_unit) and pages {BLOCK_SIZE} tokens a block (0: "
        "FullAttentionSpec, 1: FullAttentionSpec, 2: SlidingWindowSpec): kvfsm keys a block by one hash, the hash "
        f"of the prefix up to its end; unset prefix_match_unit or set it to {BLOCK_SIZE}")
