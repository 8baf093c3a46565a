"""Which KV-cache groups kvfsm offloads under vLLM 0.32, with vLLM's own configuration logic and real Scheduler.

kvfsm does not declare vLLM's hybrid-allocator support, so vLLM promotes a model's sliding-window layers to full
attention (every block kept) and hands the connector one group; a configuration with several groups is refused
at start-up, naming each group's kind. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvfsm.integrations.vllm import UnsupportedKVCache  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, FakeWorker, vllm_config  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

GPU_BLOCKS = 64
SHAPE = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16)


def model_layers() -> dict:
    """A two-layer hybrid: one full-attention layer, one with a 32-token sliding window."""
    return {"layers.0.attn": FullAttentionSpec(**SHAPE), "layers.1.attn": SlidingWindowSpec(**SHAPE, sliding_window=32)}


def test_vllm_turns_the_hybrid_allocator_off_for_kvfsm(model) -> None:
    assert vllm_config(model, {"cpu_blocks": 32}, GPU_BLOCKS).scheduler_config.disable_hybrid_kv_cache_manager


def test_a_sliding_window_model_offloads_as_one_full_attention_group(model) -> None:
    layers = model_layers()
    unify_hybrid_kv_cache_specs(layers)  # what vLLM does with the hybrid allocator off
    assert {type(spec) for spec in layers.values()} == {FullAttentionSpec}
    cache = KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_tensors=[],
                          kv_cache_groups=[KVCacheGroupSpec(list(layers), next(iter(layers.values())))])
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, GPU_BLOCKS), FakeWorker(), cache)
    try:
        store_prefix(d)
        d.add("reader", PREFIX + [1, 2, 3])
        d.run()
        (load,) = loads_of(d, "reader")
        assert len(load.gpu_blocks) == len(PREFIX) // BLOCK_SIZE  # the window's blocks and the ones before it
    finally:
        d.close()


def test_control_two_groups_as_the_hybrid_allocator_makes_them_are_refused_naming_their_kinds(model) -> None:
    groups = [KVCacheGroupSpec([name], spec) for name, spec in model_layers().items()]
    cache = KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(UnsupportedKVCache, match="0: FullAttentionSpec, 1: SlidingWindowSpec"):
        Driver(vllm_config(model, {"cpu_blocks": 32}, GPU_BLOCKS), FakeWorker(), cache)
