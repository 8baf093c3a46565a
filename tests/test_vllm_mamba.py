"""A state-space (Mamba) KV-cache group under vLLM 0.32's hybrid allocator, with vLLM's real Scheduler: a full-attention
group beside a Mamba group in vLLM's "align" cache mode, where each Mamba block holds the state after its last token.

kvfsm stores states from a prompt's last whole block on (none of its earlier chunks'), and restores one only with the
attention prefix it belongs to, at that prefix's end (`state-at-prefix-end`); the blocks vLLM takes back behind the
state a request runs on are fenced as a sliding window's are (`window-fence`). Every scenario runs traced against the
spec, with the named invariants after each step, the harness's checks on vLLM's own tables (per group) and the drain at
the end; each rule has a control that breaks it and is caught. Any other cache mode, or a state kvfsm would store beside
states vLLM never kept, is refused by name. Skipped without vLLM.
"""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402

from kvfsm.integrations.vllm import KvfsmConnector, UnsupportedKVCache, convert, groups  # noqa: E402
from kvfsm.integrations.vllm.checks import SpecViolation  # noqa: E402
from kvfsm.integrations.vllm.convert import computed_before  # noqa: E402
from kvfsm.integrations.vllm.rig import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    SAMPLED_TOKEN,
    FakeWorker,
    vllm_config,
)
from kvfsm.integrations.vllm.window_hit import WindowHits  # noqa: E402
from kvfsm.testing.mutants import restore_without_state  # noqa: E402
from test_vllm_groups import (  # noqa: E402
    abort_not_passed_on_is_caught,
    abort_while_loading,
    left_behind_then_fenced,
    no_null_block,
    preemption_storm,
    stores_of,
    unslid_written_under_store,
)
from vllm_harness import AdapterWorker, Driver, HeldBlockReleased  # noqa: E402
from vllm_support import PREFIX, hide_preemptions, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

SHAPE = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
PAGE = FullAttentionSpec(**SHAPE).page_size_bytes
FULL, STATE = "layers.0.attn", "layers.1.mixer"


def state_spec(**changes: object) -> MambaSpec:
    """A Mamba layer's state (a small conv and SSM state) padded to the attention page, as vLLM aligns them."""
    fields: dict[str, object] = dict(block_size=BLOCK_SIZE, shapes=((3, 8), (2, 4, 4)),
                                     dtypes=(torch.float16, torch.float16), page_size_padded=PAGE,
                                     mamba_cache_mode="align")
    return MambaSpec(**{**fields, **changes})  # type: ignore[arg-type]


def mamba_cache(num_blocks: int, state: MambaSpec | None = None) -> KVCacheConfig:
    """Two groups as vLLM's hybrid allocator makes them: one full-attention layer, one Mamba layer."""
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([FULL], FullAttentionSpec(**SHAPE)), KVCacheGroupSpec([STATE], state or state_spec())])


def align_config(model, gpu_blocks: int, async_scheduling: bool = False):  # type: ignore[no-untyped-def]
    """vLLM's configuration in "align" mode: its scheduler ends every prefill chunk at a block's end."""
    config = vllm_config(model, {"cpu_blocks": 32}, gpu_blocks, async_scheduling=async_scheduling)
    config.cache_config.mamba_cache_mode = "align"
    return config


@pytest.fixture
def mamba(model) -> Iterator:
    """Builds drivers on the full + Mamba configuration and stops their tracing afterwards."""
    opened: list[Driver] = []

    def build(worker: FakeWorker | None = None, gpu_blocks: int = 48, async_scheduling: bool = False) -> Driver:
        d = Driver(align_config(model, gpu_blocks, async_scheduling), worker or FakeWorker(), mamba_cache(gpu_blocks))
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


def test_a_prefix_reloads_every_full_block_and_only_the_state_at_its_end(mamba) -> None:
    d = mamba()
    store_prefix(d)
    d.add("reader", PREFIX + [9])
    d.step()
    state_table = d.scheduler.kv_cache_manager.get_block_ids("reader")[1]
    d.run()
    blocks = len(PREFIX) // BLOCK_SIZE
    assert [len(s) for s in stores_of(d, "writer@g1")] == [1], "the state group stored more than its last state"
    (full,) = loads_of(d, "reader")
    (state,) = loads_of(d, "reader@g1")
    assert (len(full.gpu_blocks), state.gpu_blocks) == (blocks, (state_table[blocks - 1],))
    no_null_block(d)
    assert d.cpu_pool_drained()


def test_a_prefix_cached_in_part_on_the_gpu_loads_the_rest_and_the_state_at_its_end(mamba) -> None:
    """A 48-token request leaves vLLM's GPU prefix cache the first three blocks and the state after them; a reader of
    the whole stored prefix loads only the fourth block and the state after it, into the block vLLM gave it there."""
    d = mamba()
    store_prefix(d)
    d.add("mid", PREFIX[:3 * BLOCK_SIZE] + [5])
    d.run()
    d.add("reader", PREFIX + [9])
    d.step()
    state_table = d.scheduler.kv_cache_manager.get_block_ids("reader")[1]
    d.run()
    (full,) = loads_of(d, "reader")
    (state,) = loads_of(d, "reader@g1")
    assert (len(full.gpu_blocks), state.gpu_blocks) == (1, (state_table[3],))
    no_null_block(d)
    assert d.cpu_pool_drained()


def decode_past_the_loaded_state(d: Driver) -> None:
    """A reader loads the stored prefix and its state, then decodes past the block holding that state."""
    store_prefix(d)
    d.add("reader", PREFIX + [9], max_tokens=BLOCK_SIZE)
    d.run(max_steps=80)


def test_a_state_that_was_not_stored_is_no_hit(mamba) -> None:
    """Only the state at the writer's prompt end (64 tokens) was stored: a 48-token prefix's blocks are in CPU, its
    state is not, so nothing is offered and vLLM computes the prefix itself."""
    d = mamba()
    store_prefix(d)
    d.add("reader", PREFIX[:3 * BLOCK_SIZE] + [9])
    d.run()
    assert not loads_of(d, "reader") and not loads_of(d, "reader@g1")
    assert d.cpu_pool_drained()


def test_control_a_prefix_restored_without_its_state_breaks_state_at_prefix_end(mamba, monkeypatch) -> None:
    """The adapter holds the rule twice: its search for the longest hit every group holds (`longest-window-hit`)
    and kvfsm's `match_together`. The control drops both: the search takes the full group's end as it is, and the
    groups are matched apart."""
    monkeypatch.setattr(WindowHits, "longest_end", lambda self, views, first, end: end)
    d = mamba()
    restore_without_state(d.connector.scheduler_side.kvfsm)
    store_prefix(d)
    d.add("reader", PREFIX[:3 * BLOCK_SIZE] + [9])
    with pytest.raises(SpecViolation, match="state-at-prefix-end violated"):
        d.run()


def test_a_state_block_left_behind_is_fenced_before_vllm_hands_it_out(mamba) -> None:
    left_behind_then_fenced(mamba(FakeWorker(store_steps=40), gpu_blocks=14))


def test_control_without_the_slide_a_state_block_is_written_under_its_store(mamba) -> None:
    unslid_written_under_store(mamba(FakeWorker(store_steps=40), gpu_blocks=14))


def test_under_async_scheduling_the_state_slides_only_behind_processed_tokens(mamba) -> None:
    """vLLM's async scheduling keeps a step in flight: vLLM frees a state block only once the output of the step
    that moved past it was processed, and kvfsm's table follows it (the harness compares both every step)."""
    d = mamba(FakeWorker(store_steps=2, load_steps=2), async_scheduling=True)
    decode_past_the_loaded_state(d)
    assert loads_of(d, "reader@g1")
    assert d.cpu_pool_drained()


def test_control_in_flight_tokens_ignored_slide_the_state_before_vllm_frees_it(mamba, monkeypatch) -> None:
    """The writer's state at 64 tokens, slid as soon as vLLM scheduled past it: vLLM still holds it (its step is in
    flight), and the harness's comparison of both tables catches it."""
    monkeypatch.setattr(convert.RequestView, "in_flight_tokens", property(lambda view: 0))
    d = mamba(FakeWorker(store_steps=2, load_steps=2), async_scheduling=True)
    stale = r"adapter has writer's blocks as \[0, 0, 0, 0, 7\], vLLM holds \[0, 0, 0, 5, 7\]"
    with pytest.raises(AssertionError, match=stale):
        decode_past_the_loaded_state(d)


def test_preemption_with_stores_in_flight_flushes_the_states_stores_too(mamba) -> None:
    d = mamba(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=16)
    preemption_storm(d)
    flushed = {job_id for log in d.log for job_id in log.orders.flush}
    states = {order.job_id for log in d.log for order in log.orders.stores if order.req_id.endswith("@g1")}
    assert flushed & states, "no state's store was flushed by a preemption"
    no_null_block(d)
    assert d.cpu_pool_drained()


def test_control_preemption_not_passed_on_releases_blocks_a_store_reads(mamba, monkeypatch) -> None:
    hide_preemptions(monkeypatch)
    d = mamba(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=16)
    with pytest.raises(HeldBlockReleased):
        preemption_storm(d)


def test_an_aborted_loading_request_keeps_its_state_block_until_its_loads_end(mamba) -> None:
    d = mamba(FakeWorker(load_steps=4), gpu_blocks=14)
    abort_while_loading(d)
    assert d.cpu_pool_drained()


def test_control_an_abort_not_passed_on_leaves_the_state_undrained(mamba, monkeypatch) -> None:
    abort_not_passed_on_is_caught(mamba(FakeWorker(load_steps=4), gpu_blocks=14), monkeypatch)


def state_after(tokens: list[int]) -> float:
    """The state a toy recurrence reaches over `tokens`: exact in float16 (below 2048), different for every prefix
    length the tests compare."""
    value = 0
    for token in tokens:
        value = (value * 3 + token) % 2039
    return float(value)


class StateWorker(AdapterWorker):
    """The adapter's worker role on one tensor shared by the full-attention and the Mamba layer, as vLLM's hybrid
    allocator shares it. Its forward writes each position's token id (mod 251) into the full group's block, and, as
    vLLM's Mamba kernels in align mode do, the state after the chunk's last token into the Mamba block holding it."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        blocks = config.cache_config.num_gpu_blocks
        self.connector = KvfsmConnector(config, KVConnectorRole.WORKER, mamba_cache(blocks))
        shared = torch.zeros(2, blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
        self.caches = {FULL: shared, STATE: shared}
        self.connector.register_kv_caches(self.caches)

    def forward(self, output, scheduler) -> None:  # type: ignore[no-untyped-def]
        before, cache = computed_before(output), self.caches[FULL]
        for req_id, count in output.num_scheduled_tokens.items():
            full, state = scheduler.kv_cache_manager.get_block_ids(req_id)
            tokens = scheduler.requests[req_id].all_token_ids
            for position in range(before[req_id], before[req_id] + count):
                cache[:, full[position // BLOCK_SIZE], position % BLOCK_SIZE] = float(tokens[position] % 251)
            end = before[req_id] + count
            cache[:, state[(end - 1) // BLOCK_SIZE]] = state_after(tokens[:end])

    def state_of(self, block_id: int) -> set[float]:
        """Every value the block's page holds (one, where a state was written whole)."""
        return set(self.caches[STATE][:, block_id].flatten().tolist())


def restored(model, prefix: list[int], decoded: int = 0,  # type: ignore[no-untyped-def]
             aligned: bool = True) -> tuple[list[list[int]], set[float]]:
    """A writer's prompt (`PREFIX + [1, 2, 3]`) computed and stored with `decoded` tokens sampled after it, the GPU
    zeroed, then a reader of `prefix` and one more token reloads it: the full blocks' tokens, the state's values.
    `aligned=False`: vLLM's scheduler does not end prefill chunks at a block's end (its "align" split off)."""
    config = align_config(model, 48)
    if not aligned:
        config.cache_config.mamba_cache_mode = "none"
    worker = StateWorker(config)
    d = Driver(config, worker, mamba_cache(48))
    try:
        d.add("writer", PREFIX + [1, 2, 3], max_tokens=decoded or 2)
        d.run(max_steps=80)
        d.reset_gpu_prefix_cache()
        worker.caches[FULL].zero_()  # whatever the reader finds now came from the CPU pool
        d.add("reader", prefix + [9])
        d.run(max_steps=120)
        (full,) = loads_of(d, "reader")
        (state,) = loads_of(d, "reader@g1")
        assert d.cpu_pool_drained()
        return [worker.block_tokens(b) for b in full.gpu_blocks], worker.state_of(*state.gpu_blocks)
    finally:
        d.close()


def check_restored_exact(model, prefix: list[int], decoded: int = 0,  # type: ignore[no-untyped-def]
                         aligned: bool = True) -> None:
    full, state = restored(model, prefix, decoded, aligned)
    blocks = len(prefix) // BLOCK_SIZE
    assert full == [[t % 251 for t in prefix[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]] for i in range(blocks)]
    assert state == {state_after(prefix)}, "the state restored is not the one after the prefix's last token"


def test_the_restored_state_is_the_one_at_the_prefix_end_byte_exact(model) -> None:
    check_restored_exact(model, PREFIX)


def test_a_decoded_blocks_state_is_restored_byte_exact_too(model) -> None:
    """The writer decodes past its prompt: the state after its first decoded block is stored as that block completes,
    and a reader of the prompt and those sampled tokens restores it."""
    check_restored_exact(model, PREFIX + [1, 2, 3] + [SAMPLED_TOKEN] * (BLOCK_SIZE - 3), decoded=BLOCK_SIZE)


def test_control_chunks_not_ended_at_block_ends_leave_no_state_there_to_restore(model) -> None:
    """Without vLLM's align split the writer's prompt is computed in one chunk: its state lands in the block of its
    last token, and the block at the prompt's last whole block holds no state; the byte check catches it."""
    with pytest.raises(AssertionError, match="not the one after the prefix's last token"):
        check_restored_exact(model, PREFIX, aligned=False)


@pytest.mark.parametrize(("state", "factor", "refusal", "why"), [
    (state_spec(mamba_cache_mode="none"), 1, "mamba_cache_mode 'none'",
     "kvfsm offloads a state only in 'align' mode (prefix caching on), where vLLM keeps the state at each block's end"),
    (state_spec(num_speculative_blocks=1), 1, "1 speculative blocks",
     "vLLM moves those within the block table, so a block no longer holds the state at its own end"),
    (state_spec(), 2, "block_size_factor is 2",
     "a CPU block of several GPU blocks would hold states vLLM never kept (only the last block's is); use 1"),
])
def test_a_state_kvfsm_cannot_keep_whole_is_refused_by_name_saying_why(state: MambaSpec, factor: int, refusal: str,
                                                                       why: str) -> None:
    with pytest.raises(UnsupportedKVCache, match=refusal) as refused:
        groups.offloaded_groups(mamba_cache(48, state), BLOCK_SIZE, factor)
    assert str(refused.value).startswith("KV-cache group 1 is a MambaSpec") and str(refused.value).endswith(why)
    assert "(0: FullAttentionSpec, 1: MambaSpec)" in str(refused.value)


def test_the_scheduler_refuses_a_state_under_a_block_size_factor_by_name(model) -> None:
    config = vllm_config(model, {"cpu_blocks": 32, "block_size_factor": 2}, 48)
    with pytest.raises(UnsupportedKVCache, match="block_size_factor is 2"):
        KvfsmConnector(config, KVConnectorRole.SCHEDULER, mamba_cache(48))


def test_the_state_group_follows_the_full_attention_group() -> None:
    full, state = groups.offloaded_groups(mamba_cache(48), BLOCK_SIZE)
    assert (full.index, full.state, state.index, state.state) == (0, False, 1, True)
    assert [state.first_kept(tokens, BLOCK_SIZE) for tokens in (1, 16, 17, 64, 65)] == [0, 0, 1, 3, 4]
