"""What a request with sliding-window groups is offered and counted (`kvfsm.integrations.vllm.window_hit`), under
vLLM's real Scheduler, the hybrid allocator on: the window groups are looked up once each when their windows are whole
where the full-attention hit ends; a shorter hit is counted once, as the blocks it loads; and a shorter hit after a GPU
prefix is offered from that prefix's end; a request its GPU prefix serves whole counts no replay-window block below
it; a hit vLLM sets aside after it was offered loads nothing in any group.
Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, FakeWorker, vllm_config  # noqa: E402
from test_vllm_groups import SHAPE, WINDOW, hybrid  # noqa: E402,F401
from test_vllm_window_hit import LONG, READER  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm


def loaded_blocks(d: Driver, req_id: str) -> int:
    """GPU blocks loaded for the request, in every group."""
    return sum(len(order.gpu_blocks) for tracked in (req_id, f"{req_id}@g1") for order in loads_of(d, tracked))


def first_computed(d: Driver, req_id: str) -> int:
    """The tokens the request had computed when first scheduled (its GPU prefix and what it loaded)."""
    return next(log.first_computed[req_id] for log in d.log if req_id in log.first_computed)


def test_a_hit_whose_windows_are_whole_where_the_full_hit_ends_is_looked_up_once_per_group(hybrid) -> None:
    """The writer's window ends where the reader's full hit does: no shorter end is searched, and kvfsm's lookup
    counter (`kvfsm_lookups_total`) counts one lookup per group."""
    d = hybrid()
    store_prefix(d)
    stats = d.connector.scheduler_side.kvfsm.stats
    before = stats.lookups
    d.add("reader", PREFIX + [9])
    d.run()
    assert loaded_blocks(d, "reader") == len(PREFIX) // BLOCK_SIZE + 2
    assert stats.lookups - before == 2, f"{stats.lookups - before} lookups for one request of two groups"


def test_a_shorter_hit_counts_as_hit_blocks_only_the_blocks_it_loads(hybrid) -> None:
    """The window ending at the reader's full hit (blocks 0 and 1) lacks block 1, and the window ending at block 1 is
    held: the window group's first lookup found block 0, and only the blocks loaded count
    (`kvfsm_hit_blocks_total{tier="cpu"}`), not that first lookup's as well."""
    d = hybrid()
    store_prefix(d, PREFIX[:BLOCK_SIZE] + [1, 2, 3], "short")  # both groups hold block 0
    store_prefix(d, PREFIX + [7] * BLOCK_SIZE + [1, 2, 3])  # the full group holds blocks 0-4, the window 3 and 4
    stats = d.connector.scheduler_side.kvfsm.stats
    before = stats.cpu_hit_blocks
    d.add("reader", PREFIX[:2 * BLOCK_SIZE] + [9])
    d.run()
    assert first_computed(d, "reader") == BLOCK_SIZE
    assert stats.cpu_hit_blocks - before == loaded_blocks(d, "reader") == 2
    assert d.cpu_pool_drained()


def test_a_shorter_hit_after_a_gpu_prefix_is_offered_from_the_gpu_prefixs_end(hybrid) -> None:
    """The GPU holds blocks 0 and 1 (a request of that prefix ran after the stores); the CPU pool's full hit ends at
    block 6, whose window lacks block 4, and the window ending at block 4 is held: the reader loads blocks 2 and 3 in
    each group and computes from block 4."""
    d = hybrid()
    store_prefix(d)
    store_prefix(d, LONG + [1, 2, 3], "long")
    d.add("warm", LONG[:2 * BLOCK_SIZE] + [5])
    d.run()
    d.add("reader", READER)
    d.run()
    assert first_computed(d, "reader") == 4 * BLOCK_SIZE
    assert [len(order.gpu_blocks) for order in loads_of(d, "reader")] == [2]
    assert [len(order.gpu_blocks) for order in loads_of(d, "reader@g1")] == [2]
    assert d.cpu_pool_drained()


def test_a_request_whose_window_blocks_another_request_still_loads_waits_for_that_load(hybrid) -> None:
    """The first reader's full-attention load has landed, its window's has not: the second reader, asked while that
    window is loading, is deferred (`None`) rather than offered blocks being written, and once the first reader's
    load is told it finds them in vLLM's own prefix cache, loading nothing."""
    d = hybrid(FakeWorker(load_steps_of={"first@g1": 4}))
    store_prefix(d)
    d.add("first", PREFIX + [9])
    d.step()
    d.add("second", PREFIX + [9])
    deferrals = d.connector.scheduler_side.kvfsm.stats.deferrals
    d.run()
    assert d.connector.scheduler_side.kvfsm.stats.deferrals > deferrals
    assert loaded_blocks(d, "first") == len(PREFIX) // BLOCK_SIZE + 2
    assert loaded_blocks(d, "second") == 0
    assert d.cpu_pool_drained()


REPLAY = 3 * WINDOW
"""Tokens of the bounded-replay window: longer than PREFIX, so vLLM sets a hit of PREFIX aside unless its load restores
the window."""


def replay_cache(num_blocks: int, second: object | None = None) -> KVCacheConfig:
    """A full-attention group, a sliding window of WINDOW tokens (or `second`), and a DeepSeek-V4.1 style sliding
    window vLLM replays instead of caching (`bounded_replay`), its latent as many bytes a block as the others' K and
    V."""
    replayed = SlidingWindowMLASpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=2 * NUM_KV_HEADS * HEAD_SIZE,
                                    dtype=torch.float16, sliding_window=REPLAY, bounded_replay=True)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layers.0.attn"], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec(["layers.1.attn"], second or SlidingWindowSpec(**SHAPE, sliding_window=WINDOW)),
        KVCacheGroupSpec(["layers.2.attn"], replayed)])


def test_a_request_its_gpu_prefix_serves_whole_counts_no_hit_block_of_its_replay_window(model) -> None:
    """A second reader of LONG finds its whole hit in vLLM's GPU prefix cache, the first reader's, in every group vLLM
    caches: nothing is offered past the GPU prefix's end, so no replay block below it is looked up either, though the
    CPU pool holds the replay window there (blocks 1 to 6): `kvfsm_hit_blocks_total{tier="cpu"}` counts none."""
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48))
    try:
        store_prefix(d, LONG + [1, 2, 3])
        d.add("first", LONG + [9])
        d.run()
        stats = d.connector.scheduler_side.kvfsm.stats
        before = stats.cpu_hit_blocks
        d.add("again", LONG + [9])
        d.run()
        assert stats.cpu_hit_blocks == before
        assert [order for g in d.connector.scheduler_side.groups for order in loads_of(d, g.request_id("again"))] == []
        assert d.cpu_pool_drained()
    finally:
        d.close()


CHUNK = 4 * BLOCK_SIZE
"""Tokens of a chunk of the chunked local attention group beside the replay window: READER's hit ends inside the
second chunk, which starts at block 4."""


def test_a_hit_vllm_replays_instead_of_loading_loads_nothing_in_any_group(model, monkeypatch) -> None:
    """vLLM's `Scheduler.schedule` sets aside a connector's hit no longer than its bounded-replay window when the load
    would not restore that window's group, and allocates the request no external tokens: it recomputes the prompt.
    The writer of LONG stored the replay group's blocks 1 to 6 (its window at its own end) and the chunked group's 4
    to 6 (its chunk); vLLM's GPU prefix cache holds LONG's first block (in every group but the replay window, which
    it never caches). So the replay window at READER's hit's end, from block 0, is not the load's to restore
    (`loaded-groups`): the CPU pool lacks its block 0, and the load would start at block 1. kvfsm had offered blocks 1
    to 5, the chunked group its blocks 4 and 5: every group is told it loads nothing, not a count taken from where
    its window starts (negative, and refused), and the reader computes its whole prompt."""
    chunked = ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=CHUNK)  # type: ignore[arg-type]
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48, chunked))
    try:
        store_prefix(d, LONG + [1, 2, 3])
        d.add("warm", LONG[:BLOCK_SIZE] + list(range(900, 900 + 7 * BLOCK_SIZE)))
        d.run()
        offered: list[int | None] = []
        lookup = d.connector.get_num_new_matched_tokens

        def recorded(request, computed: int) -> tuple[int | None, bool]:  # type: ignore[no-untyped-def]
            found = lookup(request, computed)
            offered.append(found[0])
            return found

        monkeypatch.setattr(d.connector, "get_num_new_matched_tokens", recorded)
        d.add("reader", READER)
        d.run()
        assert offered == [5 * BLOCK_SIZE]
        assert first_computed(d, "reader") == 0
        assert [order for g in d.connector.scheduler_side.groups
                for order in loads_of(d, g.request_id("reader"))] == []
        assert d.cpu_pool_drained()
    finally:
        d.close()
