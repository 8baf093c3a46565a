"""A hybrid cache on a real GPU, through kvfsm's public API: CUDA streams, events and the pinned pool.

A full-attention group, a sliding window and a state (`kvfsm.testing.hybrid_rig`) round-trip byte-exact through
store, eviction from the GPU and reload, only the window's and the state's blocks moved for those groups, in a
cross-layer cache and in one tensor per layer. The out-of-window reuse race (`kvfsm.testing.hybrid_race`), 20 trials
each: the blocks a writer's window leaves behind while its stores still copy them (queued behind 2 GiB of its
full-attention blocks) go to another request whose poison and prefill are issued on the compute stream right after
the allocation. kvfsm waits for those stores first and every reloaded byte is the writer's; each control that removes the window's
fence reloads another request's bytes (or poison) as the window and the state. The reuse trials run unchecked (the
host as fast as an engine's in production); the rules each control breaks are named on the simulator
(tests/test_hybrid_rig.py), where every trial is checked.
"""

from __future__ import annotations

import pytest

from kvfsm.testing.hybrid_race import CONTROLS, GPU, GPU_PER_LAYER, Scenario, trials

pytestmark = pytest.mark.gpu

TRIALS = 20


@pytest.mark.parametrize("scenario", [GPU, GPU_PER_LAYER], ids=["cross-layer", "kv-first"])
def test_a_hybrid_cache_round_trips_byte_exact_through_store_eviction_and_reload(scenario: Scenario) -> None:
    (run,) = trials("cuda", scenario, 1, reuse=False)
    assert run.stored == run.loaded == {"full": scenario.prompt_blocks, "window": scenario.shape.window_blocks,
                                        "state": 1}
    assert run.corrupted == {"full": 0, "window": 0, "state": 0}
    assert run.broken == ()
    assert run.null_intact


def test_kvfsm_keeps_every_out_of_window_reuse_trial_intact() -> None:
    runs = trials("cuda", GPU, TRIALS)
    assert all(run.reused == GPU.shape.window_blocks + 1 for run in runs), "the stored blocks were not handed out"
    assert any(run.flushed == 2 for run in runs), "no step handed them out while their stores were in flight"
    assert [run for run in runs if run.corrupt or not run.null_intact] == []


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_control_without_the_window_fence_corrupts_a_block_the_window_left_behind(control: str) -> None:
    runs = trials("cuda", GPU, TRIALS, control)
    assert any(run.corrupt for run in runs), f"{control} corrupted nothing in {TRIALS} trials"
    assert all(run.corrupted["full"] == 0 and run.flushed == 0 for run in runs)
