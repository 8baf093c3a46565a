"""KV-cache groups under vLLM 0.32's hybrid allocator, with vLLM's real Scheduler: kvfsm declares `SupportsHMA`, so
vLLM keeps a full-attention group and a sliding-window group apart, and kvfsm offloads each on its own terms.

A sliding-window group stores and reloads only the window at the end of a prefix; vLLM's null block is never read or
written; a block vLLM takes back out of a running request's window while its store still reads it is fenced
(`window-fence`) before vLLM hands it out again. Every scenario runs traced against the spec, with the named
invariants after each step, the harness's checks on vLLM's own tables (per group) and the drain at the end; each
rule has a control that breaks it and is caught (state-space groups: `test_vllm_mamba.py`). Skipped without vLLM.
"""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.integrations.vllm import KvfsmConnector, UnsupportedKVCache, groups  # noqa: E402
from kvfsm.integrations.vllm.convert import computed_before  # noqa: E402
from kvfsm.connector.refusals import StaleMatch  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, FakeWorker, vllm_config  # noqa: E402
from kvfsm.connector import scheduler as scheduler_module  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.testing.spec_mutants import load_mutant, spec_mutants  # noqa: E402
from test_vllm_lazy_fence import handed_out  # noqa: E402
from vllm_harness import AdapterWorker, Driver, HeldBlockReleased  # noqa: E402
from vllm_support import PREFIX, hide_preemptions, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

WINDOW = 32
"""Tokens of the sliding window: a prefix's hit needs its last two blocks of the sliding group."""
SHAPE = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
FULL, SLIDING = "layers.0.attn", "layers.1.attn"


def hybrid_cache(num_blocks: int, second: object | None = None) -> KVCacheConfig:
    """Two groups as vLLM's hybrid allocator makes them: one full-attention layer, one sliding-window layer."""
    groups = [KVCacheGroupSpec([FULL], FullAttentionSpec(**SHAPE)),
              KVCacheGroupSpec([SLIDING], second or SlidingWindowSpec(**SHAPE, sliding_window=WINDOW))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.fixture
def hybrid(model) -> Iterator:
    """Builds drivers on the hybrid configuration, the hybrid allocator on, and stops their tracing afterwards."""
    opened: list[Driver] = []

    def build(worker: FakeWorker | None = None, gpu_blocks: int = 48, cpu_blocks: int = 32,
              kv_events: bool = False) -> Driver:
        """`kv_events`: vLLM publishes KV-cache events (to its null publisher), so kvfsm records them."""
        config = vllm_config(model, {"cpu_blocks": cpu_blocks}, gpu_blocks)
        if kv_events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager
        d = Driver(config, worker or FakeWorker(), hybrid_cache(gpu_blocks))
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


def stores_of(d: Driver, tracked_id: str) -> list[tuple[int, ...]]:
    return [order.gpu_blocks for log in d.log for order in log.orders.stores if order.req_id == tracked_id]


def no_null_block(d: Driver) -> None:
    moved = [b for log in d.log for order in (*log.orders.stores, *log.orders.loads) for b in order.gpu_blocks]
    assert 0 not in moved, "a job read or wrote vLLM's null block"


def test_kvfsm_declares_hma_so_vllm_keeps_the_hybrid_allocator_on(model) -> None:
    assert not vllm_config(model, {"cpu_blocks": 32}, 48).scheduler_config.disable_hybrid_kv_cache_manager


def test_a_prefix_reloads_every_full_block_and_only_the_windows_blocks(hybrid) -> None:
    d = hybrid()
    store_prefix(d)
    d.add("reader", PREFIX + [9])
    d.run()
    blocks = len(PREFIX) // BLOCK_SIZE
    assert [len(s) for s in stores_of(d, "writer@g1")] == [2], "the sliding group stored beyond its window"
    assert sum(map(len, stores_of(d, "writer"))) == blocks
    (full,) = loads_of(d, "reader")
    (window,) = loads_of(d, "reader@g1")
    assert (len(full.gpu_blocks), len(window.gpu_blocks)) == (blocks, 2)
    assert d.connector.scheduler_side.kvfsm.stats.blocks_stored == blocks + 2
    no_null_block(d)
    assert d.cpu_pool_drained()


def test_vllm_hears_a_load_landed_only_once_every_groups_load_landed(hybrid) -> None:
    """The groups of a request load as jobs of their own; vLLM schedules the request once its load is reported, so
    the report waits for the last group's: the first group's alone would have it compute on a window still landing."""
    worker = FakeWorker(load_steps_of={"reader@g1": 4})
    d = hybrid(worker)
    store_prefix(d)
    d.add("reader", PREFIX + [9])
    d.run()
    (window,) = [job for job in worker.loads if job.req_id == "reader@g1"]
    (full,) = [job for job in worker.loads if job.req_id == "reader"]
    assert full.due < window.due < d.first_token["reader"]
    assert d.cpu_pool_drained()


def test_a_prefix_whose_window_was_not_stored_loads_nothing(hybrid) -> None:
    """Only the window at the end of the writer's prompt was stored: a shorter prompt's hit would need the window
    ending a block earlier, which CPU lacks, so the full group's hit is not offered alone (vLLM would compute on a
    window nobody loaded)."""
    d = hybrid()
    store_prefix(d)
    d.add("reader", PREFIX[:3 * BLOCK_SIZE] + [9])
    d.run()
    assert not loads_of(d, "reader") and not loads_of(d, "reader@g1")
    assert d.cpu_pool_drained()


WRITER = PREFIX + [1, 2, 3]


def slide_then_reuse(d: Driver) -> None:
    """The writer decodes until its window leaves its stored blocks behind, its store still copying them; then a
    request arrives in a pool where the blocks vLLM took back are what is free."""
    d.add("writer", WRITER, max_tokens=30)
    for _ in range(16):
        d.step()
    d.add("taker", list(range(3000, 3000 + 2 * BLOCK_SIZE + 1)), max_tokens=2)
    d.run(max_steps=80)


def left_behind_then_fenced(d: Driver) -> None:
    """`slide_then_reuse`, vLLM handing out a block of the writer's second group's first store while it still runs;
    the fence held it (the harness's checks), nothing read vLLM's null block and everything drained."""
    handed = handed_out(d)
    slide_then_reuse(d)
    assert set(handed) & set(stores_of(d, "writer@g1")[0]), "vLLM handed out none of the group's stored blocks"
    no_null_block(d)
    assert d.cpu_pool_drained()


def unslid_written_under_store(d: Driver) -> None:
    """Control: the adapter never tells kvfsm what vLLM took back, and the harness sees a block taken back unfenced."""
    d.connector.scheduler_side.kvfsm.slide = lambda request_id, block_ids: None  # type: ignore[method-assign]
    with pytest.raises(HeldBlockReleased, match="writer@g1"):  # taken back unfenced, then written
        slide_then_reuse(d)


def test_a_block_the_window_left_behind_is_fenced_before_vllm_hands_it_out(hybrid) -> None:
    left_behind_then_fenced(hybrid(FakeWorker(store_steps=40), gpu_blocks=14))


def test_control_without_the_slide_a_left_behind_block_is_written_under_its_store(hybrid) -> None:
    unslid_written_under_store(hybrid(FakeWorker(store_steps=40), gpu_blocks=14))


SLIDE_MUTANTS = {m.name: m for m in spec_mutants() if "(slide running -> running)" in m.name}


def test_the_slide_has_its_spec_mutants() -> None:
    assert len(SLIDE_MUTANTS) == 3


CAUGHT_BY = {
    "drop coupling gpu-block.free(slid-store-blocks)": (SpecViolation, "window-fence violated"),
    "drop effect record-slid-blocks": (HeldBlockReleased, "store job 1 of writer@g1 .* which vLLM took back"),
    "retarget to preempted": (SpecViolation, "preempt-flushes violated"),
}
"""What catches each slide mutant: the invariant itself when the blocks stay fenced; the harness when nothing records
them as left behind; a preempted state the engine never preempted."""


@pytest.mark.parametrize("edit", sorted(CAUGHT_BY))
def test_a_slide_mutant_of_the_spec_is_caught(edit: str, hybrid, monkeypatch, tmp_path) -> None:
    spec = load_mutant(SLIDE_MUTANTS[f"request #28 (slide running -> running): {edit}"], tmp_path)
    monkeypatch.setattr(scheduler_module, "default_spec", lambda: spec)
    d = hybrid(FakeWorker(store_steps=40), gpu_blocks=14)
    error, message = CAUGHT_BY[edit]
    with pytest.raises(error, match=message):
        slide_then_reuse(d)


def preemption_storm(d: Driver, requests: int = 5) -> None:
    """Long decodes in a pool that runs out: vLLM preempts requests whose stores are in flight, in both groups."""
    for i in range(requests):
        d.add(f"p{i}", [6000 + 100 * i + t for t in range(2 * BLOCK_SIZE + 1)], max_tokens=3 * BLOCK_SIZE + i * 4)
    d.run(max_steps=400)


def test_preemption_with_stores_in_flight_flushes_every_groups_stores(hybrid) -> None:
    d = hybrid(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=20)
    preemption_storm(d)
    assert any(log.orders.flush for log in d.log), "no store was flushed by a preemption"
    no_null_block(d)
    assert d.cpu_pool_drained()


def test_control_preemption_not_passed_on_releases_blocks_a_store_reads(hybrid, monkeypatch) -> None:
    hide_preemptions(monkeypatch)
    d = hybrid(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=20)
    with pytest.raises(HeldBlockReleased):
        preemption_storm(d)


def abort_while_loading(d: Driver) -> None:
    store_prefix(d)
    d.add("reader", PREFIX + [1])
    d.step()
    assert loads_of(d, "reader") and loads_of(d, "reader@g1")
    d.scheduler.finish_requests("reader", RequestStatus.FINISHED_ABORTED)
    d.add("taker", list(range(3000, 3000 + 4 * BLOCK_SIZE + 1)), max_tokens=2)
    d.run()


def test_an_aborted_loading_request_keeps_every_groups_blocks_until_its_loads_end(hybrid) -> None:
    d = hybrid(FakeWorker(load_steps=4), gpu_blocks=16)
    abort_while_loading(d)
    assert d.cpu_pool_drained()


def test_an_aborted_loading_request_is_forgotten_once_its_last_groups_load_is_told(hybrid) -> None:
    """Its tracked ids outlive the finish only until vLLM heard of every group's load: none is kept after."""
    d = hybrid(FakeWorker(load_steps=4), gpu_blocks=16)
    abort_while_loading(d)
    side = d.connector.scheduler_side
    assert not side._waiting and not len(side.tracked), "an ended request's groups were left waiting or tracked"


def abort_not_passed_on_is_caught(d: Driver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Control: the adapter never hears of the reader's abort, so its groups never drain; the drain check says so."""
    side = d.connector.scheduler_side
    original = side.request_finished
    monkeypatch.setattr(side, "request_finished",
                        lambda request: (False, None) if request.request_id == "reader" else original(request))
    with pytest.raises(SpecViolation, match="drained: request reader"):
        abort_while_loading(d)


def test_control_an_abort_not_passed_on_leaves_the_groups_undrained(hybrid, monkeypatch) -> None:
    abort_not_passed_on_is_caught(hybrid(FakeWorker(load_steps=4), gpu_blocks=16), monkeypatch)


class HybridWorker(AdapterWorker):
    """The adapter's worker role on one tensor shared by the full-attention and the sliding-window layer, as vLLM's
    hybrid allocator shares it. Its forward writes each position's token id (mod 251), plus 256 in the sliding group,
    into that group's block: a reloaded block's bytes say which prefix and which group they came from."""

    layers: tuple[str, ...] = (FULL, SLIDING)
    """One layer per group, in vLLM's group order."""

    def __init__(self, config, second: object | None = None) -> None:  # type: ignore[no-untyped-def]
        """`second`: the second group's spec (`hybrid_cache`'s), a sliding window unless told."""
        self.open(config, hybrid_cache(config.cache_config.num_gpu_blocks, second))

    def open(self, config, groups: KVCacheConfig) -> None:  # type: ignore[no-untyped-def]
        """The worker role over `groups`, every layer of `layers` paging from one shared tensor."""
        blocks = config.cache_config.num_gpu_blocks
        self.connector = KvfsmConnector(config, KVConnectorRole.WORKER, groups)
        shared = torch.zeros(2, blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
        self.caches = dict.fromkeys(self.layers, shared)
        self.connector.register_kv_caches(self.caches)

    def forward(self, output, scheduler) -> None:  # type: ignore[no-untyped-def]
        """Each layer's hooks run around its write, as vLLM calls them for every attention layer of every group (a
        later group's layer name is an alias of the tensor the first layer registered)."""
        before = computed_before(output)
        cache = self.caches[self.layers[0]]
        for group, name in enumerate(self.layers):
            self.connector.wait_for_layer_load(name)
            for req_id, count in output.num_scheduled_tokens.items():
                blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[group]
                tokens = scheduler.requests[req_id].all_token_ids
                for position in range(before[req_id], before[req_id] + count):
                    if blocks[position // BLOCK_SIZE]:  # vLLM's null block is never written
                        cache[:, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = float(
                            tokens[position] % 251 + 256 * group)
            self.connector.save_kv_layer(name, cache, None)  # type: ignore[arg-type]


def reloaded_bytes(d: Driver, worker: HybridWorker, writer: str = "writer",
                   reader: str = "reader") -> tuple[list[list[int]], list[list[int]]]:
    """The writer's prefix stored, the GPU forgotten and zeroed, a reader reloads it: each loaded block's tokens, per
    group."""
    store_prefix(d, req_id=writer)
    worker.caches[FULL].zero_()  # whatever the reader finds now came from the CPU pool
    d.add(reader, PREFIX + [9])
    d.run()
    full, window = ([b for order in loads_of(d, tracked) for b in order.gpu_blocks]
                    for tracked in (reader, f"{reader}@g1"))
    return [worker.block_tokens(b) for b in full], [worker.block_tokens(b) for b in window]


def prefix_block(i: int, group: int) -> list[int]:
    return [t % 251 + 256 * group for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


@pytest.mark.parametrize("per_layer", ["layer_loads", "layer_stores"])
def test_per_layer_transfers_over_several_groups_are_refused_saying_why(model, per_layer: str) -> None:
    """A tensor the groups share is written by one layer of each group in turn: no layer's transfer is its own."""
    config = vllm_config(model, {"cpu_blocks": 32, per_layer: True}, 48)
    with pytest.raises(UnsupportedKVCache) as refused:
        KvfsmConnector(config, KVConnectorRole.WORKER, hybrid_cache(48))
    assert str(refused.value) == ("layer_loads and layer_stores need one KV-cache group: under vLLM's hybrid "
                                  "allocator each tensor is written by a layer of every group in turn")


def test_each_group_reloads_its_own_bytes_through_one_shared_tensor(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = HybridWorker(config)
    d = Driver(config, worker, hybrid_cache(48))
    try:
        full, window = reloaded_bytes(d, worker)
        assert full == [prefix_block(i, 0) for i in range(4)]
        assert window == [prefix_block(i, 1) for i in (2, 3)]
        assert d.cpu_pool_drained()
    finally:
        d.close()


@pytest.mark.parametrize("writer, reader", [("doc@g1", "chat@gpt-1"), ("writer", "reader@g1@g1")])
def test_a_request_id_holding_the_group_separator_reloads_its_own_prefix(model, writer: str, reader: str) -> None:
    """Request ids are the user's: one holding `@g` (the separator of a group's tracked id) is still told its own
    load's end (its tracked ids are recorded, never parsed back), and the writer's blocks are freed under its own."""
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = HybridWorker(config)
    d = Driver(config, worker, hybrid_cache(48))
    try:
        full, window = reloaded_bytes(d, worker, writer, reader)
        assert full == [prefix_block(i, 0) for i in range(4)]
        assert window == [prefix_block(i, 1) for i in (2, 3)]
        assert d.first_token[reader] and d.cpu_pool_drained()
        side = d.connector.scheduler_side
        assert not side._waiting and not len(side.tracked), "a request's groups were left waiting or tracked"
    finally:
        d.close()


def test_control_groups_sharing_keys_collide_in_the_cpu_pool(model, monkeypatch) -> None:
    """With the full group's keys for the window too, the window's stored blocks are the full group's slots, and the
    reader's window load claims slots its own full-group load already reads: the allocation is refused before any
    state changes (`StaleMatch`: its blocks are no longer loadable)."""
    monkeypatch.setattr(groups, "group_key", lambda block_hash, group, width: block_hash)
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = HybridWorker(config)
    d = Driver(config, worker, hybrid_cache(48))
    try:
        with pytest.raises(StaleMatch):
            reloaded_bytes(d, worker)
    finally:
        d.close()


def stored_events(d: Driver, monkeypatch) -> list[bytes]:  # type: ignore[no-untyped-def]
    """A prefix stored with vLLM's KV-cache events on; the block hashes of every CPU `BlockStored` kvfsm published."""
    side, published = d.connector.scheduler_side, []
    take = side.take_events
    monkeypatch.setattr(side, "take_events", lambda: [e for e in take() if published.append(e) or True])
    store_prefix(d)
    for _ in range(2):
        d.step()  # vLLM drains the connector's events as it schedules
    return [h for e in published if isinstance(e, BlockStored) for h in e.block_hashes]


def test_kv_cache_events_name_only_vllms_own_block_hashes(hybrid, monkeypatch) -> None:
    """A sliding group's keys are kvfsm's, not vLLM's hashes: a KV-aware router is told of the full group's alone."""
    hashes = stored_events(hybrid(kv_events=True), monkeypatch)
    assert hashes and {len(h) for h in hashes} == {32}
    assert len(hashes) == len(set(hashes)) == len(PREFIX) // BLOCK_SIZE


def test_a_cache_reset_announces_only_vllms_own_block_hashes_removed(hybrid) -> None:
    """The reset drops both groups' blocks at once, in one event: the sliding group's keys are still left out of it."""
    d = hybrid(kv_events=True)
    store_prefix(d)
    side = d.connector.scheduler_side
    side.take_events()  # the stores' events
    side.reset_cache()
    removed = [h for e in side.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert {len(h) for h in removed} == {32} and len(removed) == len(set(removed)) == len(PREFIX) // BLOCK_SIZE


def test_control_unfiltered_events_cannot_be_told_as_vllm_hashes(hybrid, monkeypatch) -> None:
    import kvfsm.integrations.vllm.scheduler_side as side_module

    monkeypatch.setattr(side_module, "is_first_group_key", lambda key, width: True)
    with pytest.raises(OverflowError):
        stored_events(hybrid(kv_events=True), monkeypatch)


def test_under_async_scheduling_a_window_slides_only_behind_processed_tokens(model) -> None:
    """vLLM's async scheduling keeps a step in flight: vLLM frees a window's blocks only behind the tokens whose step's
    output it processed, and kvfsm's tables follow it (the harness compares both every step)."""
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48, async_scheduling=True),
               FakeWorker(store_steps=2, load_steps=2), hybrid_cache(48))
    try:
        store_prefix(d)
        d.add("reader", PREFIX + [9], max_tokens=BLOCK_SIZE)
        d.run(max_steps=80)
        assert loads_of(d, "reader@g1") and d.cpu_pool_drained()
    finally:
        d.close()


# --- what kvfsm offloads, and what it refuses by name ------------------------------------------------------------

ONE_OF_EACH = "(0: FullAttentionSpec, 1: {})"
PAGE = FullAttentionSpec(**SHAPE).page_size_bytes


def two_groups(second: object, first: object | None = None, first_layers: int = 1) -> KVCacheConfig:
    layers = [f"layers.{i}.attn" for i in range(first_layers)]
    return KVCacheConfig(num_blocks=48, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layers, first or FullAttentionSpec(**SHAPE)), KVCacheGroupSpec(["second.attn"], second)])


def test_a_sliding_group_keeps_its_window_and_the_tokens_vllm_retains_beyond_it() -> None:
    second = SlidingWindowSpec(**SHAPE, sliding_window=WINDOW, extra_retained_tokens=8)
    assert groups.offloaded_groups(two_groups(second), BLOCK_SIZE)[1].window == WINDOW + 8


def test_groups_of_equal_bytes_per_block_over_different_layer_counts_share_one_pool() -> None:
    """Two full-attention layers of one page, against one sliding layer of a page twice that: 2 pages a block each."""
    wide = SlidingWindowSpec(**{**SHAPE, "num_kv_heads": 2 * NUM_KV_HEADS}, sliding_window=WINDOW)
    assert len(groups.offloaded_groups(two_groups(wide, first_layers=2), BLOCK_SIZE)) == 2


@pytest.mark.parametrize(("config", "refusal"), [
    (two_groups(SlidingWindowSpec(**SHAPE, sliding_window=WINDOW), SlidingWindowSpec(**SHAPE, sliding_window=WINDOW)),
     "kvfsm needs a full-attention KV-cache group to look a prefix up by; this configuration has none "
     "(0: SlidingWindowSpec, 1: SlidingWindowSpec)"),
    (two_groups(FullAttentionSpec(**{**SHAPE, "block_size": 2 * BLOCK_SIZE})),
     f"KV-cache group 1 (FullAttentionSpec) pages {2 * BLOCK_SIZE} tokens a block, the engine hashes {BLOCK_SIZE}: "
     f"kvfsm needs one block size {ONE_OF_EACH.format('FullAttentionSpec')}"),
    (two_groups(CrossAttentionSpec(**SHAPE)),
     "kvfsm offloads full-attention (and MLA), sliding-window, chunked local attention and state-space (Mamba, align "
     f"mode) KV-cache groups; group 1 is a CrossAttentionSpec {ONE_OF_EACH.format('CrossAttentionSpec')}. Serve this "
     "model without kvfsm, or with vLLM's own OffloadingConnector"),
    (two_groups(ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=40)),
     "KV-cache group 1 is a ChunkedLocalAttentionSpec of 40-token chunks in 16-token blocks "
     f"{ONE_OF_EACH.format('ChunkedLocalAttentionSpec')}: kvfsm offloads chunks of whole blocks only; use a block "
     "size that divides the chunk"),
    (two_groups(SlidingWindowSpec(**{**SHAPE, "num_kv_heads": 2 * NUM_KV_HEADS}, sliding_window=WINDOW)),
     f"KV-cache groups of different bytes per block ([{PAGE}, {2 * PAGE}]; 0: FullAttentionSpec, 1: "
     "SlidingWindowSpec): kvfsm's CPU pool has one block size"),
])
def test_a_configuration_kvfsm_cannot_serve_is_refused_in_full(config: KVCacheConfig, refusal: str) -> None:
    with pytest.raises(UnsupportedKVCache) as refused:
        groups.offloaded_groups(config, BLOCK_SIZE)
    assert str(refused.value) == refusal

