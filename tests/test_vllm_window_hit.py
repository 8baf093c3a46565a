"""`longest-window-hit`: a request with sliding-window groups is offered the longest prefix at whose end every sliding
group holds its whole window, up to where the full-attention group's hit ends (`kvfsm.integrations.vllm.window_hit`).

Under vLLM's real Scheduler, the hybrid allocator on: a prompt whose window at the full hit's end the CPU pool lacks,
but an earlier one it holds, loads that shorter hit byte-exact in both groups and recomputes less than the whole
prompt. Each half of the rule has a mutant (`kvfsm.testing.window_mutants`) this scenario catches. The search itself is
checked against the rule's definition on generated pools (sliding windows, or chunked local attention's chunks), and
its work against its bound: each block read at most once per group (a control shows the naive search, every candidate
end's window read again, past that bound).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import pytest

pytest.importorskip("vllm")

from hypothesis import given, strategies as st  # noqa: E402

from kvfsm.integrations.vllm.groups import Group  # noqa: E402
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, vllm_config  # noqa: E402
from kvfsm.integrations.vllm.window_hit import WindowHits  # noqa: E402
from kvfsm.manager.catalogue import Lookup  # noqa: E402
from kvfsm.testing.window_mutants import WINDOW_HIT_MUTANTS  # noqa: E402
from test_vllm_groups import FULL, WINDOW, HybridWorker, hybrid_cache  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

LONG = PREFIX + list(range(700, 700 + 3 * BLOCK_SIZE))
"""Seven blocks: the first four are PREFIX, whose writer stored the sliding group's blocks 2 and 3; this prompt's
writer stores its window at its own end, blocks 5 and 6, so the sliding group never stored block 4."""
READER = LONG[:6 * BLOCK_SIZE] + [9]
"""The full group's hit is six blocks, whose window (blocks 4, 5) lacks block 4; the window ending at block 4 is held."""
WINDOW_BLOCKS = WINDOW // BLOCK_SIZE


def block(i: int, group: int) -> list[int]:
    """What `HybridWorker` wrote in `group`'s block `i` of LONG."""
    return [t % 251 + 256 * group for t in LONG[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


def reader_recomputes(d: Driver, worker: HybridWorker) -> int:
    """Both writers stored, the GPU forgotten and zeroed, the reader runs: the prompt tokens it computed. Every block
    it loaded holds the writers' bytes, and the sliding group loaded the whole window ending where the hit ends."""
    store_prefix(d)
    store_prefix(d, LONG + [1, 2, 3], "long")
    worker.caches[FULL].zero_()  # whatever the reader finds now came from the CPU pool
    d.add("reader", READER)
    d.run()
    full = [b for order in loads_of(d, "reader") for b in order.gpu_blocks]
    window = [b for order in loads_of(d, "reader@g1") for b in order.gpu_blocks]
    end = len(full)
    assert [worker.block_tokens(b) for b in full] == [block(i, 0) for i in range(end)]
    assert [worker.block_tokens(b) for b in window] == [block(i, 1) for i in range(max(0, end - WINDOW_BLOCKS), end)], \
        f"the window ending at the hit's block {end} was not loaded whole"
    assert d.cpu_pool_drained()
    return len(READER) - next(log.first_computed["reader"] for log in d.log if "reader" in log.first_computed)


@pytest.fixture
def rig(model):  # type: ignore[no-untyped-def]
    """A driver on the hybrid configuration with the byte-writing worker, closed afterwards."""
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = HybridWorker(config)
    d = Driver(config, worker, hybrid_cache(48))
    yield d, worker
    d.close()


def loads_the_shorter_hit(d: Driver, worker: HybridWorker) -> None:
    """The reader loads the four blocks whose window is whole and recomputes only the rest of its prompt."""
    recomputed = reader_recomputes(d, worker)
    assert recomputed == len(READER) - 4 * BLOCK_SIZE, f"recomputed {recomputed} of {len(READER)} prompt tokens"


def test_a_window_missing_at_the_full_hit_falls_back_to_the_longest_whole_window(rig) -> None:
    loads_the_shorter_hit(*rig)


CAUGHT_BY = {
    "no-shorter-window-hit": f"recomputed {len(READER)} of {len(READER)} prompt tokens",
    "window-one-block-short": "the window ending at the hit's block 6 was not loaded whole",
}
"""What catches each mutant: the old rule recomputes the whole prompt; a partial window's hit is loaded short."""


@pytest.mark.parametrize("name", sorted(WINDOW_HIT_MUTANTS))
def test_a_mutant_of_the_window_hit_is_caught(name: str, rig) -> None:
    d, worker = rig
    WINDOW_HIT_MUTANTS[name](d.connector.scheduler_side.window_hits)
    with pytest.raises(AssertionError, match=CAUGHT_BY[name]):
        loads_the_shorter_hit(d, worker)


class Pool:
    """The CPU pool's catalogue as the search reads it: the keys it holds ready, and how many keys it was asked."""

    def __init__(self, held: set[tuple[int, int]]) -> None:
        self.held, self.reads = held, 0

    def lookup(self, keys: Sequence[tuple[int, int]], every_busy: bool = True) -> Lookup:
        hits = next((i for i, key in enumerate(keys) if key not in self.held), len(keys))
        self.reads += min(len(keys), hits + 1)
        return Lookup(hits, ())


def searcher(held: set[tuple[int, int]], windows: Sequence[int], factor: int,
             chunked: bool = False) -> tuple[WindowHits, Pool]:
    """The search over a pool holding `held` (group rank, GPU block of a CPU block's key), sliding groups of these
    windows (tokens; chunked local attention groups of these chunks if `chunked`), CPU blocks of `factor` GPU
    blocks."""
    pool = Pool(held)
    kvfsm = SimpleNamespace(config=SimpleNamespace(gpu_block_size=BLOCK_SIZE, block_size_factor=factor), manager=pool)
    groups = [Group(i + 1, i + 1, None, chunk=w) if chunked else Group(i + 1, i + 1, w) for i, w in enumerate(windows)]
    return WindowHits(kvfsm, groups), pool


def views(windows: Sequence[int], blocks: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(block_hashes=[(i + 1, b) for b in range(blocks)]) for i in range(len(windows))]


def naive_end(hits: WindowHits, pool: Pool, groups: Sequence[SimpleNamespace], first: int, end: int) -> int:
    """The rule's definition read literally: every candidate end, longest first, each window read whole again."""
    k = hits.kvfsm.config.block_size_factor
    for candidate in range(end, first, -1):
        if all(pool.lookup([view.block_hashes[b // k * k + k - 1] if b // k * k + k - 1 < len(view.block_hashes)
                            else None for b in range(hits.window_start(group, first, candidate), candidate)]).hits
               == candidate - hits.window_start(group, first, candidate) for view, group in zip(groups, hits.windows)):
            return candidate
    return first


@st.composite
def pools(draw: st.DrawFn) -> tuple:
    blocks = draw(st.integers(1, 40))
    first = draw(st.integers(0, blocks))
    end = draw(st.integers(first, blocks))
    windows = draw(st.lists(st.integers(1, 6 * BLOCK_SIZE), min_size=1, max_size=3))
    factor = draw(st.sampled_from((1, 2, 4)))
    keys = [(g + 1, b * factor + factor - 1) for g in range(len(windows)) for b in range(blocks // factor)]
    held = set(draw(st.lists(st.sampled_from(keys), unique=True))) if keys else set()
    return blocks, first, end, windows, factor, held


@given(pools(), st.booleans())
def test_the_search_finds_the_longest_end_whose_windows_are_whole_reading_each_block_once(pool_case: tuple,
                                                                                           chunked: bool) -> None:
    """Sliding windows, or chunked local attention's chunks (a window from the start of its end's chunk)."""
    blocks, first, end, windows, factor, held = pool_case
    hits, pool = searcher(held, windows, factor, chunked)
    found = hits.longest_end(views(windows, blocks), first, end)
    assert pool.reads <= 2 * len(windows) * (end - first + 1)
    oracle, oracle_pool = searcher(held, windows, factor, chunked)
    assert found == naive_end(oracle, oracle_pool, views(windows, blocks), first, end)


@pytest.mark.parametrize("name", sorted(WINDOW_HIT_MUTANTS))
def test_a_mutant_of_the_search_is_caught_by_the_rules_definition(name: str) -> None:
    """A window of four blocks, the pool lacking the first block of the window at its end: the longest whole window
    ends at that block."""
    windows, blocks = [4 * BLOCK_SIZE], 12
    held = {(1, b) for b in range(blocks) if b != 8}
    hits, _ = searcher(held, windows, 1)
    WINDOW_HIT_MUTANTS[name](hits)
    oracle, oracle_pool = searcher(held, windows, 1)
    expected = naive_end(oracle, oracle_pool, views(windows, blocks), 0, blocks)
    assert expected == 8
    assert hits.longest_end(views(windows, blocks), 0, blocks) != expected


def test_control_the_naive_search_reads_past_the_bound() -> None:
    """A long window held whole beside a one-block window lacking every block but the first: each candidate end is one
    block shorter than the last, and the naive search reads the long window again for each."""
    windows, blocks = [64 * BLOCK_SIZE, BLOCK_SIZE], 400
    held = {(1, b) for b in range(blocks)} | {(2, 0)}
    hits, pool = searcher(held, windows, 1)
    assert hits.longest_end(views(windows, blocks), 0, blocks) == 1
    assert pool.reads <= 2 * len(windows) * (blocks + 1)
    naive, naive_pool = searcher(held, windows, 1)
    assert naive_end(naive, naive_pool, views(windows, blocks), 0, blocks) == 1
    assert naive_pool.reads > 2 * len(windows) * (blocks + 1)
