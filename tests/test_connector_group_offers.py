"""A request's CPU hit cut where a shorter hit of all its KV-cache groups ends (`limit_match`), and a prefix offered
with the groups it needs or not at all (`match_together`), on the connector's scheduler half driven directly. The
engine's side (vLLM's sliding-window and Mamba groups) is `test_vllm_window_hit.py` and `test_vllm_mamba.py`."""

from __future__ import annotations

import pytest

from kvfsm.connector.refusals import UnknownRequest
from kvfsm.connector.scheduler import SchedulerConnector
from test_connector_scheduler import BLOCK, connector, prompt, store_prefix

PREFIX = [1, 2, 3, 4]


def looked_up(gpu_hit_blocks: int = 0) -> SchedulerConnector:
    """A prefix of four blocks ready on CPU, and reader "r" that looked it up past `gpu_hit_blocks` held on GPU."""
    sched = connector()
    store_prefix(sched, prompt("a", PREFIX), range(5))
    sched.get_num_new_matched_tokens(prompt("r", PREFIX), gpu_hit_blocks * BLOCK)
    return sched


def test_an_offer_cut_at_a_block_keeps_the_blocks_before_it_and_counts_only_those() -> None:
    sched = looked_up()
    assert sched.requests["r"].match == (0, 4)
    hits = sched.stats.cpu_hit_blocks
    sched.limit_match("r", 3)
    assert sched.requests["r"].match == (0, 3)
    assert sched.stats.cpu_hit_blocks == hits - 1


def test_an_offer_past_a_gpu_hit_is_cut_counting_from_its_first_block() -> None:
    sched = looked_up(gpu_hit_blocks=1)
    assert sched.requests["r"].match == (1, 3)
    sched.limit_match("r", 3)
    assert sched.requests["r"].match == (1, 2)


def test_cutting_a_request_that_has_no_hit_changes_nothing() -> None:
    sched = looked_up()
    sched.get_num_new_matched_tokens(prompt("z", [7, 8]), 0)
    before = (sched.requests["z"].match, sched.stats.cpu_hit_blocks)
    sched.limit_match("z", 1)
    assert (sched.requests["z"].match, sched.stats.cpu_hit_blocks) == before


def test_a_prefix_whose_group_has_no_hit_is_offered_not_at_all() -> None:
    sched = looked_up()
    sched.get_num_new_matched_tokens(prompt("r@g1", [h + 1000 for h in PREFIX]), 0)  # keys nobody stored
    assert not sched.match_together("r", ["r@g1"], 1)
    first, count = sched.requests["r"].match or (0, 0)
    assert count == 0, "the prefix is still offered without the group it needs"


def test_a_group_already_allocated_holds_no_offer_for_its_prefix_to_end_in() -> None:
    sched = looked_up()
    group = prompt("r@g1", [h + 1000 for h in PREFIX])
    sched.get_num_new_matched_tokens(group, 0)
    sched.update_state_after_alloc(group, range(50, 55), 0)  # allocated: its offer is spent (None)
    assert sched.requests["r@g1"].match is None
    assert not sched.match_together("r", ["r@g1"], 1)


def test_an_offer_of_a_request_the_connector_does_not_track_is_refused_by_name() -> None:
    sched = looked_up()
    with pytest.raises(UnknownRequest, match="request 'ghost' is not tracked by the connector"):
        sched.limit_match("ghost", 3)
    with pytest.raises(UnknownRequest, match="request 'ghost' is not tracked by the connector"):
        sched.match_together("r", ["ghost"], 3)
    assert sched.requests["r"].match == (0, 4), "refused before any offer was cut"
