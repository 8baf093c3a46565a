"""Which KV-cache groups vLLM is told a load restores (`loaded-groups`, `SchedulerSide.get_loaded_kv_cache_group_ids`),
under vLLM 0.32's real Scheduler, the hybrid allocator on.

vLLM leaves a told group's loaded blocks unzeroed and, for DeepSeek-V4.1's bounded-replay window (a
`SlidingWindowMLASpec` vLLM keeps no GPU prefix cache of), recomputes the hit's last window unless that group is told,
or sets a hit no longer than the window aside. So vLLM is told exactly the groups whose hit kvfsm's load leaves whole:
a replay window the load writes whole is taken as loaded, one begun below the GPU prefix's end too (vLLM gives it
fresh blocks there) when the CPU pool holds it, but not when the pool lacks its blocks below that end (nobody writes
them), and every other kind (full attention, several full groups, a sliding window, a state) is told whenever it is
part of the hit. After a GPU prefix a load writes only blocks vLLM gave the request afresh, never one its GPU prefix
cache serves. Skipped without vLLM.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

pytest.importorskip("vllm")

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, vllm_config  # noqa: E402
from test_vllm_full_groups import two_full_groups  # noqa: E402
from test_vllm_groups import HybridWorker, hybrid_cache  # noqa: E402
from test_vllm_mamba import align_config, mamba_cache  # noqa: E402
from test_vllm_window_offers import REPLAY, first_computed, replay_cache  # noqa: E402
from vllm_harness import Driver  # noqa: E402
from vllm_support import PREFIX, loads_of, model, store_prefix  # noqa: E402,F401

pytestmark = pytest.mark.vllm

LONG = PREFIX + list(range(300, 300 + 4 * BLOCK_SIZE))
"""Eight blocks: a hit of all of them is longer than the replay window (REPLAY, six blocks), whose first kept block at
the hit's end is block 2."""


def told(d: Driver, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[int, ...]]]:
    """Every answer vLLM's scheduler gets to `get_loaded_kv_cache_group_ids`, by request, in order."""
    answers: dict[str, list[tuple[int, ...]]] = {}
    ask = d.connector.get_loaded_kv_cache_group_ids

    def recorded(request: Any) -> tuple[int, ...]:
        answer = tuple(ask(request))
        answers.setdefault(request.request_id, []).append(answer)
        return answer

    monkeypatch.setattr(d.connector, "get_loaded_kv_cache_group_ids", recorded)
    return answers


def loaded_blocks(d: Driver, req_id: str) -> list[int]:
    """GPU blocks loaded for the request, per group in vLLM's order."""
    return [sum(len(order.gpu_blocks) for order in loads_of(d, g.request_id(req_id)))
            for g in sorted(d.connector.scheduler_side.groups, key=lambda g: g.index)]


@pytest.mark.parametrize("prompt, loaded", [(PREFIX, [4, 2, 4]), (LONG, [8, 2, 6])],
                         ids=["no-longer-than-the-window", "longer-than-the-window"])
def test_a_hit_that_restores_the_replay_window_is_computed_on_neither_recomputed_nor_set_aside(
        model, monkeypatch, prompt: list[int], loaded: list[int]) -> None:
    """No GPU prefix holds any of the prompt: kvfsm loads every group's blocks of the hit, the replay window's whole
    (all four of PREFIX, blocks 2 to 7 of LONG), and vLLM is told all three groups each time it asks, so it computes
    from the hit's end. vLLM's default answer, its prefix-cacheable groups, left the replay group out: a hit no longer
    than the window was set aside (the reader recomputed its whole prompt), a longer one's last window recomputed."""
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48))
    try:
        store_prefix(d, prompt + [1, 2, 3])
        answers = told(d, monkeypatch)
        d.add("reader", prompt + [9])
        d.run()
        assert first_computed(d, "reader") == len(prompt)
        assert loaded_blocks(d, "reader") == loaded
        assert set(answers["reader"]) == {(0, 1, 2)}
        assert d.cpu_pool_drained()
    finally:
        d.close()


def warm_gpu_prefix(d: Driver, blocks: int) -> None:
    """vLLM's GPU prefix cache holds LONG's first `blocks` blocks (in every group it caches): a request computed them
    and went on into tokens of its own (seven blocks of them, so every window it stored at its prompt's end is its own
    tokens' and none of LONG's)."""
    d.add("warm", LONG[:blocks * BLOCK_SIZE] + list(range(900, 900 + 7 * BLOCK_SIZE)))
    d.run()


@pytest.mark.parametrize("prompt, gpu_prefix_blocks, loaded", [(PREFIX, 1, [3, 2, 4]), (LONG, 3, [5, 2, 6])],
                         ids=["no-longer-than-the-window", "longer-than-the-window"])
def test_a_replay_window_begun_below_the_gpu_prefixs_end_is_loaded_whole_and_told_loaded(
        model, monkeypatch, prompt: list[int], gpu_prefix_blocks: int, loaded: list[int]) -> None:
    """vLLM's GPU prefix cache holds the prompt's first blocks (one of PREFIX, three of LONG): the replay window at the
    hit's end starts below the GPU prefix's end (at block 0 of PREFIX, 2 of LONG), where vLLM gives the replay group
    fresh blocks (it caches none of them); the CPU pool holds the writer's window there, so kvfsm loads the whole
    window (blocks 0 to 3 of PREFIX, 2 to 7 of LONG) and vLLM is told all three groups each time it asks: it computes
    from the hit's end, recomputing nothing. Loading it only from the GPU prefix's end and leaving the group out (as
    kvfsm did) threw that load away: vLLM set PREFIX's hit aside and recomputed LONG's last window."""
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48))
    try:
        store_prefix(d, prompt + [1, 2, 3])
        warm_gpu_prefix(d, gpu_prefix_blocks)
        answers = told(d, monkeypatch)
        d.add("reader", prompt + [9])
        d.run()
        assert loaded_blocks(d, "reader") == loaded
        assert set(answers["reader"]) == {(0, 1, 2)}
        assert first_computed(d, "reader") == len(prompt)
        assert d.cpu_pool_drained()
    finally:
        d.close()


def test_a_replay_window_the_cpu_pool_lacks_below_the_gpu_prefixs_end_is_not_told_loaded_and_vllm_recomputes_it(
        model, monkeypatch) -> None:
    """A reader of LONG's first seven blocks whose first six vLLM's GPU prefix cache holds: the replay window at the
    hit's end starts at block 1, but the CPU pool holds the replay group's blocks 2 to 7 only (the writer's window at
    its own end), so kvfsm loads block 6 of every group, the replay group's from the GPU prefix's end, and leaves the
    replay group out each time vLLM asks: vLLM recomputes the hit's last window (told loaded, it would compute on
    blocks 1 to 5 unwritten)."""
    d = Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48))
    try:
        store_prefix(d, LONG + [1, 2, 3])
        warm_gpu_prefix(d, 6)
        answers = told(d, monkeypatch)
        d.add("reader", LONG[:7 * BLOCK_SIZE] + [9])
        d.run()
        assert loaded_blocks(d, "reader") == [1, 1, 1]
        assert set(answers["reader"]) == {(0, 1)}
        assert first_computed(d, "reader") == 7 * BLOCK_SIZE - REPLAY
        assert d.cpu_pool_drained()
    finally:
        d.close()


def full_driver(model) -> Driver:  # type: ignore[no-untyped-def]
    return Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker())


def hybrid_driver(model) -> Driver:  # type: ignore[no-untyped-def]
    return Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), hybrid_cache(48))


def full_groups_driver(model) -> Driver:  # type: ignore[no-untyped-def]
    return Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), two_full_groups(48))


def mamba_driver(model) -> Driver:  # type: ignore[no-untyped-def]
    return Driver(align_config(model, 48), FakeWorker(), mamba_cache(48))


@pytest.mark.parametrize("build, gpu_prefix_blocks, groups", [
    (full_driver, 0, (0,)),
    (hybrid_driver, 0, (0, 1)),
    (full_groups_driver, 0, (0, 1, 2)),
    (full_groups_driver, 1, (0, 1, 2)),
    (mamba_driver, 0, (0, 1)),
    (mamba_driver, 3, (0, 1)),
], ids=["full", "full+sliding", "full+full+sliding", "full+full+sliding-after-a-gpu-prefix", "full+state",
        "full+state-after-a-gpu-prefix"])
def test_every_group_of_a_hit_vllm_caches_on_its_gpu_is_told_loaded(model, monkeypatch,
                                                                      build: Callable[[Any], Driver],
                                                                      gpu_prefix_blocks: int,
                                                                      groups: tuple[int, ...]) -> None:
    """Full attention alone or beside a second full group, a sliding window or a state: what kvfsm does not load of
    them (blocks below the GPU prefix's end, a window's blocks below its start) vLLM holds itself, so each is told
    loaded, a full group after the first too when its blocks below the GPU prefix's end are vLLM's."""
    d = build(model)
    try:
        store_prefix(d)
        if gpu_prefix_blocks:
            d.add("warm", PREFIX[:gpu_prefix_blocks * BLOCK_SIZE] + [5])
            d.run()
        answers = told(d, monkeypatch)
        d.add("reader", PREFIX + [9])
        d.run()
        assert first_computed(d, "reader") == len(PREFIX)
        assert all(loaded_blocks(d, "reader")), "every group loads part of the hit"
        assert set(answers["reader"]) == {groups}
        assert d.cpu_pool_drained()
    finally:
        d.close()


def replay_driver(model) -> Driver:  # type: ignore[no-untyped-def]
    return Driver(vllm_config(model, {"cpu_blocks": 32}, 48), FakeWorker(), replay_cache(48))


def loads_fresh_blocks_only(d: Driver) -> None:
    """Each GPU block the step's loads write is one vLLM's pool holds for one request only and has cached under no
    hash (an asynchronous load's blocks are cached once it lands): never a block its GPU prefix cache served."""
    pool = d.scheduler.kv_cache_manager.block_pool
    shared = [(order.req_id, b) for order in d.log[-1].orders.loads for b in order.gpu_blocks
              if pool.blocks[b].ref_cnt != 1 or pool.blocks[b].block_hash is not None]
    assert not shared, f"step {d.step_no}: loads write blocks vLLM shares or caches: {shared}"


@pytest.mark.parametrize("build, prompt, gpu_prefix_blocks", [
    (full_groups_driver, PREFIX, 1),
    (hybrid_driver, LONG, 3),
    (mamba_driver, PREFIX, 3),
    (replay_driver, PREFIX, 1),
    (replay_driver, LONG, 3),
], ids=["full+full+sliding", "full+sliding", "full+state", "replay-no-longer-than-the-window",
        "replay-longer-than-the-window"])
def test_a_load_after_a_gpu_prefix_writes_only_blocks_vllm_gave_the_request_afresh(
        model, build: Callable[[Any], Driver], prompt: list[int], gpu_prefix_blocks: int) -> None:
    """vLLM's GPU prefix cache holds the prompt's first blocks: a group it caches is loaded from the GPU prefix's end
    on (below it vLLM's cached blocks, which other requests may hold, serve the request), and a replay window vLLM
    caches none of is loaded whole, into the fresh blocks vLLM gave it below that end too."""
    d = build(model)
    try:
        store_prefix(d, prompt + [1, 2, 3])
        d.add("warm", prompt[:gpu_prefix_blocks * BLOCK_SIZE] + [5])
        d.run()
        d.add("reader", prompt + [9])
        d.run(after_step=lambda: loads_fresh_blocks_only(d))
        assert loaded_blocks(d, "reader")[0] == len(prompt) // BLOCK_SIZE - gpu_prefix_blocks, "a GPU prefix served"
        assert d.cpu_pool_drained()
    finally:
        d.close()


class ReplayWorker(HybridWorker):
    """`HybridWorker` over `replay_cache`'s groups: a position's token id (mod 251) plus 256 times its group's index
    lands in that group's block, so a reloaded block's bytes say which prefix and group they came from."""

    layers = ("layers.0.attn", "layers.1.attn", "layers.2.attn")

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        self.open(config, replay_cache(config.cache_config.num_gpu_blocks))


def written(prompt: list[int], i: int, group: int) -> list[int]:
    """What `ReplayWorker` wrote in `group`'s block `i` of `prompt`."""
    return [t % 251 + 256 * group for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


@pytest.mark.parametrize("prompt, gpu_prefix_blocks, window", [(PREFIX, 0, range(4)), (LONG, 3, range(2, 8))],
                         ids=["no-gpu-prefix", "begun-below-the-gpu-prefixs-end"])
def test_the_replay_window_vllm_computes_on_unreplayed_holds_the_prefixs_bytes(
        model, prompt: list[int], gpu_prefix_blocks: int, window: range) -> None:
    """The GPU zeroed after the writer's stores (and the request that left a GPU prefix, if any): the reader, told the
    replay group loaded, computes from the prompt's end, and each of its replay-window blocks holds the writer's bytes
    of that group, loaded from the CPU pool, those below the GPU prefix's end too (one named loaded but left unwritten
    would read zeros there)."""
    config = vllm_config(model, {"cpu_blocks": 32}, 48)
    worker = ReplayWorker(config)
    d = Driver(config, worker, replay_cache(48))
    try:
        store_prefix(d, prompt + [1, 2, 3])
        if gpu_prefix_blocks:
            warm_gpu_prefix(d, gpu_prefix_blocks)
        worker.caches[ReplayWorker.layers[0]].zero_()  # whatever the reader's window holds now came from the CPU pool
        d.add("reader", prompt + [9])
        d.step()
        table = d.scheduler.kv_cache_manager.get_block_ids("reader")[2]
        d.run()
        assert first_computed(d, "reader") == len(prompt)
        assert [worker.block_tokens(table[i]) for i in window] == [written(prompt, i, 2) for i in window]
        assert d.cpu_pool_drained()
    finally:
        d.close()
