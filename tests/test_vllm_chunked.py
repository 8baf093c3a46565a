"""A chunked local attention KV-cache group under vLLM 0.32's hybrid allocator, with vLLM's real Scheduler: a
full-attention group beside a `ChunkedLocalAttentionSpec` group, offloaded as a sliding window whose first kept block
is the start of the chunk the hit's end is in (`Group.first_kept`).

Only the blocks of that chunk at a prompt's end are stored and reloaded, byte-exact; the blocks vLLM frees as a running
request enters its next chunk are fenced (`window-fence`) before vLLM hands them out again. Each rule has a control
that breaks it and is caught; a chunk that is not a whole number of blocks is refused by name. Every scenario runs
traced against the spec, with the harness's checks on vLLM's tables (per group) and the drain. Skipped without vLLM.
"""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec  # noqa: E402

from kvfsm.integrations.vllm import UnsupportedKVCache, groups  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, FakeWorker, vllm_config  # noqa: E402
from kvfsm.testing.window_mutants import WINDOW_HIT_MUTANTS  # noqa: E402
from test_vllm_groups import (  # noqa: E402
    FULL,
    HybridWorker,
    hybrid_cache,
    left_behind_then_fenced,
    no_null_block,
    prefix_block,
    reloaded_bytes,
    stores_of,
    unslid_written_under_store,
)
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

CHUNK = 3 * BLOCK_SIZE
"""Tokens of a chunk: PREFIX's four blocks end inside its second chunk, so a hit on it needs that chunk's block 3."""
SHAPE = dict(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16)


def chunked(chunk: int = CHUNK) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=chunk)  # type: ignore[arg-type]


@pytest.fixture
def local(model) -> Iterator:
    """Builds drivers on the full + chunked-local configuration and stops their tracing afterwards."""
    opened: list[Driver] = []

    def build(worker: FakeWorker | None = None, gpu_blocks: int = 48, chunk: int = CHUNK) -> Driver:
        d = Driver(vllm_config(model, {"cpu_blocks": 32}, gpu_blocks), worker or FakeWorker(),
                   hybrid_cache(gpu_blocks, chunked(chunk)))
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


@pytest.fixture
def byte_rig(model) -> Iterator:
    """A driver on the full + chunked-local configuration with the byte-writing worker, closed afterwards."""
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = HybridWorker(config, chunked())
    d = Driver(config, worker, hybrid_cache(48, chunked()))
    yield d, worker
    d.close()


def reloads_only_its_chunk(d: Driver, worker: HybridWorker) -> None:
    """The writer stored its prompt's last chunk's blocks only; the reader reloads every full block and that chunk's
    block, each holding the writer's bytes of its own group."""
    full, local = reloaded_bytes(d, worker)
    assert [len(s) for s in stores_of(d, "writer@g1")] == [1], "the chunked group stored beyond its chunk"
    assert full == [prefix_block(i, 0) for i in range(4)]
    assert local == [prefix_block(3, 1)], "the chunk the hit ends in was not reloaded whole"
    no_null_block(d)
    assert d.cpu_pool_drained()


def test_a_prefix_reloads_every_full_block_and_only_its_chunks_blocks(byte_rig) -> None:
    reloads_only_its_chunk(*byte_rig)


def first_kept_one_block_late(d: Driver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The chunk's first block is taken as left behind: never stored nor looked up, and slid while vLLM holds it."""
    first_kept = groups.Group.first_kept
    monkeypatch.setattr(groups.Group, "first_kept", lambda group, tokens, block_size: first_kept(
        group, tokens, block_size) + (group.chunk is not None and tokens % CHUNK > 0))


def hit_one_block_short(d: Driver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The hit's chunk is held from its second block on: the hit is offered without the chunk's first block."""
    WINDOW_HIT_MUTANTS["window-one-block-short"](d.connector.scheduler_side.window_hits)


CONTROLS = {
    first_kept_one_block_late: "the adapter has writer's blocks as .* vLLM holds .* \\(group 1\\)",
    hit_one_block_short: "the chunk the hit ends in was not reloaded whole",
}
"""What catches each control: vLLM's own table, which still holds the block kvfsm took as left behind; the reload,
which lacks the block vLLM attends to."""


@pytest.mark.parametrize("control", CONTROLS, ids=lambda control: control.__name__)
def test_control_a_chunk_kept_one_block_short_is_caught(control, byte_rig, monkeypatch) -> None:  # type: ignore
    control(byte_rig[0], monkeypatch)
    with pytest.raises(AssertionError, match=CONTROLS[control]):
        reloads_only_its_chunk(*byte_rig)


LONG = PREFIX + list(range(700, 700 + 3 * BLOCK_SIZE))
"""Seven blocks, PREFIX first: its writer stores the chunked group's block 6 (its prompt's last chunk), PREFIX's block
3, so the chunked group never stored block 4."""


def loads_the_shorter_chunk_hit(d: Driver, worker: HybridWorker) -> None:
    """A five-block reader's chunk (blocks 3, 4) lacks block 4: the hit ends at block 4, whose chunk (block 3) is
    held, and both groups load the writers' bytes up to there (`longest-window-hit`)."""
    store_prefix(d)
    store_prefix(d, LONG + [1, 2, 3], "long")
    worker.caches[FULL].zero_()
    d.add("reader", LONG[:5 * BLOCK_SIZE] + [9])
    d.run()
    full, local = ([worker.block_tokens(b) for order in loads_of(d, tracked) for b in order.gpu_blocks]
                   for tracked in ("reader", "reader@g1"))
    assert full == [prefix_block(i, 0) for i in range(4)], f"loaded {len(full)} full blocks, not the shorter hit's 4"
    assert local == [prefix_block(3, 1)]
    assert d.cpu_pool_drained()


def test_a_chunk_missing_at_the_full_hit_falls_back_to_the_longest_whole_chunk(byte_rig) -> None:
    loads_the_shorter_chunk_hit(*byte_rig)


def test_control_without_the_shorter_hit_nothing_is_loaded(byte_rig) -> None:
    d, worker = byte_rig
    WINDOW_HIT_MUTANTS["no-shorter-window-hit"](d.connector.scheduler_side.window_hits)
    with pytest.raises(AssertionError, match="loaded 0 full blocks"):
        loads_the_shorter_chunk_hit(d, worker)


def test_a_hit_ending_at_a_chunks_boundary_needs_none_of_its_blocks() -> None:
    full, local = groups.offloaded_groups(hybrid_cache(48, chunked()), BLOCK_SIZE)
    assert (full.chunk, local.chunk) == (None, CHUNK)
    assert [local.first_kept(tokens, BLOCK_SIZE) for tokens in (0, 47, 48, 64, 95, 96)] == [0, 0, 3, 3, 3, 6]


SLIDING_CHUNK = 5 * BLOCK_SIZE
"""The slide scenarios' chunk: the writer's 67-token prompt stores its chunk's first four blocks, and its decode enters
the next chunk (token 80) while that store still reads them and the writer still runs (with `CHUNK` it would end
first, and only the ended request's fence would be tried)."""


def test_a_block_the_next_chunk_left_behind_is_fenced_before_vllm_hands_it_out(local) -> None:
    left_behind_then_fenced(local(FakeWorker(store_steps=40), gpu_blocks=14, chunk=SLIDING_CHUNK))


def test_control_without_the_slide_a_left_behind_block_is_written_under_its_store(local) -> None:
    unslid_written_under_store(local(FakeWorker(store_steps=40), gpu_blocks=14, chunk=SLIDING_CHUNK))


def test_a_chunk_of_part_of_a_block_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedKVCache, match="40-token chunks in 16-token blocks"):
        groups.offloaded_groups(hybrid_cache(48, chunked(40)), BLOCK_SIZE)
